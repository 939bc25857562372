"""Checkpoints: orbax CheckpointManager plus an integrity manifest, so resume takes the newest WHOLE one.

One checkpoint = one orbax step directory with up to four items saved together (atomically):

* ``state``  - the train state pytree (params, optimizer state, step; plain pytree or ``nnx.State``),
  written by ``StandardSave`` (OCDBT/zarr, every process writes its own shards);
* ``data``   - the Grain iterator position (``grain.checkpoint.CheckpointSave``, one JSON per process);
* ``config`` - the run's config as JSON;
* ``run``    - what the run is (``caper_jax.runs.record``: the resolved model architecture and the
  tokenizer directory), read back by ``caper_jax.runs.load_run``.

Orbax already makes a save atomic (it writes ``<step>.orbax-checkpoint-tmp`` and renames it when
every process has committed), so an interrupted write is never listed as a step. What orbax does
not catch is a finished checkpoint damaged later: array chunks are not checksummed, so a flipped
byte restores silently as a wrong number (measured: see docs/pipeline.md). Hence the manifest:
just before orbax's final rename, process 0 records size and CRC32 of every item file in
``caper_manifest.json`` inside the step directory, so the manifest is part of the atomic commit.
``restore_latest`` walks the steps from newest to oldest and restores the first one whose files
all match, logging why each newer one was skipped. A checkpoint that verifies but does not fit
the requested state (wrong shapes, missing item) is a user error and raises instead.

A skipped (damaged) step is set aside, never deleted: its directory is renamed
``<step>.corrupt-<UTC time>`` (orbax lists only integer names, so it is no longer a step and no
retention rule removes it) and the warning names it. The resumed run then saves that step again
instead of failing on ``StepAlreadyExistsError`` when it gets there, and the damaged files stay on
disk for inspection (delete them by hand when done).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from caper_jax.utils.errors import CheckpointError

MANIFEST = "caper_manifest.json"
MANIFEST_FORMAT = 1
_TMP_MARKER = ".orbax-checkpoint-tmp"
CORRUPT_MARKER = ".corrupt-"
RUN_ITEM = "run"            # the item holding ``caper_jax.runs.record``
_CHUNK = 16 << 20

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    config: dict[str, Any] | None


def abstract_state(tree: Any) -> Any:
    """ShapeDtypeStructs (with each leaf's sharding) of a pytree of arrays: a restore target.

    For a state too large to build, use ``jax.eval_shape`` of the jitted, ``out_shardings``-annotated
    init instead: orbax then reads each shard straight onto its devices.
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _item_files(step_dir: Path) -> list[Path]:
    # Top-level files are orbax's own commit markers, rewritten after the manifest; items are dirs.
    return sorted(p for item in step_dir.iterdir() if item.is_dir() for p in item.rglob("*") if p.is_file())


def write_manifest(step_dir: Path, step: int) -> None:
    files = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in _item_files(step_dir)}
    items = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
    manifest = {"format": MANIFEST_FORMAT, "step": step, "items": items, "files": files}
    (step_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))


def verify(step_dir: Path) -> str | None:
    """None if every file the manifest lists is present with its size and CRC32; else the problem."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
        items = manifest["items"]
    except FileNotFoundError:
        return f"no {MANIFEST} (not written by this Checkpointer, or interrupted)"
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST}: {error}"
    for item in items:
        if not (step_dir / item).is_dir():
            return f"item {item!r} missing"
    for name, (size, crc) in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"file {name} missing"
        if path.stat().st_size != size:
            return f"file {name} has {path.stat().st_size} bytes, expected {size} (truncated?)"
        if _crc32(path) != crc:
            return f"file {name} fails its CRC32 (corrupted)"
    return None


# -- reading one saved step outside a Checkpointer (caper_jax.runs: a run read by another program)


def read_json_item(step_dir: Path, item: str) -> dict[str, Any] | None:
    """A JSON item (``config``, ``run``) of a saved step as orbax's ``JsonSave`` wrote it; None if absent."""
    path = step_dir / item / "metadata"
    return json.loads(path.read_text()) if path.is_file() else None


