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

from bench._common import alternating_min_time, start_load_check  # noqa: E402
from caper_jax.models.sampler import first_argmax, gumbel_categorical  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    load = start_load_check()
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((args.batch, args.vocab), np.float32))
    keys = jax.random.split(jax.random.key(0), args.batch)
    pairs = {   # name: (the sampler's, its reference's name, the reference, inputs)
        "greedy": (first_argmax, "jnp.argmax", lambda x: jnp.argmax(x, axis=-1), (logits,)),
        "sampled": (jax.vmap(gumbel_categorical), "jax.random.categorical", jax.vmap(jax.random.categorical),
                    (keys, logits)),
    }
    results = {}
    for name, (ours, reference_name, reference, inputs) in pairs.items():
        ours, reference = jax.jit(ours), jax.jit(reference)
        if not np.array_equal(np.asarray(ours(*inputs)), np.asarray(reference(*inputs))):
            raise SystemExit(f"{name}: the two choose different tokens")
        best = alternating_min_time({"ours": lambda: jax.block_until_ready(ours(*inputs)),
                                     "reference": lambda: jax.block_until_ready(reference(*inputs))}, args.repeats)
        results[name] = (reference_name, best["ours"], best["reference"])
    load.finish()

    print(f"token choice on [{args.batch}, {args.vocab}] fp32 logits, median of {args.repeats}; same tokens on both sides")
    for name, (reference_name, ours_s, reference_s) in results.items():
        print(f"{name}: sampler {ours_s * 1e3:.3f} ms, {reference_name} {reference_s * 1e3:.3f} ms; "
              + load.mark(f"speed-up {reference_s / ours_s:.2f}x"))

if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
