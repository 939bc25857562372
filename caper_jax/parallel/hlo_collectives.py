"""Collective bytes and the largest buffers of a compiled program, read from its HLO text.

Pure text parsing of ``compiled.as_text()`` (or an ``--xla_dump_to`` ``*after_optimizations*.txt`` file);
this module imports no JAX, so it also reads HLO that another venv's compiler wrote (bench/maxtext_compare.py).

API
---
``collective_bytes(hlo_text, ring=False) -> dict[str, int]``
    Bytes each kind of collective moves **per execution of the program, per chip**, under the
    convention below. Always the five keys ``all-gather``, ``reduce-scatter``, ``all-reduce``,
    ``all-to-all``, ``collective-permute`` (0 where absent). ``ring=True`` gives the ring-algorithm
    estimate of the bytes each chip actually sends instead (see "Ring refinement").
``analyze(hlo_text) -> Analysis``
    The same, itemised: ``.bytes`` and ``.ring_bytes`` (the two dicts above), ``.collectives`` (one
    ``Collective`` per distinct collective: kind, instruction, computation, bytes per execution,
    executions per program run, group size, channel id, ``op_name`` from its metadata — where an
    unexpected all-reduce comes from), ``.loops`` (one ``Loop`` per ``while`` reached: name, trip count,
    where the count came from: ``"backend_config"``, ``"condition"`` or ``"unknown"`` — counted as 1).
``largest_shapes(hlo_text, n=10, fused=False) -> list[Buffer]``
    The ``n`` largest distinct array shapes any instruction produces (bytes, shape without layout, how
    many instructions produce it, the first few instruction names and ``op_name`` s). Instructions
    inside fusion bodies are left out unless ``fused=True`` (they are not materialised). This is how to
    find a full-size vocabulary buffer (``f32[248320,4096]``) in a sharded program.
``shape_bytes(shape_text) -> int``
    Bytes of an HLO shape (array or tuple, layout ignored).

Bytes convention ("bytes moved per chip", per execution of one collective)
-------------------------------------------------------------------------
The logical size of the buffer the collective is about, as analyses of sharded programs (MaxText's
and most roofline write-ups) count it; tile padding of TPU layouts is not counted:

* ``all-gather``: the **result** (the full gathered buffer each chip ends up holding);
* ``reduce-scatter``: the **operand** (the full buffer each chip contributes);
* ``all-reduce``: the **operand** (= the result);
* ``all-to-all``: the **operand** (= the result);
* ``collective-permute``: the **operand** each chip sends (= the result).

Tuple-shaped (combined) collectives count the sum of their elements.

Ring refinement (``ring=True``): with ``n`` chips in a replica group, a ring algorithm has each chip send
``(n-1)/n`` of the all-gather result, of the reduce-scatter operand and of the all-to-all operand,
``2(n-1)/n`` of the all-reduce operand (reduce-scatter then all-gather), and the whole
collective-permute operand. ``n`` comes from ``replica_groups`` (explicit ``{{0,1},{2,3}}``, iota
``[2,2]<=[4]``, or ``mesh['x'=4,'y'=2] {'x'}``; empty groups mean every partition of the module).
Real TPU emitters (2-D rings on the torus, bidirectional links) differ; this is an estimate.

How the HLO is walked
---------------------
From ``ENTRY``, every called computation is counted where it is executed:

* ``while``: the body times the trip count: ``backend_config``'s ``known_trip_count`` if present, else
  the loop condition's ``compare`` of the induction variable against a constant (looking through a
  fused condition), from the variable's initial value when it is a constant (else 0), in steps of the
  constant the body adds to it (else 1; the TPU compiler's windowed einsum loops step by 2); nested
  loops multiply. A loop whose count cannot be read counts once and is listed in
  ``Analysis.loops`` with ``source="unknown"``.
* ``conditional``: the branch that moves the most bytes (an upper bound for one execution).
* ``fusion``, ``call``, ``async-start`` and every other ``calls=`` / ``to_apply=``: once per execution
  of the calling instruction.

Asynchronous collectives are counted once: ``all-gather-start`` / ``all-reduce-start`` /
``collective-permute-start`` are counted and their ``-done`` is not; the TPU compiler's async
collective fusions repeat the same collective (same ``channel_id``) in a start fusion, optional
overlapped fusions and a done fusion, so collectives are deduplicated by ``channel_id`` within one
execution of a computation (the largest count wins). The TPU compiler's ``all-reduce-scatter`` fusion
(an all-reduce whose result is sliced to this chip's shard) counts as a ``reduce-scatter`` of its operands,
including the custom form whose body holds no collective instruction (``emitter: AllReduceScatterFusion``:
the fusion instruction itself is the collective; its group is operand bytes over result bytes).
Limitation: a computation called from two sites of one computation that both run collectives with
the same ``channel_id`` is counted once there (compiled TPU HLO has no such calls: they are inlined).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# opcode -> (kind, how its bytes are read). "result": the instruction's result shape; "operand": its
# operands' shapes; "start_out": element 1 of an async start's (operands, results, ...) tuple.
_OPCODES = {
    "all-gather": ("all-gather", "result"),
    "all-gather-start": ("all-gather", "start_out"),
    "reduce-scatter": ("reduce-scatter", "operand"),
    "all-reduce": ("all-reduce", "operand"),
    "all-reduce-start": ("all-reduce", "operand"),
    "all-to-all": ("all-to-all", "operand"),
    "ragged-all-to-all": ("all-to-all", "operand"),
    "collective-permute": ("collective-permute", "operand"),
    "collective-permute-start": ("collective-permute", "operand"),
}

COLLECTIVE_OPCODES = tuple(_OPCODES)   # the HLO opcodes counted as collectives (their -done halves are not)

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
    "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64,
    "c128": 128, "token": 0, "f4e2m1fn": 4, "f8e8m0fnu": 8,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _dtype_bits(dtype: str) -> int | None:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f6"):
        return 6
    if dtype.startswith("f4"):
        return 4
    return None


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape (a tuple's elements in order); layouts are skipped."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if _dtype_bits(dtype) is None:
            continue
        out.append((dtype, tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())))
    return out


def _array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return (math.prod(dims) * _dtype_bits(dtype) + 7) // 8


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape such as ``f32[16,256]{1,0:T(8,128)}`` or ``(bf16[8], s32[])`` (the sum of a
    tuple's arrays; layouts and tile padding are ignored)."""
    return sum(_array_bytes(dtype, dims) for dtype, dims in _arrays(shape_text))