def stored_state_tree(step_dir: Path) -> Any:
    """The ``state`` item's tree of array metadata (each leaf has ``.shape``); no array is read."""
    # The item's handler, not a Checkpointer: a Checkpointer looks for step-level metadata inside
    # the item directory and logs a warning when it (rightly) is not there.
    metadata = ocp.PyTreeCheckpointHandler().metadata(step_dir / "state")
    return getattr(metadata, "tree", metadata)


def restore_state_item(step_dir: Path, abstract: Any, *, partial: bool = False) -> Any:
    """The ``state`` item of one step, read onto the shardings carried by ``abstract`` (a tree of
    ``jax.ShapeDtypeStruct``). ``partial``: only the subtrees ``abstract`` names are read (``{"params":
    ...}``: inference never reads the optimizer moments, twice the parameters' size). A stored tree that
    does not fit ``abstract`` raises a ``ValueError``; the caller names what did not fit."""
    if partial:
        handler = ocp.PyTreeCheckpointHandler()
        args = ocp.args.PyTreeRestore(item=abstract, partial_restore=True,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
    else:
        handler = ocp.StandardCheckpointHandler()
        args = ocp.args.StandardRestore(abstract)
    try:
        restored = handler.restore(step_dir / "state", args=args)
    finally:
        handler.close()
    if partial:
        # A partial restore hands back, unread and without a word, every requested array the step does
        # not hold (measured: a ClausePRM target on a causal LM's step came back all ShapeDtypeStructs).
        unread = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
                  if isinstance(leaf, jax.ShapeDtypeStruct)]
        if unread:
            raise ValueError(f"{len(unread)} requested arrays are not in the checkpoint (first: {unread[:3]})")
    return restored


