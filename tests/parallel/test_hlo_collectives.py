"""hlo_collectives: collective bytes per program run and the largest buffers, read from HLO text.

Hand-written HLO modules with bytes computed by hand (every kind, async start/done pairs, the TPU
compiler's async collective fusions sharing one channel_id, nested loops with trip counts from
backend_config and from the loop condition, a conditional, the all-reduce-scatter fusion), and one
program compiled by the real TPU compiler (libtpu, no TPU needed) for v5e:2x2 whose collectives are
known from its sharding: an FSDP-style scanned matmul stack gathers every layer's weight once forward
and once backward and reduce-scatters every layer's gradient once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from caper_jax.parallel.hlo_collectives import KINDS, analyze, collective_bytes, largest_shapes, shape_bytes
from tests.helpers import REPO


def _module(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def test_shape_bytes():
    assert shape_bytes("f32[16,256]{1,0:T(8,128)}") == 16 * 256 * 4          # layout and tiles ignored
    assert shape_bytes("bf16[2,3,5]{2,1,0:T(8,128)(2,1)S(1)}") == 60
    assert shape_bytes("(bf16[8]{0}, s32[], /*index=2*/pred[7])") == 16 + 4 + 7
    assert shape_bytes("s4[3]") == 2                                            # 12 bits
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("f8e4m3fn[10]") == 10


FLAT = _module("""
HloModule flat, is_scheduled=true, num_partitions=8
""" + ADD + """
ENTRY %main (p0: f32[16,256], p1: bf16[64,128], p2: s8[100,10], p3: f32[3,5]) -> f32[16,256] {
  %p0 = f32[16,256]{1,0:T(8,128)} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  %p2 = s8[100,10]{1,0} parameter(2)
  %p3 = f32[3,5]{1,0} parameter(3)
  %ag = f32[128,256]{1,0} all-gather(%p0), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %rs = bf16[8,128]{1,0} reduce-scatter(%p1), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %ar = f32[16,256]{1,0} all-reduce(%p0), channel_id=3, replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%add
  %a2a = s8[100,10]{1,0} all-to-all(%p2), channel_id=4, replica_groups=[4,2]<=[8], dimensions={0}
  %cps = (f32[3,5], f32[3,5], u32[], u32[]) collective-permute-start(%p3), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[3,5]{1,0} collective-permute-done(%cps)
  %ags = (f32[16,256]{1,0}, f32[128,256]{1,0}) all-gather-start(%p0), channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[128,256]{1,0} all-gather-done(%ags)
  %ars = f32[16,256]{1,0} all-reduce-start(%p0), channel_id=7, replica_groups={}, to_apply=%add
  %ard = f32[16,256]{1,0} all-reduce-done(%ars)
  ROOT %t = (f32[128,256], bf16[8,128], f32[16,256], s8[100,10], f32[3,5], f32[128,256], f32[16,256]) tuple(%ag, %rs, %ar, %a2a, %cpd, %agd, %ard)
}
""")


def test_every_kind_and_async_pairs_counted_once():
    # all-gather: result f32[128,256] = 131072 B, twice (sync + start/done pair, counted once);
    # reduce-scatter: operand bf16[64,128] = 16384; all-reduce: operand f32[16,256] = 16384, twice (sync and
    # start/done); all-to-all: operand s8[100,10] = 1000; collective-permute: operand f32[3,5] = 60.
    assert collective_bytes(FLAT) == {"all-gather": 262144, "reduce-scatter": 16384, "all-reduce": 32768,
                                      "all-to-all": 1000, "collective-permute": 60}
    # Ring: all-gather over 8: 7/8; reduce-scatter over 8: 7/8; all-reduce over 'y' (4): 2·3/4, and over all
    # 8 partitions (replica_groups={}): 2·7/8; all-to-all over 2: 1/2; collective-permute: all of it.
    assert collective_bytes(FLAT, ring=True) == {
        "all-gather": 229376, "reduce-scatter": 14336, "all-reduce": 24576 + 28672, "all-to-all": 500,
        "collective-permute": 60}
    groups = {c.instruction: c.group_size for c in analyze(FLAT).collectives}
    assert groups == {"ag": 8, "rs": 8, "ar": 4, "a2a": 2, "cps": 2, "ags": 8, "ars": 8}


LOOPS = _module("""
HloModule loops, num_partitions=4
""" + ADD + """
%inner_body (ip: (s32[], f32[10])) -> (s32[], f32[10]) {
  %ip = (s32[], f32[10]) parameter(0)
  %i = s32[] get-tuple-element(%ip), index=0
  %x = f32[10] get-tuple-element(%ip), index=1
  %ar = f32[10] all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[10]) tuple(%next, %ar)
}

