"""XLA:CPU flag sets against XLA's defaults: the trainers' train step, greedy decoding, a GEMM.

XLA reads ``XLA_FLAGS`` once, when its CPU backend starts, so every flag set runs in a child process
of its own; the sets take turns, round after round, so that all of them see the same machine, and the
first set is the reference every ratio is taken against (by default XLA's own defaults). A child
builds the model from a fixed seed (the same weights in every child): bench/model.py's ~58M-parameter
config, or with ``--size miniature`` the built-in default's `tiny` preset. It reports:

  * train: the trainers' step (bench/model.py's ``make_train_step(model, "chunked")``, value and
    gradients on a 4 × 512 batch; miniature: 32 × 256, the GRPO update's), median wall time of
    ``--steps`` runs after the compile;
  * decode: greedy, batch 8, 64-token prompts, 64 new tokens; new tokens per second, median;
  * gemm: an fp32 2048³ GEMM, GFLOP/s, median of 5;
  * what the compiled train step is made of: how many of its ops are YNN / XNN / oneDNN library
    fusions and how many are plain ``dot`` ops, so that a flag set which changes nothing shows it;
  * the loss and the greedy tokens, which the parent compares with the reference's.

    python bench/xla_flags.py                 # defaults vs YNN's dot fusions off (about 5 minutes)
    python bench/xla_flags.py --size miniature  # the same for the built-in default's model
    python bench/xla_flags.py --variant 'fast_math=--xla_cpu_enable_fast_math=true' --rounds 3

``--variant NAME=FLAGS`` (repeatable) replaces the list after the reference; ``--reference FLAGS``
replaces the reference's flags (empty: XLA's defaults). A child that fails (an unknown flag makes XLA
abort) stops the run with its stderr. The load average is printed at start and end
(bench/_common.py); a loaded run marks its ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # caper_jax and bench, run as a script or as a child process

# Without YNN's dot fusions XLA:CPU runs its dots through oneDNN's matmul (ONEDNN_VERBOSE=1 shows the
# primitives), so this is the oneDNN-GEMM variant; `--xla_cpu_experimental_ynn_fusion_type=-dot` does
# not remove them (the compiled program keeps its __ynn_fusion ops; the child's fusion count shows it).
DEFAULT_VARIANTS = ("ynn_off=--xla_cpu_experimental_ynn_fusion_type=",)
SIZES = {   # model, train batch, decode prompts × prompt length, new tokens
    "bench": dict(model="bench", train=(4, 512), prompts=(8, 64), new_tokens=64),
    # The built-in default's policy and PRM backbone (the `tiny` preset, the demo tokenizer's 1,445
    # tokens) at the GRPO update's 32 × 256 batch.
    "miniature": dict(model="tiny", vocab=1445, train=(32, 256), prompts=(8, 64), new_tokens=64),
    "test": dict(model="tiny", vocab=512, train=(2, 64), prompts=(2, 8), new_tokens=8),
}


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=FLAGS, e.g. 'ynn_off=--xla_cpu_...='")
    return name, flags.strip()


def library_fusions(hlo_text: str) -> dict[str, int]:
    """How many ops of a compiled module are YNN / XNN / oneDNN library fusions, and how many dots run
    outside them (XLA's own dot thunk; the dots inside a library fusion's body are not counted)."""
    counts = {kind: 0 for kind in ("ynn", "xnn", "onednn")}
    library_bodies = set()
    for line in hlo_text.splitlines():
        kind = re.search(r'"kind":"__(\w+)_fusion"', line)
        if kind and kind.group(1) in counts:
            counts[kind.group(1)] += 1
            library_bodies.update(re.findall(r"calls=(%[\w.-]+)", line))
    counts["dot"] = 0
    for header, body in re.findall(r"(?ms)^(?:ENTRY )?(%[\w.-]+) \([^\n]*\{\n(.*?)^\}", hlo_text):
        if header not in library_bodies:
            counts["dot"] += len(re.findall(r"= \S+ dot\(", body))
    return counts


def child(size: str, steps: int) -> dict:
    """The measurements of one flag set, in this process (whose XLA_FLAGS the parent set)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench._common import median_time
    from bench.model import BENCH_CONFIG, make_train_step
    from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
    from caper_jax.models.presets import model_preset
    from caper_jax.models.sampler import SamplingConfig, generate

    shapes = SIZES[size]
    if shapes["model"] == "bench":
        config = Qwen35Config(**BENCH_CONFIG)
    else:
        config = model_preset(shapes["model"], vocab_size=shapes["vocab"])
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, shapes["train"], dtype=np.int32))
    prompts = jnp.asarray(rng.integers(1, config.vocab_size, shapes["prompts"], dtype=np.int32))

    n = 256 if size == "test" else 2048
    a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    gemm = jax.jit(lambda x: x @ x)
    gemm(a).block_until_ready()
    gemm_s = median_time(lambda: gemm(a).block_until_ready(), 5)

    step, state = make_train_step(model, "chunked")
    start = time.perf_counter()
    compiled = step.lower(state, ids).compile()
    loss, _ = jax.block_until_ready(compiled(state, ids))
    compile_s = time.perf_counter() - start
    train_s = median_time(lambda: jax.block_until_ready(compiled(state, ids)), steps)

    sampling = SamplingConfig(max_new_tokens=shapes["new_tokens"], temperature=0.0)
    mask = jnp.ones(prompts.shape, jnp.int32)

    def decode():
        return jax.block_until_ready(generate(model, prompts, mask, jax.random.key(0), sampling))

    tokens = np.asarray(decode().tokens)
    decode_s = median_time(decode, steps)
    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
        "gemm_gflop_s": 2 * n**3 / gemm_s / 1e9, "train_s": train_s, "train_compile_s": compile_s,
        "decode_tok_s": tokens.size / decode_s, "loss": float(loss), "tokens": tokens.tolist(),
        "fusions": library_fusions(compiled.as_text()),
    }