def _strip_layout(shape_text: str) -> str:
    return ", ".join(f"{d}[{','.join(map(str, dims))}]" for d, dims in _arrays(shape_text))


def _top_level_elements(tuple_text: str) -> list[str]:
    """Elements of a tuple shape ``(a, (b, c), d)`` -> ``['a', '(b, c)', 'd']``."""
    inner = re.sub(r"/\*.*?\*/", "", tuple_text.strip())[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool
    args: str = ""        # the text between the opcode's parentheses (a constant's literal, a parameter's number)


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction]
    by_name: dict[str, Instruction]

    @property
    def root(self) -> Instruction | None:
        return next((i for i in self.instructions if i.root), self.instructions[-1] if self.instructions else None)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str | None
    num_partitions: int
    replica_count: int


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:].strip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    close = _matching(rest, om.end() - 1)
    args = rest[om.end():close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instruction(name, shape, opcode, operands, rest[close:], root, args.strip())


def parse(hlo_text: str) -> Module:
    """Splits HLO text into computations of instructions (names without ``%``)."""
    computations: dict[str, Computation] = {}
    entry, current = None, None
    num_partitions = replica_count = 1
    for line in hlo_text.splitlines():
        if line.startswith("HloModule"):
            if m := re.search(r"\bnum_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            if m := re.search(r"\breplica_count=(\d+)", line):
                replica_count = int(m.group(1))
            continue
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2), bool(m.group(1)), [], {})
                if current.entry:
                    entry = current.name
            continue
        if line.strip() == "}":
            computations[current.name] = current
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            current.instructions.append(inst)
            current.by_name[inst.name] = inst
    if current is not None:
        computations[current.name] = current
    return Module(computations, entry, num_partitions, replica_count)