%inner_cond (ic: (s32[], f32[10])) -> pred[] {
  %ic = (s32[], f32[10]) parameter(0)
  %ii = s32[] get-tuple-element(%ic), index=0
  %big = s32[] constant(1000)
  ROOT %lt = pred[] compare(%ii, %big), direction=LT
}

%outer_body (op: (s32[], f32[10], f32[8])) -> (s32[], f32[10], f32[8]) {
  %op = (s32[], f32[10], f32[8]) parameter(0)
  %j = s32[] get-tuple-element(%op), index=0
  %y = f32[10] get-tuple-element(%op), index=1
  %z = f32[8] get-tuple-element(%op), index=2
  %zero = s32[] constant(0)
  %it = (s32[], f32[10]) tuple(%zero, %y)
  %w = (s32[], f32[10]) while(%it), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %y2 = f32[10] get-tuple-element(%w), index=1
  %ag = f32[32] all-gather(%z), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %z2 = f32[8] slice(%ag), slice={[0:8]}
  %one = s32[] constant(1)
  %j2 = s32[] add(%j, %one)
  ROOT %r = (s32[], f32[10], f32[8]) tuple(%j2, %y2, %z2)
}

%outer_cond (oc: (s32[], f32[10], f32[8])) -> pred[] {
  %oc = (s32[], f32[10], f32[8]) parameter(0)
  %three = s32[] constant(3)
  %jj = s32[] get-tuple-element(%oc), index=0
  ROOT %lt = pred[] compare(%jj, %three), direction=LT
}

%fused_cond_compare (fp0: s32[], fp1: s32[]) -> pred[] {
  %fp0 = s32[] parameter(0)
  %fp1 = s32[] parameter(1)
  ROOT %cmp = pred[] compare(%fp1, %fp0), direction=GT
}

%third_body (tp: (s32[], f32[6])) -> (s32[], f32[6]) {
  %tp = (s32[], f32[6]) parameter(0)
  %k = s32[] get-tuple-element(%tp), index=0
  %v = f32[6] get-tuple-element(%tp), index=1
  %cp = f32[6] collective-permute(%v), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %one = s32[] constant(1)
  %k2 = s32[] add(%k, %one)
  ROOT %r = (s32[], f32[6]) tuple(%k2, %cp)
}

%third_cond (tc: (s32[], f32[6])) -> pred[] {
  %tc = (s32[], f32[6]) parameter(0)
  %kk = s32[] get-tuple-element(%tc), index=0
  %seven = s32[] constant(7)
  ROOT %f = pred[] fusion(%kk, %seven), kind=kLoop, calls=%fused_cond_compare
}

%step_body (sp: (u32[], f32[4])) -> (u32[], f32[4]) {
  %sp = (u32[], f32[4]) parameter(0)
  %m = u32[] get-tuple-element(%sp), index=0
  %v4 = f32[4] get-tuple-element(%sp), index=1
  %a2a = f32[4] all-to-all(%v4), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %two = u32[] constant(2)
  %m2 = u32[] add(%two, %m)
  ROOT %r = (u32[], f32[4]) tuple(%m2, %a2a)
}

%step_cond (sc: (u32[], f32[4])) -> pred[] {
  %sc = (u32[], f32[4]) parameter(0)
  %mm = u32[] get-tuple-element(%sc), index=0
  %sixteen = u32[] constant(16)
  ROOT %lt = pred[] compare(%mm, %sixteen), direction=LT
}

