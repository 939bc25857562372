"""Checkpoints: exact resume after SIGKILL, sharded restore, fallback past damaged checkpoints (set aside,
then saved over), 2 hosts.

Run as a script this file is a child process of the tests below:
``python -m tests.test_checkpoint train WORKDIR STEPS`` is a tiny optax training loop over the real
PRM pipeline on 4 simulated CPU devices, checkpointing every few steps;
``python -m tests.test_checkpoint host WORKDIR PORT PROCESS_ID`` is one of two jax.distributed
processes (2 CPU devices each) that assemble global batches and checkpoint together.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a child process: simulated CPU devices, set before jax is imported
    from tests.helpers import xla_flags

    os.environ["XLA_FLAGS"] = xla_flags(2 if sys.argv[1] == "host" else 4)

import functools
import json
import logging
import shutil
import subprocess
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from caper_jax import checkpoint as ck

REPO = Path(__file__).resolve().parents[1]
CHILD_EVERY = 4  # checkpoint interval of the child loop
CHILD_STEPS = 14


DATA_RULES = (("batch", "data"),)  # the batch axis over the single mesh axis of these tests

# ---------------------------------------------------------------------------------------------
# The child: train a bag-of-embeddings scorer with a margin-weighted Bradley-Terry loss.


def child_main(workdir: Path, steps: int) -> None:
    from caper_jax.data.prm_training_batches import prm_pipeline
    from caper_jax.parallel.multihost import host_local_to_global
    from tests.helpers import make_tokenizer, make_tuples, prompt_fn

    tokenizer = make_tokenizer()
    pipeline = prm_pipeline(make_tuples(30), tokenizer, global_batch_size=8, max_len=192,
                            bucket_lengths=(128, 192), seed=1, num_epochs=None, prompt_fn=prompt_fn)
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    vocab = 4 * (len(tokenizer) // 4 + 1)
    embed_sharding = NamedSharding(mesh, P("data", None))  # rows of the table live on different devices

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"embed": jax.random.normal(k1, (vocab, 16)) * 0.1, "head": jax.random.normal(k2, (16,)) * 0.1}
        return {"params": params, "opt": optimizer.init(params), "step": jnp.int32(0)}

    optimizer = optax.adamw(3e-2)
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), jax.eval_shape(init, jax.random.key(0)))
    shardings["params"]["embed"] = embed_sharding
    init = jax.jit(init, out_shardings=shardings)

    def score(params, ids, mask, pos):
        visible = mask * (jnp.arange(ids.shape[1]) <= pos[:, None])
        h = jnp.tanh(params["embed"][ids])
        pooled = (h * visible[..., None]).sum(1) / visible.sum(1, keepdims=True)
        return pooled @ params["head"]

    def loss_fn(params, batch):
        chosen = score(params, batch["chosen_ids"], batch["chosen_mask"], batch["chosen_pos"])
        rejected = score(params, batch["rejected_ids"], batch["rejected_mask"], batch["rejected_pos"])
        per_row = -batch["margin"] * jax.nn.log_sigmoid(chosen - rejected)
        return (per_row * batch["weight"]).sum() / batch["weight"].sum()

    @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=0)
    def train_step(state, batch):
        grads = jax.grad(loss_fn)(state["params"], batch)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}

    iterator = pipeline.iterator()
    ckpt = ck.Checkpointer(workdir / "ckpt", max_to_keep=2, save_interval_steps=CHILD_EVERY)
    abstract = jax.eval_shape(init, jax.random.key(0))
    restored = ckpt.restore_latest(abstract, data_iterator=iterator)
    if restored is None:
        state = init(jax.random.key(0))
    else:
        state = restored.state
        assert restored.config == {"lr": 3e-2, "steps": steps}
        embed = state["params"]["embed"]
        assert embed.sharding == embed_sharding and len({s.device for s in embed.addressable_shards}) == 4
        assert embed.addressable_shards[0].data.shape == (vocab // 4, 16)
        print(f"restored {restored.step}", flush=True)
    for step in range(int(state["step"]), steps):
        batch = host_local_to_global(next(iterator), mesh, DATA_RULES)
        state = train_step(state, batch)
        ckpt.save(step + 1, state, data_iterator=iterator, config={"lr": 3e-2, "steps": steps})
        print(f"step {step + 1}", flush=True)
    ckpt.close()
    np.savez(workdir / "final.npz", **{k: np.asarray(v) for k, v in state["params"].items()})


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> Path:
    """A compilation cache shared by every child of this module (the test session's, tests/conftest.py,
    when there is one): only the first run pays for XLA."""
    return Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path_factory.mktemp("xla_cache"))


def child_env(cache: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def start_child(workdir: Path, steps: int, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.test_checkpoint", "train", str(workdir), str(steps)],
                            cwd=REPO, env=child_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_child(proc: subprocess.Popen, kill_after: int | None = None) -> list[str]:
    """Collects the child's step lines; with kill_after, SIGKILLs it as soon as it reports that step."""
    lines = []
    for line in proc.stdout:
        if line.startswith(("step", "restored")):  # the tokenizer trainer prints blank lines
            lines.append(line.strip())
        if kill_after is not None and line.strip() == f"step {kill_after}":
            proc.kill()  # SIGKILL: no cleanup, an async save may be half written
            break
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == (-9 if kill_after is not None else 0), stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory, xla_cache) -> tuple[list[str], Path]:
    """One uninterrupted run of the child loop (its step lines, its final params): the reference of both
    resume tests below, which run the same loop from the same seed."""
    workdir = tmp_path_factory.mktemp("ref")
    lines = finish_child(start_child(workdir, CHILD_STEPS, xla_cache))
    assert lines[-1] == f"step {CHILD_STEPS}" and not any(l.startswith("restored") for l in lines)
    return lines, workdir / "final.npz"


