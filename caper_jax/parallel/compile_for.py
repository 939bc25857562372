"""``--compile_for=SLICE``: every program of a training step, compiled by the TPU compiler for a Cloud TPU slice.

    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b,pod=v5e-256 --compile_for=v5e-256

What MaxText's ``train_compile`` does for its models, for each trainer's programs: libtpu (``pip install -e
'.[tpu]'``) compiles for a topology with no TPU attached (``parallel.slices``), the mesh is laid over its
compile-only devices and backend-dependent model choices follow the target (``parallel.target``). Nothing is
allocated and no weights or data are read: the trainer's ``compile_programs(settings)`` lowers each program on
ShapeDtypeStructs (``parallel.dry_run.report``).

Per program it prints the TPU compiler's ``memory_analysis`` (argument / output / temp / peak, and *resident*:
the peak plus the run's buffers that stay in HBM while it runs, e.g. the optimizer state during scoring) against
the chip's HBM, the bytes each kind of collective moves per call per chip (``parallel.hlo_collectives``: loops
by their trip counts) and an **estimated** lower bound on its time: the largest of its matmul FLOPs over the
chip's peak, the HBM bytes it must at least touch (arguments read and outputs written once; a decode loop reads
its arguments once per token) over the HBM bandwidth, and its collective bytes over the ICI bandwidth. It is a
bound from published chip figures, never a measurement.

The last line printed is one JSON object (``report_json``). Exit status (``caper_jax.train``): 0 when every
program's resident bytes leave at least ``HEADROOM`` of the chip's HBM free; 2 with one ``error:`` line naming
the first program that does not, or the program the compiler itself refused.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from caper_jax.parallel.slices import TpuSlice

GiB = 1024**3
HEADROOM = 0.05   # of the chip's HBM left free: XLA's runtime, the input pipeline's device buffers, fragmentation


class CompileRefused(RuntimeError):
    """The target's compiler refused a program, or a program does not fit the chip with the headroom."""


def hbm_touched_bytes(program: dict) -> int:
    """Bytes a program must at least move through HBM per call: its arguments read and outputs written once,
    and a loop's arguments read once per trip (the decode loop reads every weight per token)."""
    memory = program["memory"]
    trips = max(1.0, float(program.get("while_trips", 1.0)))
    return int(memory["argument_bytes"] * trips + memory["output_bytes"])


def lower_bound_s(program: dict, tpu: TpuSlice) -> dict[str, float]:
    """The estimated floor of one call's time on ``tpu``'s chips: compute, HBM and ICI terms and their max."""
    chip = tpu.chip
    terms = {
        "compute_s": program["matmul_flops"] / tpu.chips / chip.peak_bf16_flops,
        "hbm_s": hbm_touched_bytes(program) / chip.hbm_bytes_per_s,
        "ici_s": sum(program["collective_bytes"].values()) / chip.ici_bytes_per_s,
    }
    return {**terms, "bound_s": max(terms.values())}


def summarize(programs: dict[str, dict], tpu: TpuSlice, mesh: dict[str, int]) -> dict[str, Any]:
    """The JSON report: per program its bytes per chip, collectives, matmul FLOPs (global, per call) and time bound."""
    limit = tpu.chip.hbm_bytes * (1 - HEADROOM)
    out = {}
    for name, program in programs.items():
        memory = program["memory"]
        out[name] = {
            "peak_bytes": memory["peak_bytes"], "temp_bytes": memory["temp_bytes"],
            "argument_bytes": memory["argument_bytes"], "output_bytes": memory["output_bytes"],
            "alias_bytes": memory["alias_bytes"], "resident_bytes": program["resident_bytes"],
            "collective_bytes": dict(program["collective_bytes"]), "matmul_flops": program["matmul_flops"],
            "params": program.get("params"),   # the parameters the program holds (None where not counted)
            "largest_buffers": program.get("largest_buffers", []),
            "calls_per_step": program["calls"], "compile_s": round(program["compile_s"], 1),
            "lower_bound_estimate": {k: float(f"{v:.4g}") for k, v in lower_bound_s(program, tpu).items()},
            "fits": program["resident_bytes"] <= limit,
        }
    return {"slice": tpu.name, "topology": tpu.topology_name, "chips": tpu.chips, "device_kind": tpu.chip.kind,
            "mesh": mesh, "hbm_bytes": tpu.chip.hbm_bytes, "headroom": HEADROOM,
            "fits": all(p["fits"] for p in out.values()), "programs": out}