ENTRY %main (p: f32[10], q: f32[8], u: f32[6], s: f32[4]) -> f32[10] {
  %s = f32[4] parameter(3)
  %u0 = u32[] constant(0)
  %t4 = (u32[], f32[4]) tuple(%u0, %s)
  %loop4 = (u32[], f32[4]) while(%t4), condition=%step_cond, body=%step_body
  %p = f32[10] parameter(0)
  %q = f32[8] parameter(1)
  %u = f32[6] parameter(2)
  %c0 = s32[] constant(0)
  %start = s32[] copy(%c0)
  %t = (s32[], f32[10], f32[8]) tuple(%start, %p, %q)
  %loop = (s32[], f32[10], f32[8]) while(%t), condition=%outer_cond, body=%outer_body
  %c2 = s32[] constant(2)
  %t3 = (s32[], f32[6]) tuple(%c2, %u)
  %loop3 = (s32[], f32[6]) while(%t3), condition=%third_cond, body=%third_body
  ROOT %out = f32[10] get-tuple-element(%loop), index=1
}
""")


def test_loops_multiply_by_their_trip_counts():
    # inner loop: 4 trips (backend_config; its condition's 1000 must not be used) inside an outer loop of
    # 3 (condition: i < 3 from a copied constant 0): all-reduce f32[10] = 40 B, 12 times = 480. The outer
    # body's all-gather f32[32] = 128 B, 3 times = 384. Third loop: fused condition 7 > k, k from 2: 5 trips
    # of a collective-permute of f32[6] = 24 B = 120. Fourth loop: 0 to 16 in steps of 2 (as the TPU compiler's
    # windowed einsum loops count): 8 trips of an all-to-all of f32[4] = 16 B = 128.
    assert collective_bytes(LOOPS) == {"all-gather": 384, "reduce-scatter": 0, "all-reduce": 480,
                                       "all-to-all": 128, "collective-permute": 120}
    loops = {l.name: (l.trip_count, l.source) for l in analyze(LOOPS).loops}
    assert loops == {"loop": (3, "condition"), "w": (4, "backend_config"), "loop3": (5, "condition"),
                     "loop4": (8, "condition")}


ASYNC_FUSIONS = _module("""
HloModule async_fusions, num_partitions=4

