"""The sampler's token choice (``sampler.first_argmax``, and the Gumbel-max draw built on it) against
``jnp.argmax`` and ``jax.random.categorical``, measured in the same run on the same logits.

A decode step picks a token per row from [B, V] fp32 logits: greedy by argmax, sampled by the
argmax of Gumbel-perturbed logits. XLA:CPU lowers argmax's (value, index) reduction to a scalar loop,
so ``first_argmax`` computes it as a max and a min over the first index that reaches it. Both sides
must choose the same tokens (checked before timing).

    python bench/select_tokens.py                    # B=8, V=32000 (bench/model.py's decode)
    python bench/select_tokens.py --vocab 248320     # Qwen3.5's vocabulary

The load average is printed at start and end (bench/_common.py); a loaded run marks its ratios.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import median_time, start_load_check  # noqa: E402
from caper_jax.models.sampler import _categorical, first_argmax  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    load = start_load_check()
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((args.batch, args.vocab), np.float32))
    keys = jax.random.split(jax.random.key(0), args.batch)
    pairs = {
        "greedy": (jax.jit(first_argmax), jax.jit(lambda x: jnp.argmax(x, axis=-1)), (logits,)),
        "sampled": (jax.jit(jax.vmap(_categorical)), jax.jit(jax.vmap(jax.random.categorical)), (keys, logits)),
    }
    results = {}
    for name, (ours, reference, inputs) in pairs.items():
        if not np.array_equal(np.asarray(ours(*inputs)), np.asarray(reference(*inputs))):
            raise SystemExit(f"{name}: the two choose different tokens")
        times = {"ours": [], "reference": []}
        for _ in range(2):   # alternate, so both see the same load
            for side, fn in (("ours", ours), ("reference", reference)):
                times[side].append(median_time(lambda: jax.block_until_ready(fn(*inputs)), args.repeats))
        results[name] = (min(times["ours"]), min(times["reference"]))
    load.finish()

    print(f"token choice on [{args.batch}, {args.vocab}] fp32 logits, median of {args.repeats}; same tokens on both sides")
    for name, (ours_s, reference_s) in results.items():
        reference_name = "jnp.argmax" if name == "greedy" else "jax.random.categorical"
        print(f"{name}: sampler {ours_s * 1e3:.3f} ms, {reference_name} {reference_s * 1e3:.3f} ms; "
              + load.mark(f"speed-up {reference_s / ours_s:.2f}x"))


if __name__ == "__main__":
    main()