def table(report: dict) -> str:
    """The per-program lines printed before the JSON (GiB per chip; collectives per call per chip)."""
    hbm = report["hbm_bytes"] / GiB
    lines = [f"{report['slice']} ({report['topology']}, {report['chips']} x {report['device_kind']}, "
             f"{hbm:.2f} GiB HBM the compiler allows per chip), mesh "
             + " x ".join(f"{k}={v}" for k, v in report["mesh"].items()),
             f"{'program':<18} {'argument':>8} {'temp':>7} {'peak':>7} {'resident':>8} {'of HBM':>6}   "
             f"{'all-gather':>10} {'red-scat':>8} {'all-red':>8} {'all-to-all':>10} {'permute':>7}   "
             f"{'bound (est.)':>12}"]
    for name, p in report["programs"].items():
        c = p["collective_bytes"]
        lines.append(
            f"{name:<18} {p['argument_bytes'] / GiB:>8.2f} {p['temp_bytes'] / GiB:>7.2f} {p['peak_bytes'] / GiB:>7.2f} "
            f"{p['resident_bytes'] / GiB:>8.2f} {p['resident_bytes'] / report['hbm_bytes']:>6.0%}   "
            f"{c['all-gather'] / GiB:>10.3f} {c['reduce-scatter'] / GiB:>8.3f} {c['all-reduce'] / GiB:>8.3f} "
            f"{c['all-to-all'] / GiB:>10.3f} {c['collective-permute'] / GiB:>7.3f}   "
            f"{p['lower_bound_estimate']['bound_s'] * 1e3:>9.1f} ms" + ("" if p["fits"] else "   DOES NOT FIT"))
        if p["largest_buffers"]:
            lines.append("    largest buffers: " + ", ".join(f"{b['shape']} {b['bytes'] / GiB:.2f}" for b in p["largest_buffers"]))
    lines.append("GiB per chip; collectives per call per chip; bound = max(FLOPs/peak, HBM bytes/bandwidth, "
                 "collective bytes/ICI), an estimate from published chip figures")
    return "\n".join(lines)


def first_misfit(report: dict) -> str | None:
    """The one error line for a report that does not fit, else None."""
    for name, p in report["programs"].items():
        if not p["fits"]:
            return (f"{report['slice']}: program {name} needs {p['resident_bytes'] / GiB:.2f} GiB per chip resident "
                    f"(peak {p['peak_bytes'] / GiB:.2f}), over {1 - HEADROOM:.0%} of the {report['hbm_bytes'] / GiB:.2f} "
                    f"GiB of HBM the chip allows")
    return None


def compile_for(tpu: TpuSlice, settings, compile_programs: Callable[[Any], dict[str, dict]],
                print_fn: Callable[[str], None] = print) -> dict:
    """Compiles ``compile_programs(settings)`` (a trainer's) for ``tpu`` (call inside ``target.compiling_for``);
    prints the table and, last, the JSON line; returns the report. A refusal by the compiler raises
    ``CompileRefused`` with its first line."""
    from caper_jax.parallel import mesh as mesh_lib   # JAX loads with the trainer, not with this module

    try:
        programs = compile_programs(settings)
    except Exception as error:   # the compiler's refusal arrives as XlaRuntimeError / JaxRuntimeError
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message and type(error).__name__ not in ("XlaRuntimeError", "JaxRuntimeError"):
            raise
        first = next((line for line in message.splitlines() if line.strip()), type(error).__name__)
        raise CompileRefused(f"{tpu.name}: the TPU compiler refused a program: {first}") from None
    mesh_shape = dict(zip(settings.mesh_shape, mesh_lib.resolve_mesh_shape(tuple(settings.mesh_shape.values()),
                                                                           tpu.chips)))
    report = summarize(programs, tpu, mesh_shape)
    print_fn(table(report))
    print_fn(json.dumps(report))
    return report

