"""Where the LM train step of bench/model.py goes, op by op, from an XLA:CPU profiler trace.

    python bench/profile_step.py               # BENCH_CONFIG (~58M), 4 x 512, fwd+bwd; a few minutes on 2 cores
    python bench/profile_step.py --loss chunked  # the trainers' loss (token_logprobs' fused head) instead
    python bench/profile_step.py --decode      # and one greedy decode call (8 x 64 prompt, 64 new tokens)
    python bench/profile_step.py --miniature --loss chunked   # the miniature's policy (preset tiny, the demo
                                               # vocabulary) at its GRPO update's batch, 32 x 256
    python bench/profile_step.py --miniature --loss chunked --delta_chunk 64   # its old delta-rule chunks
    python bench/profile_step.py --tiny        # 2 layers (1 DeltaNet + 1 attention), hidden 64, batch 2 x 64

The step is bench/model.py's ``make_train_step`` (forward + backward of the mean next-token
cross-entropy, no optimizer update) on a randomly initialised model (the timing does not depend on
the weights). After a warm-up call, ``--steps`` calls run under ``jax.profiler.trace(...,
create_perfetto_trace=True)`` (Python tracer off), each timed with ``time.perf_counter`` around the
call and ``block_until_ready``. The trace is reduced to per-category time, share of the step and
count, plus the top 15 ops; printed, and written to ``--json`` (by default profile_step.json in the
trace's folder).

What the trace holds on this jax (0.10.2, XLA:CPU thunk runtime), and what the reduction relies on:

  * ``perfetto_trace.json.gz``: Chrome-trace ``X`` events; one per executed HLO thunk, on the
    thread that ran it (the XLA Eigen pool and the PjRt client thread), with ``args.hlo_module``
    (e.g. ``jit_loss_fn``) and ``args.hlo_op`` (the HLO instruction name, e.g. ``dot.195``,
    ``ynn_fusion.145``, ``copy_bitcast_fusion.27``). An op's time is its event's duration. The
    ``end: NAME`` markers (no args, any thread) are not used: they are the executor's completion
    callbacks, and their lag is callback latency, not work (full-size step: output ``copy``s with
    a 1 ms event get their marker ~2 s later; the markers' lags add up to 7 x the step). Other
    events (``ThunkExecutor::Execute``, threadpool bookkeeping) are runtime.
    Op events carry no metadata: no op_name, no source location.
  * So each ``hlo_op`` is looked up in the optimized HLO text of the same executable
    (``Compiled.as_text()``; for ``--decode``, XLA's ``--xla_dump_to`` text of the sampler's
    modules: the weight cut on the CPU, the prefill, the decode loop): its opcode, the computations
    it calls (a fusion's body tells a dot fusion from a reduce fusion — XNNPACK/YNNPACK
    ``ynn_fusion``s hold either), ``known_trip_count`` of whiles,
    and ``metadata={op_name=... stack_frame_id=N}``. op_name is only the transformation path
    (``jit(loss_fn)/transpose(jvp())/while/body/closed_call/dot_general``), no file; the source is
    the stack frame: the module's ``FileNames`` / ``FunctionNames`` / ``FileLocations`` /
    ``StackFrames`` tables. A frame's printed ``parent_frame_id`` is one more than its caller's
    printed id (checked on this version: the caller's source line calls the frame's function). The
    walk goes innermost-out and stops at the first function it knows. JAX caches the traced body
    of inner jitted helpers (e.g. the scan's ``jit(dynamic_index_in_dim)``): their ops keep the
    traceback of the helper's *first* trace (for the sampler that can be the train step's
    loss_fn), followed by the current call site; hence loss_fn counts only as an op's own frame,
    and the layer-stack functions (scan over layer groups, residual adds) stop the walk as
    "layer glue".

Categories, first match wins:

  GEMM            dot, a fusion whose body holds a dot, convolution, matmul custom-calls
  transpose/copy  copy, transpose and the other pure data movement (slice, pad, concatenate,
                  broadcast, bitcast, dynamic-(update-)slice), alone or fused with nothing else;
                  and fusions holding a copy or transpose plus only element-wise math (XLA's
                  copy_* / transpose_* fusions: a strided pass over memory)
  gated delta     the remaining ops whose innermost known frame is in caper_jax/ops/gated_delta.py
                  (chunked rule and its scan over chunks, causal conv, l2-normalize, the triangular
                  solves)
  attention       ... in GatedAttention.__call__ or the RoPE helpers (softmax, masks, rotary)
  norms           ... in RMSNorm / GatedRMSNorm
  loss            ... in optax's cross-entropy, caper_jax/policy/logprobs.py (--loss chunked) or
                  loss_fn (log-softmax over the vocab, the gather);
                  for --decode the sampler's own ops (log-softmax over the vocab, argmax)
  elementwise/other  everything else (MLP's SiLU, DeltaNet gates, embedding, residual adds, ...)
  host/runtime gaps  step wall time minus the sum of the op times: no op event running, less the
                  idle time charged to plain dots (below)

Plain ``dot`` thunks (the dots XLA does not hand to YNNPACK, e.g. weight gradients contracting their
row axis) run Eigen's contraction on the intra-op thread pool, and their trace event ends when the
work is handed over: in the 4 x 512 step an MLP weight gradient's event lasts 0.2 ms, then no op event
runs for 28-30 ms while the pool's tasks (``ThreadpoolListener`` regions, 80 of them) and the dot's
``end:`` marker fill the trace. So idle time inside a traced call (a ``TraceAnnotation`` around each)
that follows the end of a plain dot's event is charged to that dot (GEMM) and printed separately;
the part of its work that overlaps other ops' events stays with those ops, so the dots' share is
still a lower bound.

Op times: per thread only the innermost op counts (while/conditional/call thunks contain their
bodies and are not counted themselves), and where ops run at once on several threads each gets an
equal share of the overlap, so the op times sum to the time at least one op was running (plus the
idle time charged to plain dots), which is at most the measured wall time. Shares are of the mean wall time per step, gaps included; with
backward ops attributed to the forward source that JAX's transpose keeps in the metadata.

A second table splits the same time by model part (gated delta rule, the rest of the DeltaNet
layer, attention, MLP, norms, embedding, LM head + loss/sampling, layer glue) with each part's
GEMM time.

Matmul FLOPs per step are counted on the step's jaxpr (``jaxpr_matmul_flops``, as bench/model.py);
the GEMM category's rate is those FLOPs over the GEMM time. XLA may rewrite a small dot into a
multiply + reduce fusion (then timed under another category), which would make the rate optimistic.
The compiled HLO text is saved next to the trace (``train_step.hlo.txt``) to look op names up.

The load average is printed at start and end (bench/_common.py); on a machine that was not quiet
the shares carry "LOADED (not comparable)". The profiler itself slows the step (one trace event
per op); the untraced median step time is printed next to the traced one.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import start_load_check  # noqa: E402

GEMM, MOVE, DELTA, ATTENTION, NORMS, LOSS, OTHER, GAPS = (
    "GEMM", "transpose/copy", "gated delta rule", "attention", "norms", "loss", "elementwise/other",
    "host/runtime gaps")
CATEGORIES = (GEMM, MOVE, DELTA, ATTENTION, NORMS, LOSS, OTHER, GAPS)
# Model parts for the second table, by the innermost known frame of an op.
PARTS = ("gated delta rule", "DeltaNet layer (rest)", "attention", "MLP", "norms", "embedding",
         "LM head + loss/sampling", "layer glue", "unattributed")
LAYER_GLUE = frozenset({"DecoderLayer.__call__", "Qwen35ForCausalLM._layer_stack",
                        "Qwen35ForCausalLM._layer_stack.<locals>.group"})

# Opcodes that only move or re-lay data.
MOVE_OPCODES = frozenset({
    "copy", "transpose", "bitcast", "reshape", "slice", "dynamic-slice", "dynamic-update-slice", "pad",
    "concatenate", "broadcast", "reverse", "copy-start", "copy-done", "tuple", "get-tuple-element",
})
LEAF_FREE = frozenset({"parameter", "constant"})
# A fusion that copies or transposes is a strided pass over memory whatever element-wise math XLA
# fused into it (XLA names these copy_* / transpose_* fusions after their root); one holding any of
# these does real work of another kind.
NOT_LAYOUT = frozenset({"dot", "convolution", "reduce", "reduce-window", "gather", "scatter", "sort",
                        "custom-call", "select-and-scatter"})
CONTROL_OPCODES = frozenset({"while", "conditional", "call"})
# Thunks whose event ends when they hand their work to the intra-op thread pool (XLA:CPU's plain
# dot: an Eigen contraction, run asynchronously), so idle time right after one is that work.
POOL_FINISHED_OPCODES = frozenset({"dot"})
CALL_EVENT = "profile_step_call"   # a TraceAnnotation around each traced call
GEMM_CUSTOM_CALL = re.compile(r"matmul|gemm|dot", re.I)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            max_position_embeddings=2048, layer_types=("linear_attention", "full_attention"),
            chunk_size=32)  # 2 chunks of the 64-token batch: the scan over chunks stays a while loop


# HLO text ------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = .+? ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    computation: str
    calls: tuple[str, ...]
    body: str | None            # while: the body computation
    trip_count: int | None      # while: known_trip_count
    target: str | None          # custom-call target
    op_name: str
    frame: int | None


@dataclasses.dataclass
class HloModule:
    """The parts of an optimized HLO module's text the profile needs."""
    name: str
    entry: str
    instrs: dict[str, Instr]
    computations: dict[str, list[str]]
    files: dict[int, str]
    functions: dict[int, str]
    locations: dict[int, tuple[int, int, int]]    # id -> (file id, function id, line)
    frames: dict[int, tuple[int, int]]            # id -> (location id, parent frame id as printed)

    def opcodes_under(self, computation: str, seen: set[str] | None = None) -> set[str]:
        """Every opcode in ``computation`` and the computations it calls (a fusion's whole body)."""
        seen = set() if seen is None else seen
        if computation in seen:
            return set()
        seen.add(computation)
        ops: set[str] = set()
        for name in self.computations.get(computation, ()):
            instr = self.instrs[name]
            ops.add(instr.opcode)
            for sub in instr.calls:
                ops |= self.opcodes_under(sub, seen)
        return ops

    def stack(self, frame: int | None, limit: int = 64) -> list[tuple[str, str, int]]:
        """(file, function, line) from the innermost frame outwards."""
        out, seen = [], set()
        while frame and frame in self.frames and frame not in seen and len(out) < limit:
            seen.add(frame)
            location, parent = self.frames[frame]
            file_id, function_id, line = self.locations[location]
            out.append((self.files.get(file_id, "?"), self.functions.get(function_id, "?"), line))
            frame = parent - 1
        return out


