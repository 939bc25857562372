"""``--compile_for``: the TPU compiler (libtpu, no TPU attached) compiles every program of a step for a Cloud TPU
slice. Here the tiny model on a v5e-4 (a 2x2 torus of v5e chips), the PRM with ``data = 2`` (where the embedding's
gradient used to be built at full size and all-reduced over every chip), GRPO at one prompt width, and a planted
config too large for the chip.
"""
import json
import re
import subprocess
import sys

import jax
import pytest

from caper_jax.parallel import compile_for, hlo_collectives, slices, target
from tests.helpers import REPO

# The tiny PRM at small shapes (the programs' structure is the 9B's; compile time is what CI pays for), on a
# (data=2, fsdp=2) mesh.
TINY_PRM = ("--config=configs/prm.py", "--config.data.max_len=64", "--config.data.bucket_lengths=(64,)",
            "--config.data.batch_size=4", "--config.data.within_batch_size=0", "--config.data.eval_batch_size=4",
            "--config.mesh_shape.data=2", "--config.mesh_shape.fsdp=2")
TINY_GRPO = ("--config=configs/grpo.py:variant=clause", "--config.prm.workdir=runs/prm_demo",   # not read: shapes only
             "--config.sampling.prompt_widths=(32,)",
             "--config.sampling.max_prompt_len=32", "--config.sampling.max_new_tokens=8",
             "--config.rl.prompts_per_step=2", "--config.rl.group_size=2")


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "caper_jax.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


def report_of(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])   # the last line is the JSON object


def check_program(program: dict, hbm: int) -> None:
    assert set(program["collective_bytes"]) == set(hlo_collectives.KINDS)
    assert 0 < program["peak_bytes"] <= program["resident_bytes"] < 0.95 * hbm and program["fits"]
    # peak = argument + output - alias + temp, as parallel/dry_run.py defines it
    assert program["peak_bytes"] == (program["argument_bytes"] + program["output_bytes"] - program["alias_bytes"]
                                     + program["temp_bytes"])
    assert program["matmul_flops"] > 0
    bound = program["lower_bound_estimate"]
    assert bound["bound_s"] == max(bound["compute_s"], bound["hbm_s"], bound["ici_s"]) > 0


@pytest.mark.slow
def test_prm_programs_compile_for_a_v5e_slice():
    report = report_of(train(*TINY_PRM, "--compile_for=v5e-4"))
    assert (report["slice"], report["topology"], report["chips"], report["device_kind"]) == \
        ("v5e-4", "v5e:2x2", 4, "TPU v5 lite")
    assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1} and report["fits"] is True
    assert report["hbm_bytes"] == int(15.75 * 2**30)
    assert set(report["programs"]) == {"train_step", "clause_scores"}
    for program in report["programs"].values():
        check_program(program, report["hbm_bytes"])
    step = report["programs"]["train_step"]
    # FSDP over 2 chips: each chip holds half of every fp32 parameter and its two AdamW moments (the step's
    # arguments: a third of them are parameters), gathers the other half of every layer's weights and sends its
    # share of their gradients; the data replicas all-reduce the gradient shards.
    half_of_the_params = step["argument_bytes"] / 3
    collectives = step["collective_bytes"]
    assert collectives["all-gather"] > 0.9 * half_of_the_params
    assert collectives["reduce-scatter"] + collectives["all-reduce"] > 0.9 * half_of_the_params
    assert collectives["all-reduce"] > 0
    # The scoring program runs with the optimizer state resident: its resident bytes exceed its own peak.
    scoring = report["programs"]["clause_scores"]
    assert scoring["resident_bytes"] > scoring["peak_bytes"]


@pytest.mark.slow
def test_grpo_programs_compile_for_a_v5e_slice():
    report = report_of(train(*TINY_GRPO, "--compile_for=v5e-4"))
    assert set(report["programs"]) == {f"{name}@32" for name in ("prefill", "decode", "prm", "reference", "update")}
    for program in report["programs"].values():
        check_program(program, report["hbm_bytes"])
    assert report["programs"]["update@32"]["calls_per_step"] == 2   # rl.update_epochs x rl.num_minibatches
    # The decode loop reads its arguments once per generated token: its HBM term counts them 7 times (8 - 1).
    decode = report["programs"]["decode@32"]
    hbm_s = (decode["argument_bytes"] * 7 + decode["output_bytes"]) / slices.CHIPS["v5e"].hbm_bytes_per_s
    assert decode["lower_bound_estimate"]["hbm_s"] == pytest.approx(hbm_s, rel=1e-3)


