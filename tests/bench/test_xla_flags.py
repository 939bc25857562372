"""bench/xla_flags.py: every flag set runs in a child process of its own, the flags reach XLA there,
and the children compute the same function (loss and greedy tokens) under every set."""
import argparse
import os

import pytest

from bench import xla_flags

HLO = """\
%fused_computation (param_0: f32[4,8], param_1: f32[8,2]) -> f32[4,2] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.0 = f32[4,2]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_tanh_computation (param_0.2: f32[4,2]) -> f32[4,2] {
  %param_0.2 = f32[4,2]{1,0} parameter(0)
  ROOT %tanh.0 = f32[4,2]{1,0} tanh(%param_0.2)
}

ENTRY %main.1 (a.1: f32[4,8], b.1: f32[8,2], c.1: f32[2,2]) -> f32[4,2] {
  %a.1 = f32[4,8]{1,0} parameter(0)
  %b.1 = f32[8,2]{1,0} parameter(1)
  %c.1 = f32[2,2]{1,0} parameter(2)
  %ynn_fusion = f32[4,2]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %wrapped_tanh = f32[4,2]{1,0} fusion(%ynn_fusion), kind=kLoop, calls=%wrapped_tanh_computation
  ROOT %dot.1 = f32[4,2]{1,0} dot(%wrapped_tanh, %c.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_library_fusions_counts_fusions_and_only_the_dots_outside_their_bodies():
    # One YNN fusion (whose body holds a dot) and one dot of XLA's own in the entry computation.
    assert xla_flags.library_fusions(HLO) == {"ynn": 1, "xnn": 0, "onednn": 0, "dot": 1}


def test_variants_are_name_equals_flags():
    assert xla_flags.parse_variant("ynn_off=--xla_cpu_experimental_ynn_fusion_type=") == (
        "ynn_off", "--xla_cpu_experimental_ynn_fusion_type=")
    for bad in ("no_equals_sign", "two words=--x=1", "=--x=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=FLAGS"):
            xla_flags.parse_variant(bad)


@pytest.mark.slow   # three child processes, each compiling a train step and a decode
def test_flag_sets_reach_xla_in_their_own_process_and_compute_the_same_function():
    # Both sets on top of the suite's own XLA_FLAGS (compile-speed flags, tests/conftest.py): what is compared
    # is the variant's flag, and the children compile faster (with -O0 alone: 34 s -> 24 s for this test on
    # 2 cores, cold cache).
    suite = os.environ.get("XLA_FLAGS", "")
    variants = [(name, f"{suite} {flags}".strip()) for name, flags in map(xla_flags.parse_variant,
                                                                          xla_flags.DEFAULT_VARIANTS)]
    summary = xla_flags.compare([("reference", suite), *variants], rounds=1, size="test", steps=1, log=lambda _: None)
    reference, ynn_off = summary["reference"], summary["ynn_off"]
    # XLA's default hands the model's dots to YNN; without YNN's dot fusions they are XLA's own dots.
    assert reference["fusions"]["ynn"] > 0
    assert ynn_off["fusions"]["ynn"] == 0 and ynn_off["fusions"]["dot"] > reference["fusions"]["dot"]
    assert ynn_off["loss_diff"] < 1e-5 and ynn_off["token_agreement"] == 1.0
    assert reference["train_ratio"] == 1.0 and ynn_off["train_s"] > 0 and ynn_off["decode_tok_s"] > 0
    with pytest.raises(RuntimeError, match="xla_no_such_flag"):
        xla_flags.run_child("--xla_no_such_flag=1", "test", 1)