@pytest.mark.slow   # three child trainings; resume from a checkpoint is checked in-process below (fast loop)
def test_sigkill_and_resume_gives_bit_identical_params(tmp_path, reference, xla_cache):
    finish_child(start_child(tmp_path / "run", CHILD_STEPS, xla_cache), kill_after=2 * CHILD_EVERY)  # save in flight
    resumed = finish_child(start_child(tmp_path / "run", CHILD_STEPS, xla_cache))
    restored_step = int(resumed[0].split()[1])
    assert restored_step in (4, 8)  # 8, or 4 if the kill came before step 8 committed
    assert resumed[1] == f"step {restored_step + 1}" and resumed[-1] == f"step {CHILD_STEPS}"

    ref, got = np.load(reference[1]), np.load(tmp_path / "run" / "final.npz")
    assert ref.files == got.files
    for name in ref.files:
        np.testing.assert_array_equal(got[name], ref[name])


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints, in process.


def _state(scale: float) -> dict:
    return {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) * scale, "b": jnp.ones(7) * scale,
            "step": jnp.int32(int(scale))}


@pytest.fixture
def three_checkpoints(tmp_path):
    """Steps 1, 2, 3 with distinct states; the data iterator advanced once per step."""
    iterator = iter(grain.MapDataset.range(100).seed(0).shuffle().to_iter_dataset())
    with ck.Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            next(iterator)
            ckpt.save(step, _state(step), data_iterator=iterator, config={"step": step})
    return tmp_path


def _restore(directory, caplog):
    iterator = iter(grain.MapDataset.range(100).seed(0).shuffle().to_iter_dataset())
    with caplog.at_level(logging.WARNING, logger="caper_jax.checkpoint"):
        with ck.Checkpointer(directory) as ckpt:
            restored = ckpt.restore_latest(ck.abstract_state(_state(0)), data_iterator=iterator)
    return restored, iterator


def _largest_array_file(step_dir: Path) -> Path:
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


def test_restore_latest_restores_state_iterator_and_config(three_checkpoints, caplog):
    restored, iterator = _restore(three_checkpoints, caplog)
    assert restored.step == 3 and restored.config == {"step": 3}
    for key, value in _state(3).items():
        np.testing.assert_array_equal(restored.state[key], value)
    expected = iter(grain.MapDataset.range(100).seed(0).shuffle().to_iter_dataset())
    for _ in range(3):
        next(expected)
    assert [next(iterator) for _ in range(5)] == [next(expected) for _ in range(5)]
    assert not caplog.records


def _flip_bytes(step_dir: Path) -> None:
    path = _largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: orbax itself restores this silently (wrong value)
    path.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    path = _largest_array_file(step_dir)
    path.write_bytes(path.read_bytes()[:-10])


def _garble_iterator_json(step_dir: Path) -> None:
    (step_dir / "data" / "process_0-of-1.json").write_text('{"next_ind')