def run_child(flags: str, size: str, steps: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--size", size, "--steps", str(steps)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the child with XLA_FLAGS={flags!r} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(variants: list[tuple[str, str]], rounds: int, size: str, steps: int, log=print) -> dict:
    """Every flag set ``rounds`` times, taking turns; per set the medians over rounds and, against the
    first set, the time ratios, the loss difference and the greedy-token agreement."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for r in range(rounds):
        for name, flags in variants:
            result = run_child(flags, size, steps)
            runs[name].append(result)
            log(f"round {r + 1}/{rounds} {name}: train {result['train_s']:.3f} s, decode "
                f"{result['decode_tok_s']:.0f} tok/s, GEMM {result['gemm_gflop_s']:.0f} GFLOP/s, {result['fusions']}")
    ref_name = variants[0][0]
    ref = runs[ref_name]
    summary = {}
    for name, flags in variants:
        res = runs[name]
        train = statistics.median(x["train_s"] for x in res)
        decode = statistics.median(x["decode_tok_s"] for x in res)
        ref_tokens, tokens = ref[0]["tokens"], res[0]["tokens"]
        flat = [(a == b) for ra, rb in zip(ref_tokens, tokens) for a, b in zip(ra, rb)]
        summary[name] = {
            "xla_flags": flags, "train_s": train, "train_s_per_round": [x["train_s"] for x in res],
            "decode_tok_s": decode, "decode_tok_s_per_round": [x["decode_tok_s"] for x in res],
            "gemm_gflop_s": statistics.median(x["gemm_gflop_s"] for x in res),
            "train_ratio": train / statistics.median(x["train_s"] for x in ref),
            "decode_ratio": decode / statistics.median(x["decode_tok_s"] for x in ref),
            "loss_diff": abs(res[0]["loss"] - ref[0]["loss"]), "token_agreement": sum(flat) / len(flat),
            "fusions": res[0]["fusions"], "reference": name == ref_name,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", type=parse_variant, metavar="NAME=FLAGS",
                        help=f"a flag set to compare with the reference (default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--reference", default="", help="the reference's XLA_FLAGS (default: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed runs per measurement in each child")
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.size, args.steps)))
        return

    from bench._common import start_load_check

    variants = [("reference", args.reference)] + (args.variant or [parse_variant(v) for v in DEFAULT_VARIANTS])
    if len({name for name, _ in variants}) != len(variants):
        raise SystemExit(f"variant names must differ (and not be 'reference'): {[n for n, _ in variants]}")
    load = start_load_check()
    summary = compare(variants, args.rounds, args.size, args.steps)
    load.finish()
    for name, s in summary.items():
        print(f"{name:>12s}: train {s['train_s']:.3f} s (rounds {', '.join(f'{t:.3f}' for t in s['train_s_per_round'])}), "
              f"x{load.mark(format(s['train_ratio'], '.3f'))} the reference's time; decode {s['decode_tok_s']:.0f} tok/s, "
              f"x{load.mark(format(s['decode_ratio'], '.3f'))} its rate; GEMM {s['gemm_gflop_s']:.0f} GFLOP/s; "
              f"|loss diff| {s['loss_diff']:.1e}, greedy agreement {s['token_agreement']:.1%}; "
              f"compiled step {s['fusions']}; XLA_FLAGS={s['xla_flags']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": summary, **load.as_dict()}, f, indent=1)


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
