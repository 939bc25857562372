"""MaxText side by side: peak HBM per chip and collective bytes per step, a dense ~8B model next to caper_jax's 9B PRM step.

MaxText (PyPI ``maxtext==0.2.5``, its own venv: it needs Python >= 3.12 and jax 0.12.1) compiles its own
train step with its ``train_compile`` for a Cloud TPU slice from shapes only (``dataset_type=synthetic``, no
weights, no TPU: libtpu compiles for the topology). This script runs in two venvs:

1. ``compile`` (MaxText's venv): runs ``maxtext.trainers.pre_train.train_compile.main`` unchanged, with its
   ``jit_and_compile`` wrapped to keep the compiled executable, and writes ``OUT/maxtext_<slice>.hlo.txt``
   (the compiled HLO) and ``OUT/maxtext_<slice>.json`` (memory_analysis, compile seconds, the run's settings).
2. ``table`` (caper_jax's venv, no JAX needed): counts the collective bytes per step per chip in that HLO with
   ``caper_jax.parallel.hlo_collectives`` (the same counter ``--compile_for`` uses), and prints per slice: peak
   GiB per chip, peak bytes per token, collective bytes per step per chip (per kind and in all) and per
   parameter. Given caper_jax's ``--compile_for`` JSON for the same slice (its last line), it prints both
   side by side with ratios (caper / MaxText).

Same tokens per chip as caper_jax's PRM recipes: v5e-256 1 x 2048, v5p-64 4 x 2048, v6e-64 2 x 2048 per chip.
MaxText's own settings otherwise: its mesh default (``ici_fsdp_parallelism=-1``: FSDP over every chip),
``remat_policy=full`` (a whole decoder layer recomputed in the backward pass, like caper_jax's remat per
layer), scanned layers, fp32 weights and AdamW state, bf16 compute.

Commands (one MaxText compile at a time; ``nice`` on shared machines)::

    # once: MaxText's venv (about 2 min)
    python3.12 -m venv /work/venvs/maxtext && /work/venvs/maxtext/bin/pip install "maxtext[tpu]==0.2.5"
    # MaxText's compile, per slice
    for s in v5e-256:1 v5p-64:4 v6e-64:2; do
      JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice /work/venvs/maxtext/bin/python \\
        bench/maxtext_compare.py compile --slice=${s%:*} --per_device_batch=${s#*:} --out=/tmp/maxtext_cmp
    done
    # caper_jax's side (the lead's --compile_for; its last stdout line is the JSON)
    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b,pod=v5e-256 --compile_for=v5e-256 \\
      | tail -1 > /tmp/maxtext_cmp/caper_v5e-256.json
    # the table (caper_jax's venv)
    JAX_PLATFORMS=cpu .venv/bin/python bench/maxtext_compare.py table /tmp/maxtext_cmp \\
      [--caper=/tmp/maxtext_cmp/caper_v5e-256.json ...] [--caper_program=train_step]

Parameters are counted in closed form from the model's dimensions (printed with the table; MaxText's
qwen3-8b: untied 151,936 x 4,096 embedding and head, 36 layers with q/k norms), and checked against
``memory_analysis``'s argument bytes (fp32 weights + two fp32 AdamW moments = 12 bytes per parameter, spread
over the chips). caper_jax's count is the JSON's ``params`` if it has one, else ``--caper_params``
(default 8,953,803,264: the untied Qwen3.5-9B, docs/scale.md).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

GiB = 1024**3
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# MaxText model dimensions (maxtext/configs/models/*.yml, 0.2.5).
MODELS = {
    "qwen3-8b": dict(vocab=151936, dim=4096, heads=32, kv_heads=8, head_dim=128, mlp=12288, layers=36,
                     qk_norm=True, tied=False),
    "llama3.1-8b": dict(vocab=128256, dim=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
                        qk_norm=False, tied=False),
}
CAPER_PARAMS = 8_953_803_264


def dense_params(vocab, dim, heads, kv_heads, head_dim, mlp, layers, qk_norm, tied) -> int:
    """Parameters of a Llama/Qwen3-style decoder: embedding (+ untied head), per layer q/k/v/o, SwiGLU MLP
    (3 matrices), two RMSNorms (+ q/k norms of head_dim each), and the final norm."""
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    layer = attention + 3 * dim * mlp + 2 * dim + (2 * head_dim if qk_norm else 0)
    return vocab * dim * (1 if tied else 2) + layers * layer + dim


def compile_maxtext(args) -> None:
    """In MaxText's venv: train_compile for one slice; writes the HLO text and a JSON of figures."""
    import maxtext
    from absl import flags
    from maxtext.trainers.pre_train import train_compile

    flags.FLAGS.mark_as_parsed()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    captured = {}
    original = train_compile.jit_and_compile

    def keep(*a, **k):
        start = time.perf_counter()
        compiled = original(*a, **k)
        captured["compile_s"] = time.perf_counter() - start
        captured["compiled"] = compiled
        return compiled

    train_compile.jit_and_compile = keep
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["train_compile", str(base), f"model_name={args.model}", f"compile_topology={args.slice}",
            "compile_topology_num_slices=1", f"per_device_batch_size={args.per_device_batch}",
            f"max_target_length={args.seq}", f"remat_policy={args.remat}", "dataset_type=synthetic",
            "enable_checkpointing=false", f"base_output_directory={out / 'maxtext_runs'}",
            f"run_name=cmp_{args.slice}", *args.extra]
    start = time.perf_counter()
    train_compile.main(argv)
    compiled = captured["compiled"]
    stats = compiled.memory_analysis()
    memory = {k: getattr(stats, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                             "alias_size_in_bytes", "temp_size_in_bytes",
                                             "generated_code_size_in_bytes")}
    memory["peak_bytes"] = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                            - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"])
    (out / f"maxtext_{args.slice}.hlo.txt").write_text(compiled.as_text())
    import jax
    record = {"slice": args.slice, "model": args.model, "per_device_batch": args.per_device_batch,
              "seq": args.seq, "remat": args.remat, "extra": args.extra, "memory": memory,
              "compile_s": round(captured["compile_s"], 1), "total_s": round(time.perf_counter() - start, 1),
              "maxtext": getattr(maxtext, "__version__", "0.2.5"), "jax": jax.__version__,
              "loadavg": open("/proc/loadavg").read().split()[:3]}
    (out / f"maxtext_{args.slice}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


def _caper_program(record: dict, name: str | None) -> tuple[str, dict]:
    programs = record.get("programs", {})
    if name:
        return name, programs[name]
    for candidate in ("train_step", "step", "prm_step"):
        if candidate in programs:
            return candidate, programs[candidate]
    name = max(programs, key=lambda p: programs[p].get("peak_bytes", 0))   # else the largest program
    return name, programs[name]


def table(args) -> None:
    """In caper_jax's venv: collective bytes from MaxText's HLO, the MaxText table, and the side-by-side one."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from caper_jax.parallel.hlo_collectives import analyze

    folder = pathlib.Path(args.dir)
    caper = {}
    for path in args.caper:
        record = json.loads(pathlib.Path(path).read_text().strip().splitlines()[-1])
        caper[record["slice"]] = record
    rows = []
    for path in sorted(folder.glob("maxtext_*.json")):
        record = json.loads(path.read_text())
        text = (folder / f"maxtext_{record['slice']}.hlo.txt").read_text()
        analysis = analyze(text)
        unknown = [loop.name for loop in analysis.loops if loop.source == "unknown"]
        params = dense_params(**MODELS[record["model"]])
        tokens = record["per_device_batch"] * record["seq"]
        memory = record["memory"]
        rows.append(dict(record=record, collectives=analysis.bytes, params=params, tokens=tokens,
                         peak=memory["peak_bytes"], loops=[(l.name, l.trip_count, l.source) for l in analysis.loops],
                         unknown=unknown))
    print("MaxText (train_compile, remat full, FSDP over all chips):")
    print(f"{'slice':9} {'model':10} {'tok/chip':>8} {'peak GiB':>8} {'peak B/tok':>10} {'arg GiB':>7} "
          f"{'12P/n GiB':>9} {'coll GiB/step':>13} {'coll B/param':>12}  AG / RS / AR / A2A / CP GiB   compile s  load")
    for row in rows:
        record, c = row["record"], row["collectives"]
        chips = _chips(record["slice"])
        total = sum(c.values())
        print(f"{record['slice']:9} {record['model']:10} {row['tokens']:8d} {row['peak'] / GiB:8.2f} "
              f"{row['peak'] / row['tokens']:10.0f} {record['memory']['argument_size_in_bytes'] / GiB:7.2f} "
              f"{12 * row['params'] / chips / GiB:9.2f} {total / GiB:13.2f} {total / row['params']:12.3f}  "
              + " / ".join(f"{c[k] / GiB:.2f}" for k in KINDS)
              + f"   {record['compile_s']:7.1f}  {' '.join(record['loadavg'])}")
        if row["unknown"]:
            print(f"  warning: loops with unknown trip counts (counted once): {row['unknown']}")
    print(f"params: {', '.join(f'{m} {dense_params(**d):,}' for m, d in MODELS.items())}; caper_jax 9B "
          f"{args.caper_params:,} (unless its JSON says)")
    if not caper:
        return
    print("\nSide by side (caper_jax PRM step vs MaxText train step; ratio = caper / MaxText):")
    print(f"{'slice':9} {'program':12} {'peak GiB c/M':>14} {'ratio':>6} {'peak B/tok c/M':>17} {'ratio':>6} "
          f"{'coll B/param c/M':>17} {'ratio':>6}")
    for row in rows:
        record = caper.get(row["record"]["slice"])
        if record is None:
            continue
        name, program = _caper_program(record, args.caper_program)
        caper_params = record.get("params") or program.get("params") or args.caper_params   # the program's own count
        caper_tokens = args.caper_tokens.get(row["record"]["slice"], row["tokens"])
        caper_coll = sum(program["collective_bytes"].get(k, 0) for k in KINDS)
        m_peak, c_peak = row["peak"], program["peak_bytes"]
        m_pp, c_pp = sum(row["collectives"].values()) / row["params"], caper_coll / caper_params
        print(f"{row['record']['slice']:9} {name:12} {c_peak / GiB:6.2f}/{m_peak / GiB:<7.2f} {c_peak / m_peak:6.2f} "
              f"{c_peak / caper_tokens:8.0f}/{m_peak / row['tokens']:<8.0f} "
              f"{(c_peak / caper_tokens) / (m_peak / row['tokens']):6.2f} {c_pp:8.3f}/{m_pp:<8.3f} {c_pp / m_pp:6.2f}")
        print("           collective GiB per kind, caper / MaxText: " + ", ".join(
            f"{k} {program['collective_bytes'].get(k, 0) / GiB:.2f}/{row['collectives'][k] / GiB:.2f}" for k in KINDS))


def _chips(slice_name: str) -> int:
    generation, size = slice_name.split("-")
    return int(size) // 2 if generation == "v5p" else int(size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("compile", help="MaxText's venv: train_compile one slice")
    c.add_argument("--slice", required=True)
    c.add_argument("--per_device_batch", type=int, required=True)
    c.add_argument("--seq", type=int, default=2048)
    c.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    c.add_argument("--remat", default="full")
    c.add_argument("--out", default="/tmp/maxtext_cmp")
    c.add_argument("extra", nargs="*", help="more MaxText key=value overrides")
    t = sub.add_parser("table", help="caper_jax's venv: the tables")
    t.add_argument("dir")
    t.add_argument("--caper", action="append", default=[], help="caper_jax --compile_for JSON (last line)")
    t.add_argument("--caper_program", default=None, help="program in that JSON (default: train_step, or the largest)")
    t.add_argument("--caper_params", type=int, default=CAPER_PARAMS)
    t.add_argument("--caper_tokens", type=json.loads, default={},
                   help='tokens per chip of caper_jax\'s step where they differ from MaxText\'s, e.g. {"v5p-64": 8192}')
    args = parser.parse_args()
    compile_maxtext(args) if args.mode == "compile" else table(args)


if __name__ == "__main__":
    main()