@pytest.mark.parametrize("damage, reason", [
    (_flip_bytes, "fails its CRC32"),
    (_truncate, "truncated"),
    (_garble_iterator_json, "data/process_0-of-1.json"),
    (lambda d: shutil.rmtree(d / "data"), "item 'data' missing"),
    (lambda d: (d / "state" / "_METADATA").unlink(), "state/_METADATA missing"),
    (lambda d: (d / ck.MANIFEST).unlink(), "no caper_manifest.json"),
    (lambda d: (d / ck.MANIFEST).write_text("{"), "unreadable caper_manifest.json"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(three_checkpoints, caplog, damage, reason):
    damage(three_checkpoints / "3")
    restored, _ = _restore(three_checkpoints, caplog)
    assert restored.step == 2 and restored.config == {"step": 2}
    np.testing.assert_array_equal(restored.state["w"], _state(2)["w"])
    (warning,) = caplog.records
    assert "/3 is unusable" in warning.getMessage() and reason in warning.getMessage()


def test_interrupted_write_is_ignored_and_all_damaged_means_fresh_start(three_checkpoints, caplog):
    # What a SIGKILL mid-save leaves: a staged directory that was never renamed to its step.
    shutil.copytree(three_checkpoints / "3", three_checkpoints / "4.orbax-checkpoint-tmp-123")
    (three_checkpoints / "4.orbax-checkpoint-tmp-123" / ck.MANIFEST).unlink()
    restored, _ = _restore(three_checkpoints, caplog)
    assert restored.step == 3
    assert "discarding interrupted checkpoint write" in caplog.records[0].getMessage()
    assert not (three_checkpoints / "4.orbax-checkpoint-tmp-123").exists()
    for step in (1, 2, 3):
        _flip_bytes(three_checkpoints / str(step))
    caplog.clear()
    restored, _ = _restore(three_checkpoints, caplog)
    assert restored is None and len(caplog.records) == 3


def _half_written(step_dir: Path) -> None:
    # What an interrupted copy (or a save on a filesystem without atomic rename) leaves under the
    # step's final name: part of the item files and no manifest.
    (step_dir / ck.MANIFEST).unlink()
    shutil.rmtree(step_dir / "data")
    _largest_array_file(step_dir).unlink()


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "truncated"),
    (lambda d: (d / ck.MANIFEST).unlink(), "no caper_manifest.json"),
    (lambda d: (d / "state" / "_METADATA").unlink(), "state/_METADATA missing"),
    (_half_written, "no caper_manifest.json"),
])
def test_resume_sets_a_damaged_step_aside_and_saves_over_it(three_checkpoints, caplog, damage, reason):
    """The resumed run reaches the damaged step again: saving it must work (it raised
    StepAlreadyExistsError at that step, every time), and the damaged files must survive."""
    damage(three_checkpoints / "3")
    damaged = _files(three_checkpoints / "3")
    iterator = iter(grain.MapDataset.range(100).seed(0).shuffle().to_iter_dataset())
    with caplog.at_level(logging.WARNING, logger="caper_jax.checkpoint"):
        with ck.Checkpointer(three_checkpoints, max_to_keep=5) as ckpt:
            restored = ckpt.restore_latest(ck.abstract_state(_state(0)), data_iterator=iterator)
            assert restored.step == 2 and ckpt.all_steps() == [1, 2]
            next(iterator)
            ckpt.save(3, _state(30), data_iterator=iterator, config={"step": 30})
            ckpt.wait()
            assert ckpt.all_steps() == [1, 2, 3] and ckpt.verify(3) is None
    (aside,) = three_checkpoints.glob("3.corrupt-*")
    assert _files(aside) == damaged                     # set aside byte for byte, never deleted
    (warning,) = caplog.records
    assert reason in warning.getMessage() and f"set aside as {aside.name}" in warning.getMessage()
    caplog.clear()
    restored, _ = _restore(three_checkpoints, caplog)    # the new step 3 is the newest whole checkpoint
    assert restored.step == 3 and restored.config == {"step": 30} and not caplog.records
    np.testing.assert_array_equal(restored.state["w"], _state(30)["w"])
    assert aside.is_dir()                               # and retention never removes the set-aside copy