def _callees(inst: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls."""
    out = [(k, v) for k, v in _CALLEE.findall(inst.attrs)]
    for k, names in _CALLEE_LIST.findall(inst.attrs):
        out += [(k, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    return out


def _group_size(attrs: str, module: Module) -> int:
    everyone = module.num_partitions * module.replica_count
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip().strip("'\""): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        axes = [a.strip().strip("'\"") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in axes) if axes else everyone
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"source_target_pairs=", attrs)
    if m:
        return 2
    return everyone


_RING = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
         "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


@dataclasses.dataclass
class Collective:
    kind: str
    instruction: str
    computation: str
    bytes: int            # per execution, under the module's convention
    executions: int       # per execution of the program
    group_size: int
    channel_id: int | None
    op_name: str

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions

    @property
    def ring_bytes(self) -> float:
        return self.total_bytes * _RING[self.kind](max(self.group_size, 1))


@dataclasses.dataclass
class Loop:
    name: str
    computation: str
    trip_count: int
    source: str           # "backend_config", "condition" or "unknown"


@dataclasses.dataclass
class Analysis:
    collectives: list[Collective]
    loops: list[Loop]

    @property
    def bytes(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for c in self.collectives:
            out[c.kind] += c.total_bytes
        return out

    @property
    def ring_bytes(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0.0)
        for c in self.collectives:
            out[c.kind] += c.ring_bytes
        return {k: int(round(v)) for k, v in out.items()}


def _resolve_constant(comp: Computation, name: str, module: Module, depth: int = 0) -> int | None:
    """Integer value of ``name`` in ``comp`` if it is a constant, looking through copies, converts,
    bitcasts and reshapes."""
    inst = comp.by_name.get(name)
    if inst is None or depth > 16:
        return None
    if inst.opcode == "constant":
        return int(inst.args) if re.fullmatch(r"-?\d+", inst.args) else None
    if inst.opcode in ("copy", "convert", "bitcast", "reshape") and inst.operands:
        return _resolve_constant(comp, inst.operands[0], module, depth + 1)
    return None


def _tuple_index(comp: Computation, name: str, depth: int = 0) -> int | None:
    """Tuple index of the loop state ``name`` reads (``get-tuple-element(param), index=i``)."""
    inst = comp.by_name.get(name)
    if inst is None or depth > 16:
        return None
    if inst.opcode == "get-tuple-element":
        m = re.search(r"\bindex=(\d+)", inst.attrs)
        return int(m.group(1)) if m else None
    if inst.opcode in ("copy", "convert", "bitcast", "reshape") and inst.operands:
        return _tuple_index(comp, inst.operands[0], depth + 1)
    return None


def _compare_in(comp: Computation, module: Module):
    """(direction, lhs, rhs) of the compare that decides a loop condition, each side as
    ("const", value) / ("state", tuple index) / None; looks into a fused ROOT."""
    root = comp.root
    if root is None:
        return None
    if root.opcode == "compare":
        sides = []
        for op in root.operands[:2]:
            value = _resolve_constant(comp, op, module)
            sides.append(("const", value) if value is not None else
                         (("state", i) if (i := _tuple_index(comp, op)) is not None else None))
        m = re.search(r"direction=(\w+)", root.attrs)
        return (m.group(1) if m else None, *sides)
    if root.opcode == "fusion":
        callee = next((module.computations.get(c) for k, c in _callees(root) if k == "calls"), None)
        if callee is None or callee.root is None or callee.root.opcode != "compare":
            return None
        params = {}
        for inst in callee.instructions:
            if inst.opcode == "parameter":
                params[inst.name] = int(inst.args) if inst.args.isdigit() else None
        sides = []
        for op in callee.root.operands[:2]:
            value = _resolve_constant(callee, op, module)
            if value is None and op in params and params[op] is not None and params[op] < len(root.operands):
                outer = root.operands[params[op]]
                value = _resolve_constant(comp, outer, module)
                if value is None and (i := _tuple_index(comp, outer)) is not None:
                    sides.append(("state", i))
                    continue
            sides.append(("const", value) if value is not None else None)
        m = re.search(r"direction=(\w+)", callee.root.attrs)
        return (m.group(1) if m else None, *sides)
    return None


def _trip_count(inst: Instruction, parent: Computation, module: Module) -> tuple[int, str]:
    m = _TRIP.search(inst.attrs)
    if m:
        return int(m.group(1)), "backend_config"
    cond_name = next((c for k, c in _callees(inst) if k == "condition"), None)
    cond = module.computations.get(cond_name) if cond_name else None
    found = _compare_in(cond, module) if cond else None
    if not found or None in found[1:] or found[0] is None:
        return 1, "unknown"
    direction, lhs, rhs = found
    if lhs[0] == "const" and rhs[0] == "state":   # bound OP i  ->  i OP' bound
        lhs, rhs = rhs, lhs
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if lhs[0] != "state" or rhs[0] != "const":
        return 1, "unknown"
    init = 0
    if inst.operands:
        state = parent.by_name.get(inst.operands[0])
        if state is not None and state.opcode == "tuple" and lhs[1] < len(state.operands):
            value = _resolve_constant(parent, state.operands[lhs[1]], module)
            init = value if value is not None else 0
    body_name = next((c for k, c in _callees(inst) if k == "body"), None)
    step = _step(module.computations.get(body_name), lhs[1], module) if body_name else None
    step = step or (1 if direction in ("LT", "LE", "NE") else -1)
    bound = rhs[1]
    span = {"LT": bound - init, "LE": bound - init + 1, "NE": bound - init,
            "GT": init - bound, "GE": init - bound + 1}.get(direction)
    if span is None:
        return 1, "unknown"
    stride = step if direction in ("LT", "LE", "NE") else -step
    if stride <= 0:
        return 1, "unknown"
    return max(-(-span // stride), 0), "condition"


def _step(body: Computation | None, index: int, module: Module) -> int | None:
    """The constant the loop body adds to (or subtracts from) loop state element ``index``, if it does."""
    if body is None or body.root is None or body.root.opcode != "tuple" or index >= len(body.root.operands):
        return None
    inst = body.by_name.get(body.root.operands[index])
    while inst is not None and inst.opcode in ("copy", "convert", "bitcast") and inst.operands:
        inst = body.by_name.get(inst.operands[0])
    if inst is None or inst.opcode not in ("add", "subtract") or len(inst.operands) != 2:
        return None
    a, b = inst.operands
    for state, other, sign in ((a, b, 1), (b, a, 1)) if inst.opcode == "add" else ((a, b, -1),):
        value = _resolve_constant(body, other, module)
        if value is not None and _tuple_index(body, state) == index:
            return sign * value
    return None


def _operand_bytes(inst: Instruction, comp: Computation) -> int | None:
    total = 0
    for op in inst.operands:
        src = comp.by_name.get(op)
        if src is None:
            return None
        total += shape_bytes(src.shape)
    return total


def _collective_bytes(inst: Instruction, comp: Computation, how: str, group: int) -> int:
    if how == "result":
        return shape_bytes(inst.shape)
    if how == "start_out":
        parts = _top_level_elements(inst.shape) if inst.shape.startswith("(") else [inst.shape]
        return shape_bytes(parts[1] if len(parts) > 1 else parts[0])
    operand = _operand_bytes(inst, comp)
    if operand is not None:
        return operand
    # Operand unknown (not in this computation): derive it from the result.
    if inst.opcode == "reduce-scatter":
        return shape_bytes(inst.shape) * group
    parts = _top_level_elements(inst.shape) if inst.opcode.endswith("-start") and inst.shape.startswith("(") else None
    return shape_bytes(parts[1] if parts and len(parts) > 1 else inst.shape)


def analyze(hlo_text: str) -> Analysis:
    """Every collective the program executes, with its executions per run (see the module docstring)."""
    module = parse(hlo_text)
    memo: dict[str, dict] = {}
    loops: list[Loop] = []
    seen_loops: set[tuple[str, str]] = set()

    def merge(acc: dict, part: dict, times: int) -> None:
        for key, (c, n) in part.items():
            if key not in acc or acc[key][1] < n * times:
                acc[key] = (c, n * times)

    def visit(name: str, stack: tuple[str, ...] = ()) -> dict:
        if name in memo:
            return memo[name]
        comp = module.computations.get(name)
        acc: dict = {}
        if comp is None or name in stack:
            return acc
        stack = (*stack, name)
        for inst in comp.instructions:
            spec = _OPCODES.get(inst.opcode)
            if spec is not None:
                kind, how = spec
                if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                    kind = "reduce-scatter"
                group = _group_size(inst.attrs, module)
                channel = _CHANNEL.search(inst.attrs)
                op_name = _OP_NAME.search(inst.attrs)
                c = Collective(kind, inst.name, name, _collective_bytes(inst, comp, how, group), 1, group,
                               int(channel.group(1)) if channel else None, op_name.group(1) if op_name else "")
                key = ("channel", c.channel_id) if c.channel_id is not None else ("instruction", name, inst.name)
                merge(acc, {key: (c, 1)}, 1)
            callees = _callees(inst)
            if not callees:
                continue
            if inst.opcode == "fusion" and any(c.startswith("all-reduce-scatter") for _, c in callees):
                # The TPU compiler's AllReduceScatterFusion: a custom fusion whose body only slices; the
                # collective is the fusion itself, the full gradients in, this chip's shards out.
                contributed = _operand_bytes(inst, comp)
                shard = shape_bytes(inst.shape)
                contributed = contributed if contributed is not None else shard
                c = Collective("reduce-scatter", inst.name, name, contributed, 1,
                               max(1, round(contributed / shard)) if shard else 1, None, "")
                merge(acc, {("instruction", name, inst.name): (c, 1)}, 1)
                continue
            if inst.opcode == "while":
                trips, source = _trip_count(inst, comp, module)
                if (name, inst.name) not in seen_loops:
                    seen_loops.add((name, inst.name))
                    loops.append(Loop(inst.name, name, trips, source))
                for attr, callee in callees:
                    if attr == "body":
                        merge(acc, visit(callee, stack), trips)
            elif inst.opcode == "conditional":
                branches = [visit(c, stack) for _, c in callees]
                if branches:
                    merge(acc, max(branches, key=lambda b: sum(c.bytes * n for c, n in b.values())), 1)
            else:
                for attr, callee in callees:
                    merge(acc, visit(callee, stack), 1)
        memo[name] = acc
        return acc

    found = visit(module.entry) if module.entry else {}
    collectives = [dataclasses.replace(c, executions=n) for c, n in found.values()]
    return Analysis(collectives, loops)


def collective_bytes(hlo_text: str, ring: bool = False) -> dict[str, int]:
    """Bytes per program execution per chip for each of ``KINDS`` (see the module docstring)."""
    analysis = analyze(hlo_text)
    return analysis.ring_bytes if ring else analysis.bytes


@dataclasses.dataclass
class Buffer:
    bytes: int
    shape: str
    count: int
    instructions: list[str]
    op_names: list[str]


def largest_shapes(hlo_text: str, n: int = 10, fused: bool = False) -> list[Buffer]:
    """The ``n`` largest distinct array shapes produced by instructions (tuple results are split into
    their arrays), largest first. Fusion bodies are skipped unless ``fused``."""
    module = parse(hlo_text)
    fusion_bodies = set()
    if not fused:
        for comp in module.computations.values():
            for inst in comp.instructions:
                if inst.opcode == "fusion" or inst.opcode.endswith("-start") or inst.opcode == "async-start":
                    fusion_bodies.update(c for k, c in _callees(inst) if k == "calls")
    shapes: dict[str, Buffer] = {}
    for comp in module.computations.values():
        if comp.name in fusion_bodies:
            continue
        for inst in comp.instructions:
            if inst.opcode in ("get-tuple-element", "tuple"):
                continue
            op_name = _OP_NAME.search(inst.attrs)
            for dtype, dims in _arrays(inst.shape):
                key = f"{dtype}[{','.join(map(str, dims))}]"
                buf = shapes.setdefault(key, Buffer(_array_bytes(dtype, dims), key, 0, [], []))
                buf.count += 1
                if len(buf.instructions) < 3:
                    buf.instructions.append(f"{comp.name}/{inst.name}")
                if op_name and op_name.group(1) not in buf.op_names and len(buf.op_names) < 3:
                    buf.op_names.append(op_name.group(1))
    return sorted(shapes.values(), key=lambda b: -b.bytes)[:n]


def summary(hlo_text: str, top: int = 5) -> str:
    """A few lines for humans: bytes per kind, loops, the largest buffers."""
    analysis = analyze(hlo_text)
    lines = [json.dumps(analysis.bytes)]
    lines += [f"loop {l.name}: {l.trip_count} trips ({l.source})" for l in analysis.loops]
    lines += [f"{b.bytes / 2**20:10.1f} MiB  {b.shape}  x{b.count}  {b.op_names[:1]}"
              for b in largest_shapes(hlo_text, top)]
    return "\n".join(lines)


def _main(paths: Iterable[str]) -> None:
    for path in paths:
        with open(path) as f:
            print(path)
            print(summary(f.read()))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