def _section(text: str, title: str) -> list[str]:
    match = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    return match.group(1).splitlines() if match else []


def parse_hlo(text: str) -> HloModule:
    module = re.match(r"HloModule ([\w.\-]+)", text)
    instrs: dict[str, Instr] = {}
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith((" ", "HloModule")):
                current = header.group(1)
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTR.match(line)
        if not match:
            continue
        name, opcode, rest = match.groups()
        calls = re.findall(r"(?:calls|to_apply|condition|body|branch_computations)=\{?((?:%[\w.\-]+(?:, )?)+)", rest)
        called = tuple(c.lstrip("%") for group in calls for c in group.split(", "))
        body = re.search(r"body=%([\w.\-]+)", rest)
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        instrs[name] = Instr(
            name, opcode, current, called, body.group(1) if body else None,
            int(trip.group(1)) if trip else None, target.group(1) if target else None,
            op_name.group(1) if op_name else "", int(frame.group(1)) if frame else None)
        computations[current].append(name)

    def table(title: str) -> dict[int, str]:
        return {int(k): v.strip('"') for k, v in (line.split(" ", 1) for line in _section(text, title))}

    locations, frames = {}, {}
    for line in _section(text, "FileLocations"):
        key, rest = line.split(" ", 1)
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        locations[int(key)] = (int(fields["file_name_id"]), int(fields["function_name_id"]), int(fields["line"]))
    for line in _section(text, "StackFrames"):
        key, rest = line.split(" ", 1)
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        frames[int(key)] = (int(fields["file_location_id"]), int(fields["parent_frame_id"]))
    return HloModule(module.group(1) if module else "?", entry, instrs, computations, table("FileNames"),
                     table("FunctionNames"), locations, frames)