def test_a_deleted_orbax_step_metadata_file_alone_is_no_damage(three_checkpoints, caplog):
    (three_checkpoints / "3" / "_CHECKPOINT_METADATA").unlink()   # orbax's own file: not an item, not checksummed
    restored, _ = _restore(three_checkpoints, caplog)
    assert restored.step == 3 and not list(three_checkpoints.glob("*.corrupt-*"))
    np.testing.assert_array_equal(restored.state["w"], _state(3)["w"])


def test_every_step_damaged_means_a_fresh_start_that_can_save_them_all_again(three_checkpoints, caplog):
    for step in (1, 2, 3):
        _truncate(three_checkpoints / str(step))
    with caplog.at_level(logging.WARNING, logger="caper_jax.checkpoint"):
        with ck.Checkpointer(three_checkpoints, max_to_keep=5) as ckpt:
            assert ckpt.restore_latest(ck.abstract_state(_state(0))) is None
            for step in (1, 2, 3):
                ckpt.save(step, _state(step + 10))
            ckpt.wait()
            assert ckpt.all_steps() == [1, 2, 3]
    assert len(caplog.records) == 3 and len(list(three_checkpoints.glob("*.corrupt-*"))) == 3


@pytest.mark.slow   # three child trainings; the fallback itself is checked in-process above (fast loop)
def test_training_resumed_past_a_damaged_checkpoint_finishes_like_an_uninterrupted_run(tmp_path, reference, xla_cache):
    """End to end: the child loop saves 8 and 12 (keeping 2); step 12 is truncated; the rerun
    falls back to 8, saves 12 again over the set-aside copy and ends with the reference's params."""
    finish_child(start_child(tmp_path / "run", CHILD_STEPS, xla_cache))
    ckpt_dir = tmp_path / "run" / "ckpt"
    assert sorted(int(p.name) for p in ckpt_dir.iterdir()) == [8, 12]
    _truncate(ckpt_dir / "12")
    resumed = finish_child(start_child(tmp_path / "run", CHILD_STEPS, xla_cache))
    assert resumed[0] == "restored 8" and resumed[-1] == reference[0][-1] == f"step {CHILD_STEPS}"
    assert len(list(ckpt_dir.glob("12.corrupt-*"))) == 1
    with ck.Checkpointer(ckpt_dir) as ckpt:
        assert ckpt.verify(12) is None
    ref, got = np.load(reference[1]), np.load(tmp_path / "run" / "final.npz")
    for name in ref.files:
        np.testing.assert_array_equal(got[name], ref[name])


def test_a_verified_checkpoint_that_does_not_fit_raises(three_checkpoints):
    with ck.Checkpointer(three_checkpoints) as ckpt:
        wrong = ck.abstract_state(_state(0) | {"w": jnp.zeros((32, 64))})
        with pytest.raises(Exception, match="shape"):
            ckpt.restore_latest(wrong)
        with pytest.raises(ck.CheckpointError, match="no data iterator state"):
            ckpt.save(9, _state(9), force=True)
            ckpt.wait()
            ckpt.restore(9, ck.abstract_state(_state(0)),
                         data_iterator=iter(grain.MapDataset.range(3).to_iter_dataset()))


def test_a_checkpoint_of_another_model_is_one_checkpoint_error_before_any_read(three_checkpoints, capfd):
    """Resuming a workdir with another model config raised orbax's ValueError from the middle of its
    reads, with ~130 "Event loop is closed" tracebacks from the reads still pending."""
    with ck.Checkpointer(three_checkpoints) as ckpt:
        wrong = ck.abstract_state(_state(0) | {"w": jnp.zeros((32, 64))})
        with pytest.raises(ck.CheckpointError, match=r"does not fit this run's state .*\(64, 64\).*\(32, 64\)"):
            ckpt.restore_latest(wrong)
    assert "Traceback" not in capfd.readouterr().err


def test_nnx_model_and_optimizer_state_round_trip(tmp_path):
    from flax import nnx

    def build(seed):
        model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    model, optimizer = build(0)
    grads = nnx.grad(lambda m: (m(jnp.ones((2, 3))) ** 2).sum())(model)
    optimizer.update(model, grads)  # non-trivial moments and count
    with ck.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, nnx.state((model, optimizer)))
    with ck.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore_latest(nnx.state(nnx.eval_shape(lambda: build(1))))
    fresh = build(1)
    nnx.update(fresh, restored.state)
    expected, got = jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(nnx.state(fresh))
    assert len(expected) == len(got) > 4
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