@pytest.mark.slow
def test_a_program_over_the_chips_hbm_is_refused_with_one_line():
    # 8,192 pairs of 2,048 tokens without remat: activations far beyond a v5e chip's 15.75 GiB.
    result = train(*TINY_PRM, "--config.data.batch_size=8192", "--config.data.max_len=2048",
                   "--config.data.bucket_lengths=(2048,)", "--compile_for=v5e-4")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0] == result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: v5e-4: (program train_step needs [\d.]+ GiB per chip|the TPU compiler refused)", lines[0])
    assert not result.stdout.strip().endswith("}") or '"fits": false' in result.stdout


def test_unknown_slices_and_missing_recipes_are_one_line():
    result = train("--config=configs/prm.py", "--compile_for=v5e-3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --compile_for='v5e-3': unknown TPU slice; known:")
    result = train("--config=configs/prm.py:pod=v5e-256", "--compile_for=v5e-256")
    assert result.returncode == 2 and "add model=qwen35_9b" in result.stderr.strip().splitlines()[-1]


def test_slices_map_cloud_names_to_topologies():
    assert slices.tpu_slice("v5p-64").topology_name == "v5p:2x4x4" and slices.tpu_slice("v5p-64").chips == 32
    assert slices.tpu_slice("v5e-256").chips == 256 and slices.tpu_slice("v6e-64").topology == "8x8"
    for name in slices.SLICE_NAMES:   # every table entry is a topology libtpu knows, with the right chip
        tpu = slices.tpu_slice(name)
        if tpu.chips <= 64:
            devices = slices.slice_devices(tpu)
            assert devices[0].device_kind == tpu.chip.kind and devices[0].platform == "tpu"


def test_the_target_decides_backend_dependent_choices():
    from caper_jax.models.config import on_cpu_unless

    assert on_cpu_unless(None) is True   # this process: the CPU
    with target.compiling_for(slices.slice_devices(slices.tpu_slice("v5e-4"))):
        assert on_cpu_unless(None) is False and target.platform() == "tpu" and len(target.devices()) == 4
        assert on_cpu_unless(True) is True
    assert target.devices() == jax.devices()


@pytest.mark.slow
def test_the_embedding_gradient_stays_sharded_where_data_is_split():
    """With data = 2 the table's gradient (a scatter-add) must stay [vocab, hidden / fsdp] on each chip: the lookup
    gathers no full [vocab, hidden] table and its backward builds none and all-reduces none. Gathering straight
    into the activations' layout (``jnp.take`` then the batch constraint, as before) fails this."""
    from caper_jax.prm import trainer
    from configs import prm

    config = prm.get_config()
    config.unlock()
    config.mesh_shape.update({"data": 2, "fsdp": 2})
    config.data.update(max_len=64, bucket_lengths=(64,), batch_size=4, within_batch_size=0)
    with target.compiling_for(slices.slice_devices(slices.tpu_slice("v5e-4"))):
        settings = trainer.validate(config)
        text = trainer.dry_run(settings)["compiled"].as_text()
    from caper_jax.models.presets import model_preset

    arch = model_preset("tiny")
    full = f"f32[{arch.vocab_size},{arch.hidden_size}]"
    module = hlo_collectives.parse(text)
    # The lookup's own collectives (op_name ``.../_take/gather`` forward, ``.../scatter-add`` backward). The old
    # lookup all-gathered the whole table for both and all-reduced its full gradient over all 4 chips. (The
    # compiler may still reduce every weight's gradient as an all-reduce over the fsdp pair, the table's among
    # them: that is FSDP's reduction, named by no op.)
    lookup = [inst.name for comp in module.computations.values() for inst in comp.instructions
              if inst.opcode in hlo_collectives.COLLECTIVE_OPCODES and "_take" in inst.attrs
              and full in re.sub(r"\{[^}]*\}", "", inst.shape)]
    assert lookup == []
    scatters = [b for b in hlo_collectives.largest_shapes(text, n=1000) if b.shape == full
                and any("scatter-add" in name for name in b.op_names)]
    assert scatters == []