# Classification -----------------------------------------------------------------------------

def is_gemm(module: HloModule, instr: Instr) -> bool:
    if instr.opcode in ("dot", "convolution"):
        return True
    if instr.opcode == "custom-call":
        return bool(instr.target and GEMM_CUSTOM_CALL.search(instr.target))
    if instr.opcode == "fusion":
        return bool({"dot", "convolution"} & set().union(*(module.opcodes_under(c) for c in instr.calls)))
    return False


def is_move(module: HloModule, instr: Instr) -> bool:
    if instr.opcode in MOVE_OPCODES:
        return True
    if instr.opcode == "fusion":
        ops = set().union(*(module.opcodes_under(c) for c in instr.calls)) - LEAF_FREE
        pure = bool(ops) and ops <= MOVE_OPCODES
        return pure or (bool(ops & {"copy", "transpose"}) and not ops & NOT_LAYOUT)
    return False


def part_of(stack: list[tuple[str, str, int]]) -> tuple[str, str]:
    """(model part, the frame that decided it) by the innermost frame with a known function."""
    for depth, (file, function, line) in enumerate(stack):
        where = f"{os.path.basename(file)}:{line} {function}"
        if file.endswith("caper_jax/ops/gated_delta.py"):
            return "gated delta rule", where
        if function in ("RMSNorm.__call__", "GatedRMSNorm.__call__"):
            return "norms", where
        if function in ("GatedAttention.__call__", "apply_partial_rope", "rotate_half", "rope_tables"):
            return "attention", where
        if function == "MLP.__call__":
            return "MLP", where
        if function == "GatedDeltaNet.__call__":
            return "DeltaNet layer (rest)", where
        if function == "Qwen35ForCausalLM._embed":
            return "embedding", where
        # loss_fn only as the op's own frame: further out it is a caller (see the module docstring).
        if (function == "Qwen35ForCausalLM.project" or "/optax/" in file
                or file.endswith("caper_jax/models/sampler.py")
                or file.endswith("caper_jax/policy/logprobs.py")
                or (function == "make_train_step.<locals>.loss_fn" and depth == 0)):
            return "LM head + loss/sampling", where
        if function in LAYER_GLUE:
            return "layer glue", where
    return "unattributed", ""


