"""One command for one GPU or TPU host: Clause-PRM train step, DeltaNet vs attention, decoding, memory.

    python bench/accelerator.py                 # ~1.9B Qwen3.5-architecture config, bf16, one device; < 10 min
    python bench/accelerator.py --tiny          # the same program on a tiny config (CPU test, seconds)

Random weights, one device (no mesh splitting), everything timed after a warm-up call (compile):

  * ``train``: the real Clause-PRM step (``caper_jax.prm.step.train_step``: backbone in bf16 with fp32
    master params, score head, margin-weighted pair loss, AdamW, state donated) on ``--pairs`` pairs
    of ``--seq_len`` tokens (2 × pairs sequences), ``model.remat`` = ``--remat``. Step time (median of
    ``--steps``), tokens/s, and MFU = model FLOPs / (step time × the device's peak bf16 FLOP/s), model
    FLOPs being the step's matmul FLOPs counted on the jaxpr of the same step *without* remat (the
    recomputed forward is not useful work; ``hfu`` counts it).
  * ``layers``: one chunked gated-delta-rule layer (``GatedDeltaNet``: projections, conv, the
    chunked rule, gated norm) against one gated attention layer (``GatedAttention``, XLA's
    ``dot_product_attention``) of the same config, forward + backward, batch 1, at each ``--layer_lens``.
  * ``decode``: ``caper_jax.models.sampler.generate``, greedy, ``--new_tokens`` new tokens after a
    ``--prompt_len`` prompt (no stop token: every row runs to the end), at each ``--decode_batches``;
    new tokens per second (prefill included in the time) and the decode loop alone.
  * ``memory``: the device's peak bytes in use (``memory_stats``; None on CPU).

The last line printed is one JSON object with every figure. Peak FLOP/s per device kind is the
table ``PEAK_BF16`` (dense, no sparsity); an unknown kind gives ``mfu: null``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import start_load_check  # noqa: E402

LOAD = start_load_check(own=1)  # the host thread driving the device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import ConfigDict  # noqa: E402

from caper_jax.models import Qwen35Config  # noqa: E402

# Dense bf16 peak per chip, FLOP/s (vendor data sheets).
PEAK_BF16 = {
    "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
    "L40S": 362e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}

# ~1.9B parameters: 24 layers (6 groups of 3 DeltaNet + 1 gated attention), hidden 2048, the 248k vocab
# (tied: 0.51 B of the total), partial RoPE and GQA as in Qwen3.5.
BENCH_1B9 = dict(
    vocab_size=248_320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=4, head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    tie_word_embeddings=True, max_position_embeddings=32_768,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny config and sizes (CPU test)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--remat", default="layers")
    parser.add_argument("--layer_lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--decode_batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prompt_len", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=("train", "layers", "decode"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.pairs, args.seq_len, args.steps, args.repeats = 2, 32, 2, 1
        args.layer_lens, args.decode_batches, args.prompt_len, args.new_tokens = [32], [2], 8, 4
    return args


def model_config(args) -> Qwen35Config:
    if args.tiny:
        return Qwen35Config.tiny(tie_word_embeddings=True, dtype="bfloat16", remat=args.remat)
    return Qwen35Config(**BENCH_1B9, dtype="bfloat16", param_dtype="float32", remat=args.remat)


def timed(fn, repeats: int) -> tuple[float, float]:
    """(warm-up seconds incl. compile, median seconds of ``repeats`` further calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    for name in sorted(PEAK_BF16, key=len, reverse=True):
        if name.lower() in kind.lower():
            return PEAK_BF16[name]
    return None


def bench_train(config: Qwen35Config, args) -> dict:
    from caper_jax.parallel.dry_run import jaxpr_matmul_flops
    from caper_jax.prm.loss import PairLossConfig
    from caper_jax.prm.model import ClausePRM
    from caper_jax.prm.step import jit_steps, train_step
    from caper_jax.utils.optim import init_state, make_optimizer

    model = ClausePRM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optim = ConfigDict(dict(lr=1e-5, warmup_steps=1, total_steps=1000, weight_decay=0.01, b1=0.9, b2=0.95,
                            grad_clip=1.0))
    tx = make_optimizer(optim)
    state = jax.jit(lambda p: init_state(p, tx))(params)
    del model, params
    rng = np.random.default_rng(0)
    b, t = args.pairs, args.seq_len
    ids = lambda: jnp.asarray(rng.integers(1, config.vocab_size, (b, t)), jnp.int32)  # noqa: E731
    batch = {"chosen_ids": ids(), "rejected_ids": ids(), "chosen_mask": jnp.ones((b, t), jnp.int32),
             "rejected_mask": jnp.ones((b, t), jnp.int32), "chosen_pos": jnp.full((b,), t - 1, jnp.int32),
             "rejected_pos": jnp.full((b,), t - 1, jnp.int32), "margin": jnp.ones((b,), jnp.float32),
             "weight": jnp.ones((b,), jnp.float32), "lm_weight": jnp.ones((b,), jnp.float32),
             "clause_id": jnp.zeros((b,), jnp.int32)}
    loss_cfg = PairLossConfig()
    step, _, _ = jit_steps(graphdef, tx, loss_cfg)
    hardware = jaxpr_matmul_flops(step.trace(state, batch).jaxpr.jaxpr)
    plain_def = nnx.graphdef(nnx.eval_shape(lambda: ClausePRM(config.replace(remat="none"), rngs=nnx.Rngs(0)))) \
        if config.remat != "none" else graphdef   # abstract: no second copy of the weights on the device
    useful = jaxpr_matmul_flops(jax.make_jaxpr(
        lambda s, x: train_step(s, x, graphdef=plain_def, tx=tx, loss_cfg=loss_cfg))(state, batch).jaxpr)
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    first, median = timed(one_step, args.steps)
    peak = peak_flops()
    tokens = 2 * b * t
    return {"params": int(n_params), "sequences": 2 * b, "seq_len": t, "remat": config.remat,
            "compile_and_first_s": first, "step_s": median, "tokens_per_s": tokens / median,
            "model_flops": useful, "hardware_flops": hardware, "peak_flops": peak,
            "mfu": None if peak is None else useful / median / peak,
            "hfu": None if peak is None else hardware / median / peak}


def bench_layers(config: Qwen35Config, args) -> dict:
    from caper_jax.models.qwen35 import GatedAttention, GatedDeltaNet, Sharding, _Context, rope_tables

    out = {}
    for kind, cls in (("gated_delta_rule", GatedDeltaNet), ("attention", GatedAttention)):
        layer = cls(config, stack=None, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer)
        for t in args.layer_lens:
            x = jax.random.normal(jax.random.key(1), (1, t, config.hidden_size), jnp.bfloat16)
            positions = jnp.arange(t)[None]

            def loss(params, x, t=t, graphdef=graphdef, positions=positions):
                cos, sin = rope_tables(positions, config.rotary_dim, config.rope_theta)
                ctx = _Context(cos=cos, sin=sin, attn_mask=jnp.tril(jnp.ones((t, t), bool))[None, None],
                               token_mask=None, segment_ids=None, write_index=None, sharding=Sharding())
                y, _ = nnx.merge(graphdef, params)(x, ctx, None)
                return jnp.sum(y.astype(jnp.float32) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            first, median = timed(lambda: grad(params, x), args.repeats)
            out[f"{kind}_{t}"] = {"fwd_bwd_s": median, "compile_and_first_s": first}
    for t in args.layer_lens:
        out[f"delta_over_attention_{t}"] = out[f"gated_delta_rule_{t}"]["fwd_bwd_s"] / out[f"attention_{t}"]["fwd_bwd_s"]
    return out


def bench_decode(config: Qwen35Config, args) -> dict:
    from caper_jax.models import Qwen35ForCausalLM
    from caper_jax.models.sampler import SamplingConfig, generate

    model = Qwen35ForCausalLM(config.replace(remat="none"), rngs=nnx.Rngs(0))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0, cache_dtype="bfloat16")
    rng = np.random.default_rng(0)
    out = {}
    for batch in args.decode_batches:
        ids = jnp.asarray(rng.integers(1, config.vocab_size, (batch, args.prompt_len)), jnp.int32)
        mask = jnp.ones_like(ids)
        first, median = timed(lambda: generate(model, ids, mask, jax.random.key(0), sampling).tokens, args.repeats)
        out[f"batch_{batch}"] = {"generate_s": median, "new_tokens_per_s": batch * args.new_tokens / median,
                                 "compile_and_first_s": first}
    return out


def memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = model_config(args)
    device = jax.devices()[0]
    print(f"device {device.device_kind} ({device.platform}, {jax.device_count()} on this host; one used), "
          f"jax {jax.__version__}; config: {'tiny' if args.tiny else '1.9B'} hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, vocab {config.vocab_size}")
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "config": "tiny" if args.tiny else "bench_1b9"}
    if "train" not in args.skip:
        result["train"] = bench_train(config, args)
        r = result["train"]
        mfu = "n/a (unknown peak)" if r["mfu"] is None else f"{r['mfu']:.1%} (HFU {r['hfu']:.1%})"
        print(f"train: {r['params'] / 1e9:.3f} B params, {r['sequences']} x {r['seq_len']} tokens, remat "
              f"{r['remat']}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, MFU {mfu}")
    if "layers" not in args.skip:
        result["layers"] = bench_layers(config, args)
        for t in args.layer_lens:
            r = result["layers"]
            print(f"one layer fwd+bwd at {t} tokens: gated delta rule {r[f'gated_delta_rule_{t}']['fwd_bwd_s'] * 1e3:.2f} ms, "
                  f"attention {r[f'attention_{t}']['fwd_bwd_s'] * 1e3:.2f} ms "
                  f"(ratio {LOAD.mark(format(r[f'delta_over_attention_{t}'], '.2f'))})")
    if "decode" not in args.skip:
        result["decode"] = bench_decode(config, args)
        for batch in args.decode_batches:
            r = result["decode"][f"batch_{batch}"]
            print(f"decode batch {batch}: {r['new_tokens_per_s']:.0f} new tokens/s ({r['generate_s']:.3f} s for "
                  f"{args.new_tokens} tokens after a {args.prompt_len}-token prompt)")
    result["memory"] = memory()
    LOAD.finish()
    result["load"] = LOAD.as_dict()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
