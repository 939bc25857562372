"""Within-trajectory groups: every state of one wrong query scored on one sequence (``within_batch_size > 0``).

Both sides of a within-trajectory tuple (``provenance`` ``within:*``) are prefixes of the same
negative query, and the PRM is causal, so one forward pass of ``prompt ++ negative_sql`` scores all
of them at once (the evaluation's ``score_batch`` encoding). The within tuples of one negative (same
root state) form a *group*: a row ``group_ids`` [G, L] with ``group_pos`` [G, K] (slot 0 = the root
state, slot k = the chosen state of the group's k-th tuple) and ``group_margin`` [G, K] (slot 0 and
padding: 0). The loss over a group's slots is the same pair loss as over its tuples; only the forward
passes are shared (2 per tuple become 1 per negative). Groups have their own global plan (same
``epoch_plan`` over group lengths, ``within_batch_size`` per step) that cycles independently of the
pair plan; a step's length is the longer of the two buckets (``caper_jax.data.prm_training_batches``).
A within tuple that is not a prefix pair of its ``negative_sql``, or whose group does not fit the
longest bucket, stays an ordinary pair.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from caper_jax.data.clause_encoder import ClauseEncoder, join_sql, scored_text, token_ids
from caper_jax.data.prm_records import Records, is_within


@dataclasses.dataclass(frozen=True)
class WithinGroup:
    """The within-trajectory tuples of one negative query with one root state (module docstring)."""

    question: str
    schema: str
    sql: str                         # the negative query as scored whole (scored_text); every state is a prefix
    root_end: int                    # character end of the root (rejected) state in ``sql``
    chosen_ends: tuple[int, ...]     # character end of each tuple's chosen state
    margins: tuple[float, ...]
    records: tuple[int, ...]         # record index of each tuple


def _state_end(sql: str, prefix: str, clause: str) -> int | None:
    """End of ``join_sql(prefix, clause)`` in ``sql`` if that state is a prefix of ``sql``, else None."""
    text = join_sql(prefix, clause)
    return len(text) if text.strip() and sql.startswith(text) else None


def within_groups(records: Records) -> tuple[list[WithinGroup], list[int]]:
    """(groups of within-trajectory tuples, indices of the records that stay pairs).

    A record joins a group iff its provenance is ``within:*``, it carries ``negative_sql``, and both
    of its states are prefixes of that query as the PRM reads it whole (``scored_text``); the group
    key is (question, schema, negative query, root end). Groups and their tuples keep first-seen
    record order.
    """
    groups: dict[tuple[str, str, str, int], list[tuple[int, float, int]]] = {}  # (chosen end, margin, index)
    pairs = []
    texts: dict[str, str] = {}     # many tuples share one negative query
    for index in range(len(records)):
        rec = records[index]
        sql = rec.get("negative_sql")
        if not (is_within(rec) and isinstance(sql, str)):
            pairs.append(index)
            continue
        if sql not in texts:
            texts[sql] = scored_text(sql)[0]
        sql = texts[sql]
        root = _state_end(sql, rec["prefix_rejected"], rec["rejected"])
        chosen = _state_end(sql, rec["prefix_chosen"], rec["chosen"])
        if root is None or chosen is None:
            pairs.append(index)
            continue
        groups.setdefault((rec["question"], rec["schema"], sql, root), []).append(
            (chosen, float(rec["margin"]), index))
    out = [WithinGroup(question, schema, sql, root, tuple(c for c, _, _ in members),
                       tuple(m for _, m, _ in members), tuple(i for _, _, i in members))
           for (question, schema, sql, root), members in groups.items()]
    return out, pairs


class GroupEncoder:
    """``prompt ++ sql`` of each group, tokenised as ``score_batch`` does, with every state's last token."""

    def __init__(self, encoder: ClauseEncoder):
        self.encoder = encoder

    def encode(self, groups: Sequence[WithinGroup]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, positions) per group; positions[0] is the root state's, then one per tuple. Not truncated."""
        if not groups:
            return []
        tokens = token_ids(self.encoder.tokenizer, [g.sql for g in groups], offsets=True)
        prompts = self.encoder.prompt_ids([(g.question, g.schema) for g in groups])
        out = []
        for group, ids, offsets, prompt in zip(groups, tokens["input_ids"], tokens["offset_mapping"], prompts):
            starts = [start for start, _ in offsets]
            ends = (group.root_end,) + group.chosen_ends
            pos = [len(prompt) + bisect.bisect_left(starts, end) - 1 for end in ends]
            out.append((np.concatenate([prompt, np.asarray(ids, np.int32)]), np.asarray(pos, np.int32)))
        return out