_PART_CATEGORY = {"gated delta rule": DELTA, "attention": ATTENTION, "norms": NORMS,
                  "LM head + loss/sampling": LOSS}


def classify(module: HloModule | None, op: str) -> dict:
    """Category, model part and source of one HLO instruction (by name) of ``module``."""
    instr = module.instrs.get(op) if module else None
    if instr is None:
        return {"category": OTHER, "part": "unattributed", "source": "", "op_name": "", "opcode": "?"}
    part, source = part_of(module.stack(instr.frame))
    if is_gemm(module, instr):
        category = GEMM
    elif is_move(module, instr):
        category = MOVE
    else:
        category = _PART_CATEGORY.get(part, OTHER)
    return {"category": category, "part": part, "source": source, "op_name": instr.op_name, "opcode": instr.opcode}


# Trace ----------------------------------------------------------------------------------------

def load_trace(log_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def op_events(events: list[dict], modules: dict[str, HloModule]) -> list[dict]:
    """The trace's HLO-op events of ``modules``, without control-flow thunks (they contain their bodies)."""
    out = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or args.get("hlo_module") not in modules:
            continue
        instr = modules[args["hlo_module"]].instrs.get(args["hlo_op"])
        if instr is not None and instr.opcode in CONTROL_OPCODES:
            continue
        out.append(e)
    return out


def attribute(events: list[dict], windows: list[tuple[float, float]] = (),
              finishes_on_pool: list[bool] | None = None) -> tuple[list[float], list[float]]:
    """Microseconds each event is charged: on each thread only the innermost running event, and time
    when several threads run events split equally between them; the total is the union of the events.

    Plus, second list: idle time (no event running) inside one of the ``windows`` (the traced calls)
    that follows the end of an event marked in ``finishes_on_pool`` goes to that event. XLA:CPU's
    plain ``dot`` thunk hands Eigen's contraction to the thread pool and its event ends there: the
    pool's tasks (``ThreadpoolListener`` regions) then fill what would read as idle time until the
    next op starts (module docstring)."""
    points = []
    for i, e in enumerate(events):
        points.append((e["ts"] + e["dur"], 0, i))   # ends before starts at equal times
        points.append((e["ts"], 1, i))
    points.sort()
    charged = [0.0] * len(events)
    after_end = [0.0] * len(events)
    stacks: dict[object, list[int]] = collections.defaultdict(list)
    active: set[object] = set()
    last, last_ended = None, None
    for t, is_start, i in points:
        if last is not None and t > last:
            if active:
                share = (t - last) / len(active)
                for tid in active:
                    charged[stacks[tid][-1]] += share
            elif (finishes_on_pool is not None and last_ended is not None and finishes_on_pool[last_ended]
                  and any(lo <= last and t <= hi for lo, hi in windows)):
                after_end[last_ended] += t - last
        last = t
        tid = events[i]["tid"]
        if is_start:
            stacks[tid].append(i)
            active.add(tid)
        else:
            stacks[tid].remove(i)
            last_ended = i
            if not stacks[tid]:
                active.discard(tid)
    return charged, after_end


def reduce_trace(events: list[dict], modules: dict[str, HloModule], wall_s: list[float], top: int = 15) -> dict:
    """The table: per category time/share/count per step, per model part, and the top ops."""
    ops = op_events(events, modules)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == CALL_EVENT and e.get("ph") == "X"]
    instrs = [modules[e["args"]["hlo_module"]].instrs.get(e["args"]["hlo_op"]) for e in ops]
    pool_finished = [instr is not None and instr.opcode in POOL_FINISHED_OPCODES for instr in instrs]
    charged, after_end = attribute(ops, windows, pool_finished)
    charged = [a + b for a, b in zip(charged, after_end)]
    steps = len(wall_s)
    wall_us = sum(wall_s) * 1e6
    cache: dict[tuple[str, str], dict] = {}
    per_op: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e, us in zip(ops, charged):
        key = (e["args"]["hlo_module"], e["args"]["hlo_op"])
        per_op[key][0] += us
        per_op[key][1] += 1
    categories = {c: {"time_s": 0.0, "share": 0.0, "count": 0.0} for c in CATEGORIES}
    parts = {p: {"time_s": 0.0, "share": 0.0, "gemm_time_s": 0.0} for p in PARTS}
    rows = []
    for key, (us, count) in per_op.items():
        info = cache.setdefault(key, classify(modules[key[0]], key[1]))
        seconds = us / 1e6 / steps
        categories[info["category"]]["time_s"] += seconds
        categories[info["category"]]["count"] += count / steps
        parts[info["part"]]["time_s"] += seconds
        if info["category"] == GEMM:
            parts[info["part"]]["gemm_time_s"] += seconds
        rows.append({"op": key[1], "module": key[0], **info, "time_s": seconds, "count": count / steps})
    ops_us = sum(charged)
    wall = wall_us / 1e6 / steps
    categories[GAPS]["time_s"] = max(wall - ops_us / 1e6 / steps, 0.0)
    for table in (categories, parts):
        for row in table.values():
            row["share"] = row["time_s"] / wall
    rows.sort(key=lambda r: -r["time_s"])
    for r in rows:
        r["share"] = r["time_s"] / wall
    return {"wall_s": wall, "op_time_s": ops_us / 1e6 / steps, "steps": steps, "categories": categories,
            "pool_after_event_s": sum(after_end) / 1e6 / steps,
            "parts": parts, "top_ops": rows[:top], "distinct_ops": len(rows), "ops": rows}


