"""GRPO's rollout with each prompt prefilled once per group (``generate(..., group_size=G)``) against the
prompts repeated G times and prefilled row by row (the trainer before issue 56): the prefill's matmul
FLOPs per GRPO step at Qwen3.5-9B (the traced jaxpr, ``parallel.dry_run.jaxpr_matmul_flops``: no
weights, no compile), and a CPU rollout's wall time on a random-weight policy, the two paths taking
turns in the same run after their samples are checked equal.

    python bench/group_prefill.py        # 9B FLOPs at 8 prompts x 8, 1024 + 512 tokens (bench/dry_run_grpo.py's
                                         # defaults); the rollout on `small` at the demo's 4 x 8, 192 + 64 tokens

The random policy never stops early (no stop tokens), so every row decodes ``--new_tokens`` tokens on both
paths. The load average is printed at start and end (bench/_common.py); a loaded run marks its ratios.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import alternating_min_time, start_load_check  # noqa: E402


def prefill_flops(preset: str, prompts: int, group: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(matmul FLOPs of the prefill of the prompts repeated to their G rows, of the prompts once + repeat)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from caper_jax.models import Qwen35ForCausalLM
    from caper_jax.models.presets import model_preset
    from caper_jax.models.sampler import _prefill
    from caper_jax.parallel.dry_run import jaxpr_matmul_flops

    arch = model_preset(preset, dtype="bfloat16", unroll_layers=False)   # the 9B configs' compute dtype, scanned
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen35ForCausalLM(arch, rngs=nnx.Rngs(0))))

    def flops(rows: int, group_size: int) -> float:
        ids = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32)
        traced = _prefill.trace(graphdef, params, ids, ids, max_len=prompt_len + new_tokens, cache_dtype="bfloat16",
                                group_size=group_size)
        return jaxpr_matmul_flops(traced.jaxpr.jaxpr)

    return flops(prompts * group, 1), flops(prompts, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--flops_preset", default="qwen35_9b")
    parser.add_argument("--flops_prompts", type=int, default=8)
    parser.add_argument("--flops_prompt_len", type=int, default=1024)
    parser.add_argument("--flops_new_tokens", type=int, default=512)
    parser.add_argument("--preset", default="small", help="the timed rollout's policy preset")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=192)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    load = start_load_check()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from caper_jax.models import Qwen35ForCausalLM
    from caper_jax.models.presets import model_preset
    from caper_jax.models.sampler import SamplingConfig, _cut_layer_groups, _prefill, generate

    before, after = prefill_flops(args.flops_preset, args.flops_prompts, args.group, args.flops_prompt_len,
                                  args.flops_new_tokens)
    print(f"{args.flops_preset} prefill matmul FLOPs per GRPO step, {args.flops_prompts} prompts x G={args.group}, "
          f"{args.flops_prompt_len}-token prompts: {before:.4e} (prompts repeated) -> {after:.4e} (once per group), "
          f"/ {before / after:.2f}")

    model = Qwen35ForCausalLM(model_preset(args.preset), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    vocab, width = model.config.vocab_size, args.prompt_len
    lengths = rng.integers(width // 2, width + 1, args.prompts)
    ids = np.zeros((args.prompts, width), np.int32)
    mask = np.zeros((args.prompts, width), np.int32)
    for p, n in enumerate(lengths):
        ids[p, width - n:] = rng.integers(1, vocab, n)
        mask[p, width - n:] = 1
    ids_g, mask_g = (jnp.asarray(np.repeat(x, args.group, axis=0)) for x in (ids, mask))
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    config = SamplingConfig(args.new_tokens, temperature=1.0)
    key = jax.random.key(1)
    rollouts = {"repeated": lambda: jax.block_until_ready(generate(model, ids_g, mask_g, key, config)),
                "once per group": lambda: jax.block_until_ready(generate(model, ids, mask, key, config,
                                                                         group_size=args.group))}
    old, new = (fn() for fn in rollouts.values())   # compiles both; the samples must be the same
    same = {k: bool(np.array_equal(np.asarray(getattr(old, k)), np.asarray(getattr(new, k))))
            for k in ("tokens", "lengths", "log_probs")}
    delta = float(np.abs(np.asarray(old.log_probs) - np.asarray(new.log_probs)).max())
    print(f"{args.preset} rollout, {args.prompts} prompts x G={args.group}, prompts {width} wide, "
          f"{args.new_tokens} new tokens: equal {same}, max |delta log-prob| {delta:.2e}")

    graphdef, state = nnx.split(model)
    groups = _cut_layer_groups(graphdef, state)
    max_len = width + args.new_tokens
    prefills = {"repeated": lambda: jax.block_until_ready(_prefill(graphdef, state, ids_g, mask_g, groups,
                                                                   max_len=max_len, cache_dtype="float32")),
                "once per group": lambda: jax.block_until_ready(_prefill(
                    graphdef, state, ids, mask, groups, max_len=max_len, cache_dtype="float32", group_size=args.group))}
    for fn in prefills.values():
        fn()
    times = {"rollout": alternating_min_time(rollouts, args.repeats),
             "prefill program": alternating_min_time(prefills, args.repeats)}
    load.finish()
    for what, t in times.items():
        a, b = t["repeated"], t["once per group"]
        print(f"{what}: {a:.3f} s (prompts repeated) -> {b:.3f} s (once per group): "
              + load.mark(f"{a / b:.2f}x"))


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
