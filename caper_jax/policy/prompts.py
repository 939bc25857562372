"""The policy's prompt encoding, shared by SFT, GRPO, sampling and evaluation: END_OF_SQL's token id
and left-padded prompt batches for the sampler."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.sql.contract import END_OF_SQL


def stop_token_id(tokenizer) -> int:
    """Id of END_OF_SQL, which must be a single token (it is the sampler's stop token)."""
    ids = tokenizer(END_OF_SQL, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"END_OF_SQL {END_OF_SQL!r} is {len(ids)} tokens for this tokenizer; it must be one")
    return int(ids[0])


def check_prompt_widths(widths: Sequence[int], max_prompt_len: int) -> tuple[int, ...]:
    """``widths`` as a tuple if it is a usable ladder of prompt widths: strictly ascending positive
    integers ending at ``max_prompt_len``; else ValueError naming the problem."""
    ladder = tuple(int(w) for w in widths)
    if not ladder or any(w < 1 for w in ladder) or any(a >= b for a, b in zip(ladder, ladder[1:])):
        raise ValueError(f"sampling.prompt_widths={list(widths)} must be strictly ascending positive widths")
    if ladder[-1] != max_prompt_len:
        raise ValueError(f"sampling.prompt_widths={list(widths)} must end at sampling.max_prompt_len={max_prompt_len}")
    return ladder


def prompt_width(longest: int, widths: Sequence[int]) -> int:
    """The smallest width of the ladder that holds ``longest`` tokens (the last one if none does: the
    prompts were already cut to it)."""
    return next((w for w in widths if w >= longest), widths[-1])


def prompt_batch(prompts: Sequence[str], tokenizer, max_prompt_len: int, multiple: int = 32,
                 pad_id: int | None = None, widths: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LEFT-padded prompt ids and mask ``[B, P]`` for the sampler; prompts longer than ``max_prompt_len``
    lose their leftmost tokens. P is the smallest of ``widths`` (a ladder ending at ``max_prompt_len``:
    every width is one compiled shape of each program of a GRPO step) that holds the longest prompt, or
    without ``widths`` that length rounded up to ``multiple`` (at most ``max_prompt_len``). ``pad_id``
    None: ``resolve_pad_id``'s rule (pad, else eos, else 0)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    ids = [list(x)[-max_prompt_len:] for x in ids]
    longest = max(map(len, ids))
    if widths is not None:
        width = prompt_width(longest, check_prompt_widths(widths, max_prompt_len))
    else:
        width = min(max_prompt_len, -(-longest // multiple) * multiple)
    pad = resolve_pad_id(tokenizer, pad_id)
    out = np.full((len(ids), width), pad, np.int32)
    mask = np.zeros((len(ids), width), np.int32)
    for row, x in enumerate(ids):
        if x:
            out[row, width - len(x):] = x
            mask[row, width - len(x):] = 1
    return out, mask
