"""``python -m caper_jax.upgrade_run WORKDIR [WORKDIR ...]``: rewrites runs of an older layout into the
current one, once, in place, so that ``caper_jax.runs`` reads one layout only.

Two older layouts are converted, in every whole step of ``<workdir>/checkpoints`` (a step whose
integrity manifest fails is left as it is and named on stderr):

* **no run record** (saved before the ``run`` item existed): the architecture is derived by the rules
  the readers of such runs used — ``model.hf_dir`` / ``policy.hf_dir``'s config.json; for a GRPO run,
  the architecture of its SFT run (``policy.sft_workdir``); else ``model.preset`` with the vocabulary
  of the stored embedding — and the tokenizer is looked up as below; both are written as the ``run``
  item (``caper_jax.runs.record``);
* **a recorded tokenizer directory that is gone** (a workdir copied to another machine): the record's
  tokenizer is set to the one found by the lookup, if any.

The tokenizer lookup, first hit wins (a directory holding ``tokenizer_config.json``): ``model.tokenizer_dir``,
``<data.dir or WORKDIR/demo_world>/tokenizer`` for the demo world, ``model.hf_dir``, ``WORKDIR/hf_export``.

Each changed step's files are written beside their target and renamed into place, and its
integrity manifest is re-sealed (``caper_jax.checkpoint.write_manifest``); array data is never
rewritten. A run already in the current layout is left untouched, so the command can be repeated.
One line per step on stdout says what was done. A run that cannot be converted (no such directory,
an HF config.json that is gone, an unknown preset) is one ``error:`` line on stderr and exit status 2,
with nothing written to that step.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from caper_jax import checkpoint as ckpt_lib
from caper_jax import runs
from caper_jax.models import hf_io
from caper_jax.models.config import Qwen35Config
from caper_jax.models.presets import PRESETS, model_preset
from caper_jax.utils import cli
from caper_jax.utils.errors import CheckpointError

COMMAND = "python -m caper_jax.upgrade_run"


# -- the rules readers of the older layouts used


def _stored_param_shapes(step_dir: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """'/'-joined parameter path -> stored shape (checkpoint metadata; no array is read)."""
    flat = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + (str(key),))
        else:
            flat["/".join(p for p in prefix if p != "value")] = tuple(node.shape)

    walk(ckpt_lib.stored_state_tree(step_dir).get("params", {}), ())
    return flat


def derived_model(config: dict[str, Any], step_dir: pathlib.Path) -> Qwen35Config:
    """The architecture of a run saved without the record (module docstring)."""
    model = config.get("model", {})
    runtime = dict(dtype=model.get("dtype", "float32"), param_dtype=model.get("param_dtype", "float32"))
    hf_dir = model.get("hf_dir") or config.get("policy", {}).get("hf_dir")
    if hf_dir:
        if not pathlib.Path(hf_dir, "config.json").is_file():
            raise CheckpointError(f"{step_dir}: the run was initialised from {hf_dir}, whose config.json (the "
                                  "architecture) is not there; restore it there and run the upgrade again")
        return hf_io.read_config(hf_dir, **runtime)
    sft_workdir = config.get("policy", {}).get("sft_workdir")
    if sft_workdir:  # GRPO started from an SFT run: the policy has that run's architecture
        parent_step = runs.latest_whole_step(runs.checkpoints_dir(sft_workdir))
        recorded = ckpt_lib.read_json_item(parent_step, ckpt_lib.RUN_ITEM)
        if recorded is not None:
            return runs.recorded_model(recorded["model"]).replace(**runtime)
        parent = runs.stored_config(parent_step)
        if parent.get("model", {}).get("hf_dir"):
            return derived_model(parent, parent_step).replace(**runtime)
    if model.get("preset") not in PRESETS:
        raise CheckpointError(f"{step_dir}: saved without the architecture record, and its config names no known "
                              f"model.preset ({model.get('preset')!r}; known: {PRESETS})")
    shapes = _stored_param_shapes(step_dir)
    embed = shapes.get("embed_tokens") or shapes.get("backbone/embed_tokens") or (None,)   # policy / PRM
    return model_preset(model["preset"], vocab_size=embed[0], **runtime)


def found_tokenizer_dir(config: dict[str, Any], workdir: pathlib.Path) -> pathlib.Path | None:
    """The run's tokenizer directory by the lookup of the module docstring; None if none is there."""
    model, data = config.get("model", {}), config.get("data", {})
    candidates = [model.get("tokenizer_dir")]
    if data.get("kind") == "demo":
        candidates.append(str(pathlib.Path(data.get("dir") or workdir / "demo_world") / "tokenizer"))
    candidates += [model.get("hf_dir"), str(workdir / "hf_export")]
    for candidate in candidates:
        if candidate and (pathlib.Path(candidate) / "tokenizer_config.json").is_file():
            return pathlib.Path(candidate).absolute()
    return None


# -- converting


def upgraded_record(step_dir: pathlib.Path) -> dict[str, Any] | None:
    """The ``run`` item this step should hold, or None when it already holds a current one."""
    config = runs.stored_config(step_dir)
    workdir = step_dir.parent.parent
    record = ckpt_lib.read_json_item(step_dir, ckpt_lib.RUN_ITEM)
    if record is None:
        return runs.record(derived_model(config, step_dir), found_tokenizer_dir(config, workdir))
    tokenizer = record.get("tokenizer")
    if tokenizer and not pathlib.Path(tokenizer).is_dir() and (found := found_tokenizer_dir(config, workdir)):
        return {**record, "tokenizer": str(found)}
    return None


def _write_step(step_dir: pathlib.Path, record: dict[str, Any]) -> None:
    """Writes the ``run`` item and re-seals the manifest, each file renamed into place."""
    item = step_dir / ckpt_lib.RUN_ITEM
    item.mkdir(exist_ok=True)
    staged = item / "metadata.upgrade-tmp"
    staged.write_text(json.dumps(record))
    os.replace(staged, item / "metadata")
    ckpt_lib.write_manifest(step_dir, int(step_dir.name))


def upgrade(workdir: str | pathlib.Path) -> list[str]:
    """Converts every whole step of a run; returns one line per step (what was done)."""
    ckpt_dir = runs.checkpoints_dir(workdir)
    lines = []
    for step_dir in sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                           key=lambda p: int(p.name)):
        if (problem := ckpt_lib.verify(step_dir)) is not None:
            print(f"warning: {step_dir} left as it is: {problem}", file=sys.stderr)
            continue
        record = upgraded_record(step_dir)
        if record is None:
            lines.append(f"{step_dir}: current layout, unchanged")
            continue
        _write_step(step_dir, record)
        lines.append(f"{step_dir}: run record written (vocabulary {record['model']['vocab_size']}, "
                     f"tokenizer {record['tokenizer']})")
    return lines


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    del flag_values   # positional arguments only


def main(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> int:
    """``argv``: what absl left after the flags: the program and the workdirs."""
    del flag_values
    workdirs = list(argv[1:])
    if not workdirs:
        cli.usage_error(f"usage: {COMMAND} WORKDIR [WORKDIR ...]")
    try:
        for workdir in workdirs:
            for line in upgrade(workdir):
                print(line)
    except (CheckpointError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
