"""The policy's prompt encoding, shared by SFT, GRPO, sampling and evaluation: END_OF_SQL's token id
and left-padded prompt batches for the sampler."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from caper_jax.data.prm_pipeline import resolve_pad_id
from caper_jax.sql.contract import END_OF_SQL


def stop_token_id(tokenizer) -> int:
    """Id of END_OF_SQL, which must be a single token (it is the sampler's stop token)."""
    ids = tokenizer(END_OF_SQL, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"END_OF_SQL {END_OF_SQL!r} is {len(ids)} tokens for this tokenizer; it must be one")
    return int(ids[0])


def prompt_batch(prompts: Sequence[str], tokenizer, max_prompt_len: int, multiple: int = 32,
                 pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LEFT-padded prompt ids and mask ``[B, P]`` for the sampler (P rounded up to ``multiple`` so jit
    sees few shapes); prompts longer than ``max_prompt_len`` lose their leftmost tokens. ``pad_id``
    None: ``resolve_pad_id``'s rule (pad, else eos, else 0)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    ids = [list(x)[-max_prompt_len:] for x in ids]
    width = min(max_prompt_len, -(-max(map(len, ids)) // multiple) * multiple)
    pad = resolve_pad_id(tokenizer, pad_id)
    out = np.full((len(ids), width), pad, np.int32)
    mask = np.zeros((len(ids), width), np.int32)
    for row, x in enumerate(ids):
        if x:
            out[row, width - len(x):] = x
            mask[row, width - len(x):] = 1
    return out, mask