def _jsonable(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
        config = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, ConfigDict or dataclass, got {type(config).__name__}")
    return json.loads(json.dumps(dict(config)))  # fail now, not in the background writer


def _shape_counts(tree: Any) -> collections.Counter:
    """Shapes of the tree's arrays, scalars left out (a Python scalar leaf has no shape to compare)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return collections.Counter(tuple(leaf.shape) for leaf in leaves if getattr(leaf, "shape", ()))


def _check_shapes(step_dir: Path, abstract: Any) -> None:
    """A CheckpointError when the stored state's array shapes are not the requested ones (as a
    multiset: whatever the tree's naming, a restore that fits maps each array onto one of the same
    shape). Checked from the metadata, before orbax starts its reads: a restore that fails midway
    leaves its pending reads printing tracebacks from closed event loops."""
    try:
        metadata = ocp.StandardCheckpointHandler().metadata(step_dir / "state")
    except Exception:  # noqa: BLE001 - no readable metadata: the restore itself reports it
        return
    stored, wanted = _shape_counts(getattr(metadata, "tree", metadata)), _shape_counts(abstract)
    if stored != wanted:
        only_stored, only_wanted = sorted((stored - wanted).elements()), sorted((wanted - stored).elements())
        raise CheckpointError(
            f"checkpoint {step_dir} does not fit this run's state (was the workdir written with another model "
            f"or optimizer config?): stored arrays of shapes {only_stored[:3]} where this run has "
            f"{only_wanted[:3]} ({sum(stored.values())} stored arrays, {sum(wanted.values())} here)")


class Checkpointer:
    """Saves (state, data iterator, config) every ``save_interval_steps``; restores the newest whole one.

    Call ``save`` on every process every step (orbax decides and coordinates); it returns whether a
    checkpoint was started. With ``async_save`` the device-to-host copy blocks, the write does not.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._async = async_save
        self._in_flight: int | None = None
        if self.directory.is_dir():
            for tmp in self.directory.glob(f"*{_TMP_MARKER}*"):
                _log.warning("discarding interrupted checkpoint write %s", tmp)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # -- saving

    def save(self, step: int, state: Any, *, data_iterator: grain.DatasetIterator | None = None,
             config: Any = None, run: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        if not force and not self._manager.should_save(step):
            return False
        # Orbax runs one save at a time anyway; waiting here tells _seal which step it seals.
        self._manager.wait_until_finished()
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        if config is not None:
            items["config"] = ocp.args.JsonSave(_jsonable(config))
        if run is not None:
            items[RUN_ITEM] = ocp.args.JsonSave(_jsonable(run))
        self._in_flight = step
        started = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        if not self._async:
            self.wait()
        return started

    def _seal(self) -> None:
        """Runs in orbax's commit thread after all items are written, before the final rename."""
        if jax.process_index() != 0:
            return
        step = self._in_flight
        staged = sorted(self.directory.glob(f"{step}{_TMP_MARKER}*"))
        step_dir = staged[-1] if staged else self.directory / str(step)  # commit-file filesystems (GCS)
        write_manifest(step_dir, step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    # -- restoring

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def verify(self, step: int) -> str | None:
        return verify(self.directory / str(step))

    def restore_latest(self, abstract: Any, *, data_iterator: grain.DatasetIterator | None = None
                       ) -> Restored | None:
        """Restores the newest checkpoint that verifies, or returns None if there is none.

        ``abstract`` is the state's tree of ``jax.ShapeDtypeStruct`` with target shardings; the
        iterator, if given, is set to the saved position in place.
        """
        self.wait()
        chosen = -1
        set_aside = 0
        if jax.process_index() == 0:  # one reader checks; every process then restores the same step
            for step in reversed(self.all_steps()):
                problem = self.verify(step)
                if problem is None:
                    chosen = step
                    break
                moved = self._set_aside(step)
                set_aside += 1
                _log.warning("checkpoint %s/%d is unusable: %s; set aside as %s; trying an older one",
                             self.directory, step, problem, moved.name)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # only multi-host runs reach it

            # Process 0 renamed before it broadcasts, so every process reloads after the renames.
            chosen, set_aside = (int(v) for v in multihost_utils.broadcast_one_to_all(
                np.asarray([chosen, set_aside], np.int32)))
        if set_aside:
            self._manager.reload()   # the set-aside steps are gone from orbax's list: they can be saved again
        if chosen < 0:
            _log.info("no usable checkpoint in %s; starting fresh", self.directory)
            return None
        return self.restore(chosen, abstract, data_iterator=data_iterator)

    def _set_aside(self, step: int) -> Path:
        """Renames a damaged step directory to ``<step>.corrupt-<UTC time>`` (never deletes it)."""
        source = self.directory / str(step)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.directory / f"{step}{CORRUPT_MARKER}{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{CORRUPT_MARKER}{stamp}-{n}"
        os.rename(source, target)
        return target

    def restore(self, step: int, abstract: Any, *, data_iterator: grain.DatasetIterator | None = None
                ) -> Restored:
        """Restores one step (no verification; restore_latest verifies)."""
        step_dir = self.directory / str(step)
        items = {"state": ocp.args.StandardRestore(abstract)}
        if data_iterator is not None:
            if not (step_dir / "data").is_dir():
                raise CheckpointError(f"checkpoint {step_dir} holds no data iterator state")
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        if (step_dir / "config").is_dir():
            items["config"] = ocp.args.JsonRestore()
        _check_shapes(step_dir, abstract)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except ValueError as error:   # shapes/structure: a workdir written with another model or optimizer
            raise CheckpointError(f"checkpoint {step_dir} does not fit this run's state (was the workdir written "
                                  f"with another model or optimizer config?): {error}") from error
        _log.info("restored checkpoint %s", step_dir)
        return Restored(step, restored["state"], restored["config"] if "config" in items else None)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
