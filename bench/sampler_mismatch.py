"""The sampler's log-probs against the trainer's forward, for the same tokens and parameters.

GRPO's ``old_logp`` is by default what the sampler saw (``caper_jax.models.sampler``: a prefill, then one
decode step per token over a KV cache and the DeltaNet states). The trainer computes the same log-probs with
one full-sequence forward (``completion_logprobs``: chunked DeltaNet, the chunked head). They agree only up
to rounding, and at the first update of a rollout the PPO ratio ``exp(logp - old_logp)`` carries the
difference as if it were a policy change. This measures it on demo-world prompts (T = 1, no top-k/top-p, as
the GRPO config samples) along the trainer's calls: ``generate`` -> ``assemble_rollout`` ->
``jit_completion_logprobs`` (the forward the update differentiates, here compiled alone: under bf16
compute the update's gradient program rounds its forward differently again, so the first update's ratio
itself is read from the trainer's ``train/ratio_min|max`` and ``rollout/logp_mismatch_*``; docs/grpo.md).

The policy is the ``small`` preset (random init, the demo tokenizer's vocabulary) in each ``--dtypes``
compute dtype over fp32 parameters: ``bfloat16`` is what configs/grpo.py:model=qwen35_9b computes in
(with its ``param_dtype``, ``remat`` and ``chunk_size``), ``float32`` the contrast (what separates the
two paths then is the algorithms' order of operations alone). Per dtype it prints mean and max |Δ|
(Δ = trainer - sampler over completion tokens), the ratio exp(Δ) (min / max / std), the fraction of tokens
outside the clip range [1 - eps_low, 1 + eps_high] of configs/grpo.py, the sequence-level ratio
exp(Σ_t Δ), and the fraction a truncated importance weight capped at ``--tis_cap`` would cap.

    JAX_PLATFORMS=cpu python bench/sampler_mismatch.py                  # 8 prompts x G=8, 64 new tokens
    JAX_PLATFORMS=cpu python bench/sampler_mismatch.py --prompts 4 --group 4 --dtypes bfloat16

The load average (/proc/loadavg) is printed at start and end (bench/_common.py); the figures are
numerics, not timings, so load does not change them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import start_load_check  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="policy preset (random init)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes to measure, comma separated")
    parser.add_argument("--prompts", type=int, default=8, help="distinct demo-world training prompts")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="the demo GRPO config's")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tis_cap", type=float, default=2.0, help="cap whose capped fraction is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write the figures here")
    return parser.parse_args()


def mismatch_stats(trainer, sampler, mask, eps_low: float, eps_high: float, tis_cap: float) -> dict:
    """Figures of Δ = trainer - sampler over ``mask`` (numpy, float64)."""
    import numpy as np

    mask = mask.astype(bool)
    delta = (trainer.astype(np.float64) - sampler.astype(np.float64))
    d = delta[mask]
    ratio = np.exp(d)
    seq_ratio = np.exp(np.where(mask, delta, 0.0).sum(axis=1)[mask.any(axis=1)])
    return {
        "tokens": int(mask.sum()),
        "mean_abs_delta": float(np.abs(d).mean()),
        "max_abs_delta": float(np.abs(d).max()),
        "p99_abs_delta": float(np.quantile(np.abs(d), 0.99)),
        "mean_delta": float(d.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ratio_std": float(ratio.std()),
        "outside_clip": float(((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).mean()),
        "outside_1e-3": float((np.abs(ratio - 1) > 1e-3).mean()),
        "outside_1e-2": float((np.abs(ratio - 1) > 1e-2).mean()),
        "tis_capped": float((ratio > tis_cap).mean()),
        "seq_ratio_min": float(seq_ratio.min()),
        "seq_ratio_max": float(seq_ratio.max()),
        "sampler_logp_mean": float(sampler[mask].mean()),
    }


def main() -> None:
    args = parse_args()
    load = start_load_check()
    with open("/proc/loadavg") as f:
        print(f"/proc/loadavg at start: {f.read().strip()}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from caper_jax.data.clause_encoder import resolve_pad_id
    from caper_jax.data.data_world import prepare_world
    from caper_jax.models.sampler import SamplingConfig, generate
    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.parallel.rules import DEFAULT_RULES
    from caper_jax.policy import rollout as rollout_lib
    from caper_jax.policy.build import build_policy
    from caper_jax.policy.prompts import prompt_batch, stop_token_id
    from caper_jax.rl import trainer as T
    from caper_jax.rl.step import jit_completion_logprobs
    from caper_jax.sql.contract import policy_prompt
    from caper_jax.sql.execution import Executors
    from configs.grpo import get_config

    big = get_config("model=qwen35_9b")               # the 9B dtype settings
    demo = get_config()                               # the demo world, its prompt widths
    demo.model.preset = args.preset
    demo.data.update(demo_train_size=200, demo_dev_size=10)
    workdir = tempfile.mkdtemp(prefix="sampler_mismatch_")
    demo.data.dir = os.path.join(workdir, "world")
    settings = demo
    print(f"9B config: model.dtype={big.model.dtype} param_dtype={big.model.param_dtype} remat={big.model.remat} "
          f"chunk_size={big.chunk_size}; sampler cache dtype {SamplingConfig(1).cache_dtype} (SamplingConfig's "
          f"default, as the trainer builds it); clip range [1 - {big.rl.eps_low}, 1 + {big.rl.eps_high}]")

    world = prepare_world(settings, workdir)
    tokenizer = world.tokenizer
    stop_tokens = tuple(sorted({stop_token_id(tokenizer)} |
                               ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())))
    pad_id = resolve_pad_id(tokenizer, None)
    executors = Executors(world.database_dir, timeout_s=2.0, max_rows=10_000)
    examples, golds = T.rl_examples(world, "train", executors, 0)
    rng = np.random.default_rng(args.seed)
    chosen = rng.choice(len(examples), size=min(args.prompts, len(examples)), replace=False)
    indices = np.repeat(chosen, args.group)
    prompts = [policy_prompt(examples[i].question, examples[i].schema, examples[i].evidence) for i in indices]
    prompt_ids, prompt_mask = prompt_batch(prompts, tokenizer, settings.sampling.max_prompt_len, pad_id=pad_id,
                                           widths=settings.sampling.prompt_widths)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, 0, 1.0, stop_tokens=stop_tokens, pad_id=pad_id)
    mesh = mesh_lib.make_mesh(dict(settings.mesh_shape))
    results = {}
    for dtype in args.dtypes.split(","):
        model_cfg = settings.model.copy_and_resolve_references()
        model_cfg.update(preset=args.preset, dtype=dtype, param_dtype=big.model.param_dtype, remat=big.model.remat)
        policy = build_policy(model_cfg, len(tokenizer), args.seed, mesh, DEFAULT_RULES)
        graphdef, params = nnx.split(policy)
        output = generate(policy, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), jax.random.key(args.seed),
                          sampling)
        rollout = rollout_lib.assemble_rollout(
            prompt_ids, prompt_mask, output, tokenizer, executors, [examples[i].db_id for i in indices],
            [examples[i].sql for i in indices], [golds[i] for i in indices], stop_tokens, T.reward_config(settings))
        n_new = rollout.completion_mask.shape[1]
        trainer_logp = jit_completion_logprobs(
            params, jnp.asarray(rollout.input_ids), jnp.asarray(rollout.attention_mask), graphdef=graphdef,
            completion_len=n_new, temperature=float(args.temperature), chunk_size=big.chunk_size)
        stats = mismatch_stats(np.asarray(trainer_logp), rollout.old_logp, rollout.completion_mask,
                               big.rl.eps_low, big.rl.eps_high, args.tis_cap)
        stats["parameters"] = int(sum(x.size for x in jax.tree.leaves(params)))
        results[dtype] = stats
        print(f"{dtype} compute over {big.model.param_dtype} params, {args.preset} ({stats['parameters']:,} "
              f"parameters), {len(indices)} rollouts x <= {n_new} tokens = {stats['tokens']} completion tokens, "
              f"mean sampler log-prob {stats['sampler_logp_mean']:.3f}:")
        print(f"  |Δ log-prob| mean {stats['mean_abs_delta']:.2e}  p99 {stats['p99_abs_delta']:.2e}  "
              f"max {stats['max_abs_delta']:.2e}  (mean signed Δ {stats['mean_delta']:+.2e})")
        print(f"  ratio exp(Δ): min {stats['ratio_min']:.5f}  max {stats['ratio_max']:.5f}  "
              f"std {stats['ratio_std']:.2e}; outside the clip range {stats['outside_clip']:.2%}, "
              f"|ρ-1| > 1e-3: {stats['outside_1e-3']:.2%}, > 1e-2: {stats['outside_1e-2']:.2%}; "
              f"above a TIS cap of {args.tis_cap:g}: {stats['tis_capped']:.2%}")
        print(f"  sequence ratio exp(Σ_t Δ): min {stats['seq_ratio_min']:.4f}  max {stats['seq_ratio_max']:.4f}")
    executors.close()
    load.finish()
    with open("/proc/loadavg") as f:
        print(f"/proc/loadavg at end: {f.read().strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, **load.as_dict()}, f, indent=1)


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
