"""Inference-side loading of trainer workdirs: newest whole checkpoint, its config, params only.

A trainer workdir (PRM, SFT, GRPO) holds ``checkpoints/<step>/{state,data,config}`` written by
``caper_jax.checkpoint.Checkpointer``. For inference only the parameters matter: the optimizer
moments are twice their size, so they are not restored at all — orbax reads the ``params`` subtree
(partial restore) straight onto the target shardings. The checkpoint is chosen the way training
resumes: the newest step whose integrity manifest verifies (``caper_jax.checkpoint.verify``); a
damaged newer step is skipped with a warning.

The tokenizer of a workdir is the one the trainer used (``caper_jax.data.world.prepare_world``):
``model.tokenizer_dir`` if set; for the demo world ``<data.dir or workdir/demo_world>/tokenizer``;
else ``model.hf_dir``.
"""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import orbax.checkpoint as ocp
from flax import nnx

from caper_jax import checkpoint as ckpt_lib

log = logging.getLogger(__name__)


class WorkdirError(ValueError):
    """A path is not a usable trainer workdir or HF export."""


def checkpoints_dir(path: str | pathlib.Path) -> pathlib.Path:
    """``<workdir>/checkpoints`` for a workdir, or the path itself if it already is one."""
    path = pathlib.Path(path)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path
    raise WorkdirError(f"{path} is neither a trainer workdir (no checkpoints/) nor a checkpoints directory")


def latest_whole_step(ckpt_dir: pathlib.Path) -> pathlib.Path:
    """The newest ``<step>`` directory whose integrity manifest verifies."""
    steps = sorted((int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
    for step in steps:
        problem = ckpt_lib.verify(ckpt_dir / str(step))
        if problem is None:
            return ckpt_dir / str(step)
        log.warning("checkpoint %s/%d is unusable: %s; trying an older one", ckpt_dir, step, problem)
    raise WorkdirError(f"no whole checkpoint in {ckpt_dir} (steps found: {sorted(steps)})")


def stored_config(step_dir: pathlib.Path) -> dict[str, Any]:
    """The trainer config saved with a checkpoint (the ``config`` item, JSON)."""
    path = step_dir / "config" / "metadata"
    if not path.is_file():
        raise WorkdirError(f"{step_dir} holds no trainer config (was it written by caper_jax.checkpoint?)")
    return json.loads(path.read_text())


def stored_param_shapes(step_dir: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """'/'-joined parameter path -> stored shape (from orbax metadata; no array is read)."""
    # The item's handler, not a Checkpointer: a Checkpointer looks for step-level metadata inside
    # the item directory and logs a warning when it (rightly) is not there.
    metadata = ocp.PyTreeCheckpointHandler().metadata(step_dir / "state")
    tree = getattr(metadata, "tree", metadata)
    flat = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + (str(key),))
        else:
            flat["/".join(p for p in prefix if p != "value")] = tuple(node.shape)

    walk(tree.get("params", {}), ())
    return flat


def restore_params(step_dir: pathlib.Path, abstract_params: nnx.State) -> nnx.State:
    """Reads only ``state.params`` of a checkpoint onto the shardings carried by ``abstract_params``."""
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    handler = ocp.PyTreeCheckpointHandler()      # as in stored_param_shapes
    try:
        restored = handler.restore(step_dir / "state", args=args)
    except ValueError as error:  # shape/structure mismatch: the config does not describe these params
        raise WorkdirError(f"{step_dir}: stored parameters do not fit the model of its config: {error}") from error
    finally:
        handler.close()
    return restored["params"]


def workdir_tokenizer(config: dict[str, Any], workdir: pathlib.Path):
    """The tokenizer the trainer of ``workdir`` used (module docstring)."""
    from transformers import AutoTokenizer

    model, data = config.get("model", {}), config.get("data", {})
    candidates = [model.get("tokenizer_dir")]
    if data.get("kind") == "demo":
        candidates.append(str(pathlib.Path(data.get("dir") or workdir / "demo_world") / "tokenizer"))
    candidates += [model.get("hf_dir"), str(workdir / "hf_export")]
    for candidate in candidates:
        if candidate and (pathlib.Path(candidate) / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(candidate)
    raise WorkdirError(f"no tokenizer found for {workdir}; looked in {[c for c in candidates if c]}")
