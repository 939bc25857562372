"""The policy's own confidence in each clause of a query: the gold-free ``confidence`` baseline.

For a query the policy could have written, the mean log-probability of each clause's tokens under
the policy (``caper_jax.prm.localization.clause_mean_logprobs``): the clause it is least sure of is
the one a confidence-based localiser blames. The sequence is the one the SFT trainer trains on
(``caper_jax.sft.data.encode_examples``): ``policy_prompt`` ++ SQL ++ END_OF_SQL, tokenised as two
parts, so the log-probs are exactly those of the policy's own training objective; the stop token
counts for the last clause. Log-probs come from ``caper_jax.policy.logprobs.sequence_logprobs``
(chunked ``token_logprobs``: the vocabulary logits are never materialised whole).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from caper_jax.prm.localization import clause_mean_logprobs
from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.policy.logprobs import sequence_logprobs
from caper_jax.sql.contract import policy_prompt
from caper_jax.sql.clauses import SqlParseError, split_clauses

LENGTH_MULTIPLE = 64   # sequence lengths are rounded up to this: few compiled shapes


def clause_logprobs(policy, rows: Sequence[Mapping[str, Any]], *, max_len: int = 1024, batch_size: int = 8
                    ) -> list[list[float] | None]:
    """Per row (``question``, ``schema``, optional ``evidence``, ``sql``), the policy's mean token
    log-prob of each clause of ``split_clauses(sql)``; None for SQL that does not parse, or whose
    SQL + stop token alone exceeds ``max_len``. The prompt is left-truncated as in SFT."""

    tokenizer = policy.tokenizer
    items: list[tuple[int, np.ndarray, int, list[int], list[int]]] = []  # row, ids, n_prompt, starts, clauses
    for i, row in enumerate(rows):
        sql = str(row["sql"]).strip()
        try:
            units = split_clauses(sql)
        except SqlParseError:
            continue
        if not units:
            continue
        prompt = tokenizer(policy_prompt(row["question"], row["schema"], row.get("evidence", "")),
                           add_special_tokens=False)["input_ids"]
        enc = tokenizer(sql, add_special_tokens=False, return_offsets_mapping=True)
        target = list(enc["input_ids"]) + [policy.stop_token]
        if len(target) >= max_len:
            continue
        prompt = list(prompt)[-(max_len - len(target)):]
        starts = [start for start, _ in enc["offset_mapping"]] + [len(sql)]
        items.append((i, np.asarray(prompt + target, np.int32), len(prompt), starts, [u.start for u in units]))
    out: list[list[float] | None] = [None] * len(rows)
    if not items:
        return out
    graphdef, params = nnx.split(policy.model)

    @jax.jit
    def logprobs(params, ids, mask):
        return sequence_logprobs(nnx.merge(graphdef, params), ids, mask)

    pad = resolve_pad_id(tokenizer, None)
    items.sort(key=lambda item: len(item[1]))
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        length = min(max_len, -(-max(len(x[1]) for x in chunk) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)
        ids = np.full((batch_size, length), pad, np.int32)
        mask = np.zeros((batch_size, length), np.int32)
        mask[:, 0] = 1  # padding rows keep one visible token (no fully masked attention row)
        for b, item in enumerate(chunk):
            ids[b, :len(item[1])] = item[1]
            mask[b, :len(item[1])] = 1
        logp = np.asarray(jax.device_get(logprobs(params, ids, mask)))   # [B, T-1]: logp of ids[:, 1:]
        for b, (row_index, seq, n_prompt, starts, clause_starts) in enumerate(chunk):
            # target token t sits at position n_prompt + t and is predicted at logp[:, n_prompt + t - 1]
            token_logp = logp[b, n_prompt - 1:len(seq) - 1]
            out[row_index] = list(clause_mean_logprobs(starts, token_logp, clause_starts))
    return out
