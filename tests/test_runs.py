"""caper_jax.runs: a saved run round-trips through load_run; a partial, corrupt or mismatched run is one
CheckpointError; convert hf-to-orbax writes a run that load_run reads and a trainer starts from; a run of
an older layout is refused with the command that converts it (caper_jax.upgrade_run), and converts.

References: the arrays that were saved (bit comparisons), and ``from_hf`` of the converted HF directory.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from caper_jax import checkpoint as ckpt_lib
from caper_jax import convert, runs, upgrade_run
from caper_jax.models import Qwen35ForCausalLM, from_hf
from caper_jax.models.presets import model_preset
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel.rules import DEFAULT_RULES
from caper_jax.prm.model import ClausePRM
from caper_jax.utils.errors import CheckpointError
from caper_jax.utils.optim import init_state, make_optimizer
from tests.helpers import build_hf_model, run_command

RULES = tuple(tuple(r) for r in DEFAULT_RULES)
VOCAB = 72   # not the tiny preset's: the record, not the preset, must give it


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})


def _sft_config():
    from configs.sft import get_config

    config = get_config()
    config.model.preset = "small"   # the record (tiny) wins over the config's preset
    return config


def _save_run(workdir, state, config, arch, *, step=4, tokenizer_dir=None):
    with ckpt_lib.Checkpointer(workdir / "checkpoints", async_save=False) as checkpointer:
        checkpointer.save(step, state, config=config.to_dict(), run=runs.record(arch, tokenizer_dir), force=True)
    return workdir


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """An SFT-layout run: a tiny policy after one real optimizer step (non-zero moments), with its record."""
    config = _sft_config()
    arch = model_preset("tiny", vocab_size=VOCAB, param_dtype="float32")
    model = Qwen35ForCausalLM(arch, rngs=nnx.Rngs(5))
    tx = make_optimizer(config.optim)
    state = init_state(nnx.state(model), tx)
    grads = jax.tree.map(lambda x: np.full(x.shape, 0.01, x.dtype), state.params)
    updates, opt_state = jax.jit(tx.update)(grads, state.opt_state, state.params)   # eager: ~10 s of op compiles
    state = state.replace(step=state.step + 1, opt_state=opt_state)
    root = tmp_path_factory.mktemp("runs")
    (root / "tok").mkdir()
    workdir = _save_run(root / "sft", state, config, arch, tokenizer_dir=root / "tok")
    return workdir, state, arch


def _assert_trees_equal(a, b):
    flat_a, flat_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b) and flat_a
    for x, y in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))


def test_a_saved_run_round_trips_params_and_full_state(sft_run, mesh):
    workdir, state, arch = sft_run
    run = runs.load_run(workdir, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, trainers=runs.POLICY_TRAINERS)
    assert run.step == 4 and run.trainer == "sft" and run.state is None
    assert run.model_config == arch and run.tokenizer_dir == workdir.parent / "tok"
    assert isinstance(run.model, Qwen35ForCausalLM) and run.model.config.vocab_size == VOCAB
    _assert_trees_equal(nnx.state(run.model), state.params)
    full = runs.load_run(workdir / "checkpoints", module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, what="state",
                         step=4)
    assert int(full.state.step) == 1
    _assert_trees_equal(full.state, state)
    # The run-time fields are the reader's; the architecture is the record's.
    bf16 = runs.load_run(workdir, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, dtype="bfloat16",
                         remat="full")
    assert bf16.model_config == arch.replace(dtype="bfloat16", remat="full")


def test_a_run_given_by_a_relative_path_loads(sft_run, mesh, monkeypatch):
    """The documented commands pass workdirs relative to the repo (runs/sft_demo); orbax wants absolute paths."""
    workdir, state, _ = sft_run
    monkeypatch.chdir(workdir.parent)
    run = runs.load_run(workdir.name, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES,
                        trainers=runs.POLICY_TRAINERS)
    _assert_trees_equal(nnx.state(run.model), state.params)
    full = runs.load_run(workdir.name, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, what="state")
    _assert_trees_equal(full.state, state)


def test_partial_corrupt_and_mismatched_runs_are_one_clear_error(sft_run, mesh, tmp_path):
    workdir, state, arch = sft_run

    def copy(name):
        shutil.copytree(workdir, tmp_path / name)
        return tmp_path / name, tmp_path / name / "checkpoints" / "4"

    partial, step_dir = copy("partial")
    (step_dir / ckpt_lib.MANIFEST).unlink()                      # as a save killed before its commit
    corrupt, step_dir = copy("corrupt")
    chunk = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    mismatched, step_dir = copy("mismatched")
    record = json.loads((step_dir / runs.RUN_ITEM / "metadata").read_text())
    record["model"]["hidden_size"] = 64
    (step_dir / runs.RUN_ITEM / "metadata").write_text(json.dumps(record))
    ckpt_lib.write_manifest(step_dir, 4)                          # a whole checkpoint, with a wrong record
    old_convert = tmp_path / "old_convert"
    (old_convert / "params").mkdir(parents=True)
    (old_convert / "config.json").write_text("{}")
    cases = [(partial, {}, "no whole checkpoint"),
             (corrupt, {}, "no whole checkpoint"),
             (mismatched, {}, "stored parameters do not fit"),
             (workdir, {"module": ClausePRM}, "stored parameters do not fit"),   # the caller's module, not the run's
             (workdir, {"trainers": ("prm",)}, "'sft' trainer, not Clause-PRM"),
             (workdir, {"step": 9}, "has no step 9"),
             (tmp_path / "absent", {}, "does not exist"),
             (old_convert, {}, "older `convert hf-to-orbax`")]
    for path, kwargs, message in cases:
        with pytest.raises(CheckpointError, match=message):
            runs.load_run(path, **{"module": Qwen35ForCausalLM, **kwargs}, mesh=mesh, rules=RULES)
    assert issubclass(CheckpointError, ValueError)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    build_hf_model("untied").save_pretrained(root / "hf")
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_command(convert, "hf-to-orbax", "--hf_dir", root / "hf", "--out", root / "orbax") == 0
    return root / "hf", root / "orbax"


def test_converted_hf_model_is_a_run(converted, mesh):
    hf_dir, out = converted
    run = runs.load_run(out, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, trainers=runs.POLICY_TRAINERS)
    reference, config = from_hf(hf_dir)
    assert run.trainer == runs.CONVERTED and run.model_config == config
    _assert_trees_equal(nnx.state(run.model), nnx.state(reference))
    with pytest.raises(CheckpointError, match="parameters only"):
        runs.load_run(out, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, what="state")


def test_a_trainer_starts_from_a_converted_model(converted, mesh):
    """PRM ``model.init_from`` and GRPO ``policy.sft_workdir`` accept the conversion as an SFT run."""
    from configs.grpo import get_config as grpo_config
    from configs.prm import get_config as prm_config

    from caper_jax.prm import trainer as prm_trainer
    from caper_jax.rl import trainer as rl_trainer

    hf_dir, out = converted
    reference, config = from_hf(hf_dir)
    prm = prm_config()
    prm.model.init_from = str(out)
    prm = prm_trainer.validate(prm)
    model = prm_trainer.build_model(prm, config.vocab_size, mesh, RULES)
    ours = dict(nnx.to_flat_state(nnx.state(model.backbone)))
    for path, value in nnx.to_flat_state(nnx.state(reference)):
        if path[0] != "lm_head":   # the PRM reads no vocabulary logits: an untied head is dropped
            np.testing.assert_array_equal(np.asarray(ours[path][...]), np.asarray(value[...]), err_msg=str(path))
    with pytest.raises(CheckpointError, match="a different tokenizer"):
        prm_trainer.check_init_from(prm, vocab_size=config.vocab_size + 1)
    grpo = grpo_config()
    grpo.policy.sft_workdir = str(out)
    policy = rl_trainer.load_policy(rl_trainer.validate(grpo), config.vocab_size, mesh, RULES)
    _assert_trees_equal(nnx.state(policy), nnx.state(reference))


def _rewrite(step_dir, item, edit):
    """Edits a JSON item of a saved step in place and re-seals it: a whole checkpoint with that content."""
    path = step_dir / item / "metadata"
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))
    ckpt_lib.write_manifest(step_dir, int(step_dir.name))


def _legacy_copy(workdir, dest):
    """A copy of the run as saved before the architecture record existed (no ``run`` item)."""
    shutil.copytree(workdir, dest)
    step_dir = dest / "checkpoints" / "4"
    shutil.rmtree(step_dir / runs.RUN_ITEM)
    ckpt_lib.write_manifest(step_dir, 4)
    return dest, step_dir


def test_prm_init_from_takes_a_padded_vocabulary(converted, mesh):
    """An HF config pads the vocabulary beyond the tokenizer's length (Qwen3.5: 248,320 rows); the
    PRM starts from such a conversion as GRPO and build_policy do (a smaller one: the test above)."""
    from configs.prm import get_config as prm_config

    from caper_jax.prm import trainer as prm_trainer

    _, out = converted
    config = runs.read_run(out).model_config
    prm = prm_config()
    prm.model.init_from = str(out)
    model = prm_trainer.build_model(prm_trainer.validate(prm), config.vocab_size - 8, mesh, RULES)
    assert model.config.vocab_size == config.vocab_size


def test_prm_init_from_a_recorded_run_ignores_its_stale_preset(sft_run, mesh, tmp_path):
    """The run's config names preset 'small' but its record is tiny: the record is what build_model
    builds, so the PRM's preset ('tiny') is not compared with the stale one. A run saved before the
    record is refused with the command that converts it."""
    from configs.prm import get_config as prm_config

    from caper_jax.prm import trainer as prm_trainer

    workdir, _, arch = sft_run
    prm = prm_config()
    prm.model.init_from = str(workdir)
    assert prm_trainer.build_model(prm_trainer.validate(prm), VOCAB, mesh, RULES).config.hidden_size == arch.hidden_size
    legacy, _ = _legacy_copy(workdir, tmp_path / "legacy")
    prm.model.init_from = str(legacy)
    with pytest.raises(CheckpointError, match=f"before the run record .* python -m caper_jax.upgrade_run {legacy}$"):
        prm_trainer.validate(prm)


def _upgrade(*workdirs):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = run_command(upgrade_run, *workdirs)
    return status, out.getvalue(), err.getvalue()


def _files(step_dir):
    return {p: p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}


def test_upgrade_records_a_run_saved_before_the_record(sft_run, mesh, tmp_path):
    """The old layout (no run item) made here from the saved run: refused unconverted; the upgrade derives the
    record from the config's preset and the stored embedding's rows (not the preset's vocabulary), finds the
    tokenizer of model.tokenizer_dir, re-seals the step, and the run then loads bit for bit. A second upgrade
    changes no byte."""
    workdir, state, arch = sft_run
    legacy, step_dir = _legacy_copy(workdir, tmp_path / "legacy")
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    _rewrite(step_dir, "config", lambda c: c["model"].update(preset="tiny", tokenizer_dir=str(tokenizer_dir)))
    with pytest.raises(CheckpointError, match="python -m caper_jax.upgrade_run"):
        runs.read_run(legacy)
    status, out, err = _upgrade(legacy)
    assert (status, err) == (0, "")
    assert out == f"{step_dir}: run record written (vocabulary {VOCAB}, tokenizer {tokenizer_dir})\n"
    assert ckpt_lib.verify(step_dir) is None
    run = runs.load_run(legacy, module=Qwen35ForCausalLM, mesh=mesh, rules=RULES, trainers=runs.POLICY_TRAINERS)
    assert run.model_config == arch and run.tokenizer_dir == tokenizer_dir
    _assert_trees_equal(nnx.state(run.model), state.params)
    sealed = _files(step_dir)
    assert _upgrade(legacy) == (0, f"{step_dir}: current layout, unchanged\n", "")
    assert _files(step_dir) == sealed


def test_upgrade_takes_the_architecture_of_the_hf_checkpoint_a_run_started_from(converted, tmp_path):
    hf_dir, out = converted
    legacy, step_dir = tmp_path / "legacy", tmp_path / "legacy" / "checkpoints" / "0"
    shutil.copytree(out, legacy)
    shutil.rmtree(step_dir / runs.RUN_ITEM)
    ckpt_lib.write_manifest(step_dir, 0)
    assert _upgrade(legacy)[0] == 0
    info, converted_record = runs.read_run(legacy), runs.read_run(out)
    assert info.model_config == converted_record.model_config == from_hf(hf_dir)[1]
    assert info.tokenizer_dir == converted_record.tokenizer_dir


def test_upgrade_finds_the_tokenizer_of_a_copied_workdir(sft_run, tmp_path):
    """A workdir copied to another machine: its record names a tokenizer directory that is not there, so
    tokenizer() names the upgrade, which points the record at the demo world's tokenizer the workdir holds."""
    workdir, _, arch = sft_run
    copied, step_dir = tmp_path / "copied", tmp_path / "copied" / "checkpoints" / "4"
    shutil.copytree(workdir, copied)
    _rewrite(step_dir, runs.RUN_ITEM, lambda record: record.update(tokenizer=str(tmp_path / "elsewhere")))
    _rewrite(step_dir, "config", lambda config: config["data"].update(kind="demo", dir=""))
    (copied / "demo_world" / "tokenizer").mkdir(parents=True)
    (copied / "demo_world" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"python -m caper_jax.upgrade_run {copied} finds"):
        runs.read_run(copied).tokenizer()
    assert _upgrade(copied)[0] == 0
    info = runs.read_run(copied)
    assert info.tokenizer_dir == copied / "demo_world" / "tokenizer" and info.model_config == arch
    assert ckpt_lib.verify(step_dir) is None


@pytest.mark.parametrize("preset", [None, "qwen35_0b"])
def test_a_legacy_run_without_a_known_preset_is_one_error_line(sft_run, tmp_path, preset):
    """None: the config has no model.preset at all. Nothing is written to the step."""
    workdir, _, _ = sft_run
    legacy, step_dir = _legacy_copy(workdir, tmp_path / "legacy")
    edit = (lambda config: config["model"].pop("preset")) if preset is None else (
        lambda config: config["model"].update(preset=preset))
    _rewrite(step_dir, "config", edit)
    before = _files(step_dir)
    status, out, err = _upgrade(legacy)
    assert (status, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1
    assert f"names no known model.preset ({preset!r}" in err
    assert _files(step_dir) == before


def test_every_recorded_list_comes_back_a_tuple(sft_run, tmp_path, monkeypatch):
    """A sequence field the config may gain stays hashable after the JSON round trip (graphdef, jit keys)."""
    import dataclasses

    from caper_jax.models.config import Qwen35Config

    @dataclasses.dataclass(frozen=True)
    class FutureConfig(Qwen35Config):
        future_ids: tuple[int, ...] = ()

    workdir, _, _ = sft_run
    shutil.copytree(workdir, tmp_path / "future")
    _rewrite(tmp_path / "future" / "checkpoints" / "4", runs.RUN_ITEM,
             lambda record: record["model"].update(future_ids=[3, 5]))
    monkeypatch.setattr(runs, "Qwen35Config", FutureConfig)
    model_config = runs.read_run(tmp_path / "future").model_config
    assert model_config.future_ids == (3, 5) and hash(model_config)
