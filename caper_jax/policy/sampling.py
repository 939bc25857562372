"""The one path from prompts to the policy's SQL: greedy and k samples, through ``caper_jax.models.sampler``.

* ``decode`` turns prompts into text: greedy, k samples per prompt, or both. It is what the trainers'
  end-of-run greedy EX (``rollout.greedy_ex``), the policy evaluation (``caper_jax.eval.policy``) and
  the reproduction's samples for annotation (``caper_jax.experiments.samples``) call.
  Batches have a fixed shape (the last one is padded by repeating its last prompt), so one compiled
  program serves every batch; batch ``i`` is drawn with ``fold_in(key(seed), i)`` and greedy decoding
  ignores the key (the sampler's PRNG contract). Prompts are padded with ``resolve_pad_id``'s id
  (pad, else eos, else 0), and the sampler pads finished rows with the same id. GRPO's rollout calls
  ``models.sampler.generate`` on its own prompt batch, since it keeps the tokens and log-probs.
* ``completion_tokens`` / ``decode_with_offsets``: the generated ids of one row as SQL text, with the
  character offsets of THOSE tokens (``caper_jax.policy.rollout`` places clause ends with them).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.models.sampler import SamplingConfig, generate
from caper_jax.parallel import multihost
from caper_jax.parallel.multihost import fetch
from caper_jax.policy.prompts import prompt_batch
from caper_jax.utils.monitoring import Progress

PROGRESS_EVERY_S = 30.0   # seconds between two progress lines of a long decode


def completion_tokens(tokens: np.ndarray, length: int, stop_tokens: Sequence[int]) -> list[int]:
    """The generated ids that form the SQL: up to ``length``, without a final stop token."""
    ids = [int(t) for t in tokens[:length]]
    if ids and ids[-1] in stop_tokens:
        ids.pop()
    return ids


def decode_with_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, np.ndarray]:
    """Decoded text of ``ids`` and ``[n, 2]`` character offsets of each of THESE tokens in it."""
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not ids:
        return text, np.zeros((0, 2), np.int64)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoded["input_ids"]) == ids:
        return text, np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2)
    prefixes = tokenizer.batch_decode([ids[: i + 1] for i in range(len(ids))], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    ends, end = [], 0
    for prefix in prefixes:
        if text.startswith(prefix):  # else the prefix ends inside a multi-byte character
            end = max(end, len(prefix))
        ends.append(end)
    starts = [0] + ends[:-1]
    return text, np.stack([starts, ends], axis=1).astype(np.int64)


def _texts(model, tokenizer, prompts: Sequence[str], config: SamplingConfig, key: jax.Array, *,
           max_prompt_len: int, batch_size: int) -> list[str]:
    """One completion's text per prompt, ``batch_size`` prompts at a time (module docstring)."""
    texts: list[str] = []
    batches = -(-len(prompts) // batch_size)
    progress, last_line = Progress(batches, unit="batch", units="batches"), time.perf_counter()
    for batch_index, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = list(prompts[start:start + batch_size])
        real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - real)
        ids, mask = prompt_batch(chunk, tokenizer, max_prompt_len, multiple=max_prompt_len, pad_id=config.pad_id)
        out = generate(model, jnp.asarray(ids), jnp.asarray(mask), jax.random.fold_in(key, batch_index), config)
        tokens, lengths = fetch(out.tokens), fetch(out.lengths)
        for b in range(real):
            ids_b = completion_tokens(tokens[b], lengths[b], config.stop_tokens)
            texts.append(decode_with_offsets(tokenizer, ids_b)[0])
        if time.perf_counter() - last_line >= PROGRESS_EVERY_S or batch_index + 1 == batches > 1:
            # Thousands of prompts take many minutes on CPU: say how far, as the trainers do.
            multihost.log_main("decoding %d prompts: %s", len(prompts), progress.update(batch_index + 1))
            last_line = time.perf_counter()
    return texts


def decode(model, tokenizer, prompts: Sequence[str], *, stop_tokens: Sequence[int], max_prompt_len: int,
           max_new_tokens: int, batch_size: int, greedy: bool = True, k: int = 0, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """(greedy SQL per prompt, k sampled SQL per prompt). ``greedy=False`` skips the greedy decode and
    returns ``[]`` for it; ``k=0`` returns no samples. The k samples of a prompt are k rows of the
    batch (the sampler's per-row keys make them independent of the other rows)."""
    pad = resolve_pad_id(tokenizer, None)
    stop = tuple(stop_tokens)
    key = jax.random.key(seed)
    greedy_sql = _texts(model, tokenizer, prompts, SamplingConfig(max_new_tokens, temperature=0.0,
                                                                  stop_tokens=stop, pad_id=pad),
                        key, max_prompt_len=max_prompt_len, batch_size=batch_size) if greedy else []
    if k == 0:
        return greedy_sql, [[] for _ in prompts]
    config = SamplingConfig(max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_tokens=stop, pad_id=pad)
    flat = [p for p in prompts for _ in range(k)]
    texts = _texts(model, tokenizer, flat, config, key, max_prompt_len=max_prompt_len, batch_size=batch_size)
    return greedy_sql, [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