%ag_start_body (a0: bf16[4,64]) -> (bf16[4,64], bf16[16,64]) {
  %a0 = bf16[4,64] parameter(0)
  %g0 = bf16[16,64] all-gather(%a0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cc = (bf16[4,64], bf16[16,64]) custom-call(%g0), custom_call_target="AsyncCollectiveStart"
}

%ag_middle_body (b0: bf16[4,64], b1: f32[8,8]) -> (f32[8,8], bf16[16,64]) {
  %b0 = bf16[4,64] parameter(0)
  %b1 = f32[8,8] parameter(1)
  %mm = f32[8,8] multiply(%b1, %b1)
  %g1 = bf16[16,64] all-gather(%b0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %tm = (f32[8,8], bf16[16,64]) tuple(%mm, %g1)
}

%ag_done_body (d0: bf16[4,64], d1: bf16[16,64]) -> bf16[16,64] {
  %d0 = bf16[4,64] parameter(0)
  %d1 = bf16[16,64] parameter(1)
  %g2 = bf16[16,64] all-gather(%d0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cd = bf16[16,64] custom-call(%d0, %d1, %g2), custom_call_target="AsyncCollectiveDone"
}

%body (bp: (s32[], bf16[4,64], f32[8,8])) -> (s32[], bf16[4,64], f32[8,8]) {
  %bp = (s32[], bf16[4,64], f32[8,8]) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %x = bf16[4,64] get-tuple-element(%bp), index=1
  %m = f32[8,8] get-tuple-element(%bp), index=2
  %start = (bf16[4,64], bf16[16,64]) fusion(%x), kind=kCustom, calls=%ag_start_body
  %s0 = bf16[4,64] get-tuple-element(%start), index=0
  %mid = (f32[8,8], bf16[16,64]) fusion(%s0, %m), kind=kOutput, calls=%ag_middle_body
  %m2 = f32[8,8] get-tuple-element(%mid), index=0
  %s1 = bf16[16,64] get-tuple-element(%start), index=1
  %done = bf16[16,64] fusion(%s0, %s1), kind=kCustom, calls=%ag_done_body
  %sl = bf16[4,64] slice(%done), slice={[0:4], [0:64]}
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %r = (s32[], bf16[4,64], f32[8,8]) tuple(%i2, %sl, %m2)
}

%cond (cp: (s32[], bf16[4,64], f32[8,8])) -> pred[] {
  %cp = (s32[], bf16[4,64], f32[8,8]) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x: bf16[4,64], m: f32[8,8]) -> f32[8,8] {
  %x = bf16[4,64] parameter(0)
  %m = f32[8,8] parameter(1)
  %z = s32[] constant(0)
  %t = (s32[], bf16[4,64], f32[8,8]) tuple(%z, %x, %m)
  %w = (s32[], bf16[4,64], f32[8,8]) while(%t), condition=%cond, body=%body
  ROOT %o = f32[8,8] get-tuple-element(%w), index=2
}
""")


def test_async_collective_fusions_count_once_per_channel():
    # One all-gather (channel 9, result bf16[16,64] = 2048 B) repeated in start / middle / done fusions,
    # in a loop of 2 trips: 4096 B, not 3 x 4096.
    assert collective_bytes(ASYNC_FUSIONS)["all-gather"] == 4096
    [c] = analyze(ASYNC_FUSIONS).collectives
    assert (c.channel_id, c.executions, c.bytes) == (9, 2, 2048)


def _branches(branch1_all_reduce: int) -> str:
    return _module("""
HloModule branches, num_partitions=2
""" + ADD + f"""
%branch0 (x0: f32[100]) -> f32[100] {{
  %x0 = f32[100] parameter(0)
  ROOT %ar0 = f32[100] all-reduce(%x0), channel_id=1, replica_groups={{{{0,1}}}}, to_apply=%add
}}

%branch1 (x1: f32[100]) -> f32[100] {{
  %x1 = f32[100] parameter(0)
  %s1 = f32[25] slice(%x1), slice={{[0:25]}}
  %ag1 = f32[50] all-gather(%s1), channel_id=2, replica_groups={{{{0,1}}}}, dimensions={{0}}
  %s2 = f32[{branch1_all_reduce}] slice(%x1), slice={{[0:{branch1_all_reduce}]}}
  %ar1 = f32[{branch1_all_reduce}] all-reduce(%s2), channel_id=3, replica_groups={{{{0,1}}}}, to_apply=%add
  ROOT %n1 = f32[100] negate(%x1)
}}

%all-reduce-scatter.clone.1 (y: f32[64,32]) -> f32[32,32] {{
  %y = f32[64,32] parameter(0)
  %ar2 = f32[64,32] all-reduce(%y), channel_id=4, replica_groups={{{{0,1}}}}, to_apply=%add
  %pid = u32[] partition-id()
  %c32 = u32[] constant(32)
  %off = u32[] multiply(%pid, %c32)
  %c0 = u32[] constant(0)
  ROOT %ds = f32[32,32] dynamic-slice(%ar2, %off, %c0), dynamic_slice_sizes={{32,32}}
}}

ENTRY %main (b: s32[], x: f32[100], y: f32[64,32]) -> (f32[100], f32[32,32]) {{
  %b = s32[] parameter(0)
  %x = f32[100] parameter(1)
  %y = f32[64,32] parameter(2)
  %c = f32[100] conditional(%b, %x, %x), branch_computations={{%branch0, %branch1}}
  %rsf = f32[32,32] fusion(%y), kind=kCustom, calls=%all-reduce-scatter.clone.1
  ROOT %t = (f32[100], f32[32,32]) tuple(%c, %rsf)
}}
""")


def test_conditional_takes_the_costlier_branch_and_all_reduce_scatter_is_a_reduce_scatter():
    # branch0: all-reduce f32[100] = 400 B. branch1: all-gather result f32[50] = 200 B plus an all-reduce of
    # f32[60] = 240 B (440 B in all: branch1 counts) or of f32[10] = 40 B (240 B: branch0 counts).
    # The all-reduce-scatter fusion: operand f32[64,32] = 8192 B, as a reduce-scatter.
    assert collective_bytes(_branches(60)) == {"all-gather": 200, "reduce-scatter": 8192, "all-reduce": 240,
                                               "all-to-all": 0, "collective-permute": 0}
    assert collective_bytes(_branches(10)) == {"all-gather": 0, "reduce-scatter": 8192, "all-reduce": 400,
                                               "all-to-all": 0, "collective-permute": 0}


def test_all_reduce_scatter_fusion_without_a_collective_in_its_body():
    # As libtpu 0.0.42 emits the FSDP gradient reduction (emitter AllReduceScatterFusion): the body only slices,
    # the fusion instruction is the collective. Two gradients f32[256,128] + f32[128,128] in (196,608 B),
    # each chip's halves out: a reduce-scatter of the operands over 2 chips.
    text = _module("""
%all-reduce-scatter.26 (input_0: f32[256,128], input_1: f32[128,128]) -> (f32[256,64], f32[128,64]) {
  %input_0 = f32[256,128] parameter(0)
  %input_1 = f32[128,128] parameter(1)
  %pid = u32[] partition-id()
  %c64 = u32[] constant(64)
  %off = u32[] multiply(%pid, %c64)
  %c0 = u32[] constant(0)
  %d0 = f32[256,64] dynamic-slice(%input_0, %c0, %off), dynamic_slice_sizes={256,64}
  %d1 = f32[128,64] dynamic-slice(%input_1, %c0, %off), dynamic_slice_sizes={128,64}
  ROOT %t = (f32[256,64], f32[128,64]) tuple(%d0, %d1)
}

ENTRY %main (a: f32[256,128], b: f32[128,128]) -> (f32[256,64], f32[128,64]) {
  %a = f32[256,128] parameter(0)
  %b = f32[128,128] parameter(1)
  ROOT %f = (f32[256,64], f32[128,64]) fusion(%a, %b), kind=kCustom, calls=%all-reduce-scatter.26, backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion"}}
}
""")
    analysis = analyze(text)
    assert analysis.bytes["reduce-scatter"] == (256 * 128 + 128 * 128) * 4
    assert [c.group_size for c in analysis.collectives] == [2]


def test_largest_shapes_skips_fusion_bodies_unless_asked():
    text = _module("""
    HloModule big

    %fused (fp: bf16[500,500]) -> f32[10] {
      %fp = bf16[500,500] parameter(0)
      %wide = f32[1000,1000] broadcast(%fp), dimensions={}
      ROOT %r = f32[10] slice(%wide), slice={[0:10]}
    }

    ENTRY %main (e: bf16[500,500], g: s32[7]) -> f32[10] {
      %e = bf16[500,500]{1,0} parameter(0), metadata={op_name="embed"}
      %g = s32[7] parameter(1)
      %e2 = bf16[500,500]{1,0:T(8,128)(2,1)} negate(%e)
      ROOT %f = f32[10] fusion(%e2), kind=kLoop, calls=%fused
    }
    """)
    top = largest_shapes(text, 2)
    assert [(b.shape, b.bytes, b.count) for b in top] == [("bf16[500,500]", 500000, 2), ("f32[10]", 40, 1)]
    assert top[0].op_names == ["embed"] and top[0].instructions == ["main/e", "main/e2"]
    assert largest_shapes(text, 1, fused=True)[0].shape == "f32[1000,1000]"


TPU_PROGRAM = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

devices = topologies.get_topology_desc("v5e:2x2", platform="tpu").devices
mesh = Mesh(np.array(devices).reshape(4), ("x",))
S = lambda *spec: NamedSharding(mesh, P(*spec))

total = jax.jit(lambda x: x.sum(axis=0), in_shardings=S("x", None), out_shardings=S())
text = total.lower(jax.ShapeDtypeStruct((64, 256), jnp.float32)).compile().as_text()
open(sys.argv[1] + "/psum.txt", "w").write(text)

def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h.astype(jnp.float32).sum()

grad = jax.jit(jax.grad(loss), in_shardings=(S(None, "x", None), S("x", None)), out_shardings=S(None, "x", None))
text = grad.lower(jax.ShapeDtypeStruct((3, 512, 512), jnp.bfloat16),
                  jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)).compile().as_text()
open(sys.argv[1] + "/fsdp.txt", "w").write(text)
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'jax[tpu]')")
def test_tpu_compiled_program(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", TPU_PROGRAM, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # Sum over the sharded rows: one all-reduce of this chip's partial sums, f32[256] = 1024 B.
    assert collective_bytes((tmp_path / "psum.txt").read_text()) == dict.fromkeys(KINDS, 0) | {"all-reduce": 1024}
    # FSDP over 4 chips, 3 scanned layers of bf16[512,512] (512 KiB each): every layer's weight gathered
    # forward and again backward (6 x 512 KiB), every layer's gradient reduce-scattered (3 x 512 KiB; the TPU
    # compiler's all-reduce-scatter fusion). In this HLO the backward gathers sit in async collective fusions
    # (one channel_id in start, overlapped and done fusions) and the trip counts only in the loop conditions.
    fsdp = analyze((tmp_path / "fsdp.txt").read_text())
    layer = 512 * 512 * 2
    assert fsdp.bytes == dict.fromkeys(KINDS, 0) | {"all-gather": 6 * layer, "reduce-scatter": 3 * layer}
    assert sorted((l.trip_count, l.source) for l in fsdp.loops) == [(3, "condition"), (3, "condition")]