# Running ----------------------------------------------------------------------------------------

def profile_calls(fn, calls: int, log_dir: str) -> tuple[list[dict], list[float]]:
    """Runs ``fn`` (which must block on its result) ``calls`` times under the profiler."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0     # Python-call events would slow the dispatch they measure
    walls = []
    with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
        for _ in range(calls):
            start = time.perf_counter()
            with jax.profiler.TraceAnnotation(CALL_EVENT):   # the call's window in the trace's clock
                fn()
            walls.append(time.perf_counter() - start)
    return load_trace(log_dir), walls


def print_table(title: str, result: dict, mark, flops: float | None = None) -> None:
    print(f"\n{title}: wall {result['wall_s'] * 1e3:.1f} ms per call (mean of {result['steps']} traced), "
          f"ops {result['op_time_s'] * 1e3:.1f} ms, {result['distinct_ops']} distinct ops")
    print(f"  {'category':<20} {'ms':>9} {'count':>8}  share")
    for name, row in result["categories"].items():
        print(f"  {name:<20} {row['time_s'] * 1e3:9.1f} {row['count']:8.0f}  {mark(format(row['share'], '.1%'))}")
    if result.get("pool_after_event_s"):
        print(f"  (GEMM includes {result['pool_after_event_s'] * 1e3:.1f} ms with no op event running that followed "
              "a plain dot's event: Eigen's pool finishing it)")
    if flops:
        gemm_s = result["categories"][GEMM]["time_s"]
        rate = f"{flops / gemm_s / 1e9:.0f} GFLOP/s" if gemm_s > 0 else "n/a"
        print(f"  matmul FLOPs per call {flops / 1e9:.2f} GFLOP (jaxpr); GEMM category at {rate}")
    print(f"  {'model part':<22} {'ms':>9} {'GEMM ms':>9}  share")
    for name, row in result["parts"].items():
        print(f"  {name:<22} {row['time_s'] * 1e3:9.1f} {row['gemm_time_s'] * 1e3:9.1f}  "
              f"{mark(format(row['share'], '.1%'))}")
    print(f"  top {len(result['top_ops'])} ops (ms per call, executions per call):")
    for r in result["top_ops"]:
        print(f"  {r['time_s'] * 1e3:8.2f} ms x{r['count']:<4.0f} {r['category']:<17} {r['op']:<28} "
              f"{r['source'] or r['op_name'][-60:]}")


def dumped_modules(dump_dir: str, names: set[str]) -> dict[str, HloModule]:
    modules = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.cpu_after_optimizations.txt"))):
        with open(path) as f:
            module = parse_hlo(f.read())
        if module.name in names:
            modules[module.name] = module
    return modules


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, batch 2 x 64 (test)")
    which.add_argument("--miniature", action="store_true",
                       help="the miniature's policy (preset tiny, demo vocabulary) at batch 32 x 256")
    parser.add_argument("--delta_chunk", type=int, default=0,
                        help="the gated delta rule's chunk length (default: the config's)")
    parser.add_argument("--decode", action="store_true", help="also profile one greedy decode call")
    parser.add_argument("--loss", choices=("logits", "chunked"), default="logits",
                        help="bench/model.py's loss: full logits + optax CE, or the trainers' chunked token_logprobs")
    parser.add_argument("--steps", type=int, default=2, help="traced train steps (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="untraced steps timed for comparison")
    parser.add_argument("--json", default="",
                        help="where the result is written (default: profile_step.json in the trace's folder)")
    parser.add_argument("--trace_dir", default=None, help="profiler output (default: a new temp dir)")
    args = parser.parse_args(argv)
    load = start_load_check(own=os.cpu_count() or 1)   # XLA:CPU keeps every core busy
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="profile_step_")
    os.makedirs(trace_dir, exist_ok=True)
    dump_dir = os.path.join(trace_dir, "hlo_dump")
    if args.decode:
        # The sampler's jitted weight cut, prefill and decode are compiled inside generate(); XLA's
        # dump is the only view of their optimized HLO. Must be set before the CPU client exists.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
                                   " --xla_dump_hlo_module_re=.*(cut_layer_groups|prefill|decode).*")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.model import BENCH_CONFIG, make_train_step
    from caper_jax.data.tokenizer import build_demo_tokenizer
    from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
    from caper_jax.models.presets import model_preset
    from caper_jax.models.sampler import SamplingConfig, generate
    from caper_jax.parallel.dry_run import jaxpr_matmul_flops

    name = "tiny" if args.tiny else "miniature" if args.miniature else "bench"
    if args.miniature:   # the GRPO update of configs/reproduce.py: 4 prompts x G = 8, 192 prompt + 64 new
        config = model_preset("tiny", vocab_size=len(build_demo_tokenizer()))
        batch, seq = 32, 256
    else:
        config = Qwen35Config(**(TINY if args.tiny else BENCH_CONFIG))
        batch, seq = (2, 64) if args.tiny else (4, 512)
    if args.delta_chunk:
        config = config.replace(chunk_size=args.delta_chunk)
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32))
    step, state = make_train_step(model, args.loss)
    start = time.perf_counter()
    compiled = step.lower(state, ids).compile()
    compile_s = time.perf_counter() - start
    hlo_text = compiled.as_text()
    module = parse_hlo(hlo_text)
    hlo_path = os.path.join(trace_dir, "train_step.hlo.txt")   # to look the trace's op names up by hand
    with open(hlo_path, "w") as f:
        f.write(hlo_text)
    flops = jaxpr_matmul_flops(step.trace(state, ids).jaxpr.jaxpr)

    def train_call():
        return jax.block_until_ready(compiled(state, ids))

    train_call()
    untraced = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        train_call()
        untraced.append(time.perf_counter() - t0)
    events, walls = profile_calls(train_call, args.steps, os.path.join(trace_dir, "train"))
    train = reduce_trace(events, {module.name: module}, walls)
    train.update(matmul_flops=flops, compile_s=compile_s, untraced_median_s=statistics.median(untraced),
                 gemm_gflops=flops / train["categories"][GEMM]["time_s"] / 1e9 if train["categories"][GEMM]["time_s"] else None,
                 hlo_module=module.name, hlo_path=hlo_path, batch=[batch, seq], loss=args.loss)

    decode = None
    if args.decode:
        n_prompts, prompt_len, new = (2, 8, 8) if args.tiny else (8, 64, 64)
        prompts = jnp.asarray(rng.integers(1, config.vocab_size, (n_prompts, prompt_len), dtype=np.int32))
        mask = jnp.ones_like(prompts)
        sampling = SamplingConfig(max_new_tokens=new, temperature=0.0)

        def decode_call():
            return jax.block_until_ready(generate(model, prompts, mask, jax.random.key(0), sampling))

        decode_call()
        events, walls = profile_calls(decode_call, 1, os.path.join(trace_dir, "decode"))
        names = {(e.get("args") or {}).get("hlo_module") for e in events} - {None}
        modules = dumped_modules(dump_dir, names)
        for path in glob.glob(os.path.join(dump_dir, "*")):   # keep the HLO texts, not every kernel's IR
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif not path.endswith(".cpu_after_optimizations.txt"):
                os.remove(path)
        decode = reduce_trace(events, modules, walls)
        decode.update(hlo_modules=sorted(modules), prompts=[n_prompts, prompt_len], new_tokens=new,
                      tokens_per_s=n_prompts * new / decode["wall_s"])

    load.finish()
    n_params = sum(x.size for x in jax.tree.leaves(state))
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, {name} "
          f"{n_params / 1e6:.2f}M params, fp32, train batch {batch}x{seq}, delta-rule chunk {config.chunk_size}; "
          f"trace in {trace_dir}")
    print(f"untraced step median {train['untraced_median_s'] * 1e3:.1f} ms ({args.repeats} runs), "
          f"compile {compile_s:.1f} s")
    print_table("train step (fwd+bwd, mean next-token CE)", train, load.mark, flops)
    if decode:
        print_table(f"greedy decode {decode['prompts'][0]}x{decode['prompts'][1]} + {decode['new_tokens']} "
                    f"({decode['tokens_per_s']:.0f} tok/s traced)", decode, load.mark)
    result = {"config": name, "jax": jax.__version__, "train": train,
              "decode": decode, "load": load.as_dict(), "trace_dir": trace_dir}
    json_path = args.json or os.path.join(trace_dir, "profile_step.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten {json_path}")
    return result


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