def test_save_interval_and_max_to_keep(tmp_path):
    with ck.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=3) as ckpt:
        saved = [step for step in range(1, 11) if ckpt.save(step, _state(step))]
        ckpt.wait()
        # Orbax also saves the first step it sees when the directory holds none (a baseline).
        assert saved == [1, 3, 6, 9] and ckpt.all_steps() == [6, 9]
        assert all(ckpt.verify(step) is None for step in (6, 9))
    manifest = json.loads((tmp_path / "9" / ck.MANIFEST).read_text())
    assert manifest["step"] == 9 and manifest["items"] == ["state"]
    on_disk = {str(p.relative_to(tmp_path / "9")) for p in (tmp_path / "9" / "state").rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk


# ---------------------------------------------------------------------------------------------
# Two jax.distributed processes on one machine.

HOST_GLOBAL_BATCH = 8


def host_main(workdir: Path, port: int, process_id: int) -> None:
    from jax.experimental import multihost_utils

    from caper_jax.data.prm_training_batches import prm_pipeline
    from caper_jax.parallel.multihost import host_local_to_global
    from tests.helpers import make_tokenizer, make_tuples, prompt_fn

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    pipeline = prm_pipeline(make_tuples(20), make_tokenizer(), global_batch_size=HOST_GLOBAL_BATCH,
                            max_len=192, bucket_lengths=(192,), seed=5, prompt_fn=prompt_fn,
                            process_index=jax.process_index(), process_count=jax.process_count())
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    iterator = pipeline.iterator(num_threads=1)
    batch = host_local_to_global(next(iterator), mesh, DATA_RULES)
    # Fully replicated copies of the global arrays: every process can read the whole batch.
    whole = jax.jit(lambda b: b, out_shardings=NamedSharding(mesh, P()))(batch)
    np.savez(workdir / f"batch_{process_id}.npz", **{k: np.asarray(v) for k, v in whole.items()})

    state = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data")))}
    ckpt = ck.Checkpointer(workdir / "ckpt")
    for step in (1, 2):
        next(iterator)
        ckpt.save(step, jax.tree.map(lambda x: x * step, state), data_iterator=iterator, config={"hosts": 2})
    ckpt.wait()
    multihost_utils.sync_global_devices("saved")
    if process_id == 0:  # damage step 2: both processes must agree to fall back to step 1
        path = max((workdir / "ckpt" / "2" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    multihost_utils.sync_global_devices("damaged")
    fresh = pipeline.iterator(num_threads=1)
    restored = ckpt.restore_latest(ck.abstract_state(state), data_iterator=fresh)
    ckpt.close()
    w = multihost_utils.process_allgather(restored.state["w"], tiled=True)
    print(json.dumps({"step": restored.step, "w": np.asarray(w).tolist(), "config": restored.config,
                      "iterator": fresh.get_state()}), flush=True)


@pytest.mark.slow   # two processes joined by jax.distributed; test_sharding's two-process batch is the fast check
def test_two_processes_stitch_batches_and_share_checkpoints(tmp_path, xla_cache):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_checkpoint", "host", str(tmp_path), str(port), str(i)],
                              cwd=REPO, env=child_env(xla_cache), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    reports = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]

    from caper_jax.data.prm_training_batches import prm_pipeline
    from tests.helpers import make_tokenizer, make_tuples, prompt_fn

    single = prm_pipeline(make_tuples(20), make_tokenizer(), global_batch_size=HOST_GLOBAL_BATCH, max_len=192,
                          bucket_lengths=(192,), seed=5, prompt_fn=prompt_fn)
    expected = single.dataset[0]
    for i in range(2):
        got = np.load(tmp_path / f"batch_{i}.npz")
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    for report in reports:  # step 2 damaged on disk: both fell back to step 1, with its data position
        assert report["step"] == 1 and report["config"] == {"hosts": 2}
        assert report["w"] == np.arange(64, dtype=np.float32).reshape(8, 8).tolist()
        assert report["iterator"] == {"next_index": 2}
    manifest = json.loads((tmp_path / "ckpt" / "1" / ck.MANIFEST).read_text())
    assert {"data/process_0-of-2.json", "data/process_1-of-2.json"} <= set(manifest["files"])


if __name__ == "__main__":
    if sys.argv[1] == "train":
        child_main(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        host_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
