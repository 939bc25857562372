"""Clause-PRM evaluation input: one sequence per query, read at the last token of every clause (``score_batch``).

The PRM is causal, so every clause prefix of a query is visible in one forward pass; a clause is
read where training reads its state (``caper_jax.data.clause_encoder``), the last one at ``END_OF_SQL``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import numpy as np

from caper_jax.data.bucket_plan import bucket_index, default_bucket_lengths
from caper_jax.data.clause_encoder import (ClauseEncoder, PromptFn, Tokenizer, resolve_pad_id, scored_text,
                                           token_ids)
from caper_jax.data.prm_records import clause_id


def score_batch(
    sql_rows: Sequence[Mapping[str, str]],
    tokenizer: Tokenizer,
    *,
    max_len: int = 1024,
    bucket_lengths: Sequence[int] | None = None,
    prompt_fn: PromptFn | None = None,
    pad_id: int | None = None,
    clause_multiple: int = 8,
) -> dict[str, np.ndarray]:
    """One sequence per query (``question``, ``schema``, ``sql``) with the last token of every clause.

    The query is read as ``scored_text`` gives it (its clauses, then ``END_OF_SQL``), and its last
    clause at ``END_OF_SQL``: training reads a query's last clause there too.

    Returns ``input_ids``/``mask`` [B, L] (L = shortest bucket that fits), ``clause_pos`` and
    ``clause_id`` [B, K] (-1 padded; K rounded up to ``clause_multiple`` so jit sees few shapes).
    Too long: the leftmost tokens go (prompt first); a clause whose last token falls off gets -1.
    SQL that does not parse gets no clause positions (all -1); the model still sees its tokens.
    """
    if not sql_rows:
        raise ValueError("score_batch needs at least one row")
    ladder = tuple(bucket_lengths or default_bucket_lengths(max_len))
    encoder = ClauseEncoder(tokenizer, max_len, prompt_fn)
    scored = [scored_text(row["sql"]) for row in sql_rows]
    tokens = token_ids(tokenizer, [text for text, _ in scored], offsets=True)
    sequences, positions, names = [], [], []
    prompts = encoder.prompt_ids([(row["question"], row["schema"]) for row in sql_rows])
    for (text, units), ids, offsets, prompt in zip(scored, tokens["input_ids"], tokens["offset_mapping"], prompts):
        full = np.concatenate([prompt, np.asarray(ids, np.int32)])
        shift = max(0, len(full) - max_len)
        starts = [start for start, _ in offsets]
        # A clause is read at its last token; the last clause at END_OF_SQL, the sequence's last token.
        pos = [len(prompt) + bisect.bisect_left(starts, unit.end) - 1 - shift for unit in units[:-1]]
        pos += [len(full) - 1 - shift] if units else []
        sequences.append(full[shift:])
        positions.append([p if p >= 0 else -1 for p in pos])
        names.append([clause_id(unit.name) for unit in units])
    longest = max(len(s) for s in sequences)
    length = ladder[bucket_index(np.asarray([longest]), ladder)[0]]
    width = max(clause_multiple, -(-max(len(p) for p in positions) // clause_multiple) * clause_multiple)
    out = {
        "input_ids": np.full((len(sql_rows), length), resolve_pad_id(tokenizer, pad_id), np.int32),
        "mask": np.zeros((len(sql_rows), length), np.int32),
        "clause_pos": np.full((len(sql_rows), width), -1, np.int32),
        "clause_id": np.full((len(sql_rows), width), -1, np.int32),
    }
    for b, (seq, pos, ids) in enumerate(zip(sequences, positions, names)):
        out["input_ids"][b, : len(seq)] = seq
        out["mask"][b, : len(seq)] = 1
        out["clause_pos"][b, : len(pos)] = pos
        out["clause_id"][b, : len(ids)] = [i if p >= 0 else -1 for i, p in zip(ids, pos)]
    return out

