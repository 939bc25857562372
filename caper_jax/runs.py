"""Saved runs: what a checkpoint records about its model, and the one loader every reader uses.

A run directory (PRM, SFT or GRPO trainer workdir, or a ``python -m caper_jax.convert hf-to-orbax``
output) holds ``checkpoints/<step>/`` written by ``caper_jax.checkpoint.Checkpointer``: the ``state``
item (``TrainState``, or ``{"params"}`` alone for a conversion), the ``config`` item (the trainer's
config; ``{"trainer": "convert", ...}`` for a conversion) and the ``run`` item (``record``): the
RESOLVED architecture — every ``Qwen35Config`` field after preset, HF config.json and overrides,
vocabulary size included — and the directory the run's tokenizer came from
(``caper_jax.data.data_world.DataWorld.tokenizer_dir``). Readers rebuild the model from that record, so
no reader re-derives the architecture from the trainer config by its own rule.

Runs of an older layout (saved before the record, or a recorded tokenizer directory that is gone:
a workdir copied to another machine) are converted once by ``python -m caper_jax.upgrade_run WORKDIR``;
reading one unconverted is a ``CheckpointError`` that names that command.

``load_run`` picks the step the way training resumes: the newest one whose integrity manifest
verifies (``caper_jax.checkpoint.verify``; a damaged newer step is skipped with a warning), or
exactly the requested one. With ``what="params"`` only ``state.params`` is read (a partial
restore, straight onto the target shardings): inference never needs the optimizer moments, which
are twice the parameters' size. ``what="state"`` restores the whole ``TrainState`` (optimizer from
the stored ``optim`` config). Every way a run can be missing, partial or not fit what is asked of it
raises ``CheckpointError`` with the path and the reason.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

import jax
from flax import nnx
from ml_collections import ConfigDict

from caper_jax import checkpoint as ckpt_lib
from caper_jax.checkpoint import RUN_ITEM
from caper_jax.models.config import Qwen35Config
from caper_jax.parallel import rules as rules_lib
from caper_jax.utils import optim as optim_lib
from caper_jax.utils.errors import CheckpointError

log = logging.getLogger(__name__)

RUN_FORMAT = 1
CONVERTED = "convert"       # the ``trainer`` of a converted HF model's config
POLICY_TRAINERS = ("sft", "grpo", CONVERTED)   # runs whose model is a causal LM (a policy)
UPGRADE_COMMAND = "python -m caper_jax.upgrade_run"   # converts a run of an older layout (caper_jax/upgrade_run.py)
_TRAINER_NAMES = {"sft": "SFT", "grpo": "GRPO", "prm": "Clause-PRM", CONVERTED: "convert hf-to-orbax"}


class ModuleBuilder(Protocol):
    """What ``load_run`` builds a run's architecture with: a module class such as ``Qwen35ForCausalLM``
    or ``ClausePRM`` (``module(config, rngs=..., mesh=..., rules=...)``)."""

    def __call__(self, config: Qwen35Config, *, rngs: nnx.Rngs, mesh: Any, rules: Any) -> nnx.Module: ...


def record(model_config: Qwen35Config, tokenizer_dir: str | pathlib.Path | None) -> dict[str, Any]:
    """The ``run`` item a trainer saves with every checkpoint (module docstring)."""
    return {"format": RUN_FORMAT, "model": dataclasses.asdict(model_config),
            "tokenizer": str(pathlib.Path(tokenizer_dir).absolute()) if tokenizer_dir else None}


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a run's checkpoint says about itself (no array read)."""

    workdir: pathlib.Path             # the run directory (parent of checkpoints/)
    step_dir: pathlib.Path
    step: int
    config: dict[str, Any]            # the trainer config stored with the checkpoint
    model_config: Qwen35Config        # the architecture, with the run-time fields it trained with
    tokenizer_dir: pathlib.Path | None

    @property
    def trainer(self) -> str | None:
        return self.config.get("trainer")

    def tokenizer(self):
        """The run's tokenizer (``AutoTokenizer`` of ``tokenizer_dir``)."""
        from transformers import AutoTokenizer  # transformers loads when a tokenizer is asked for

        if self.tokenizer_dir is None:
            raise CheckpointError(f"{self.step_dir}: the run records no tokenizer")
        if not (self.tokenizer_dir / "tokenizer_config.json").is_file():
            raise CheckpointError(f"{self.step_dir}: no tokenizer in the recorded {self.tokenizer_dir} (a workdir "
                                  f"copied from another machine? {UPGRADE_COMMAND} {self.workdir} finds the one "
                                  "it holds)")
        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))


@dataclasses.dataclass(frozen=True)
class SavedRun(RunInfo):
    """A loaded run: its description plus parameters (and, for ``what="state"``, the full TrainState)."""

    graphdef: Any = None
    params: Any = None                # nnx.State of the module
    state: Any = None                 # TrainState (what="state"), else None

    @property
    def model(self) -> nnx.Module:
        """The module, as ``load_run``'s ``module`` built it."""
        return nnx.merge(self.graphdef, self.params)


def check_vocab(what: str, model_vocab: int, tokenizer_size: int) -> None:
    """The one rule for a model fitting a tokenizer: every token id needs an embedding row, so the
    model's vocabulary must be at least the tokenizer's length. It may be larger: HF configs pad it
    (Qwen3.5's 248,320 rows exceed its tokenizer's length)."""
    if model_vocab < tokenizer_size:
        raise CheckpointError(f"{what}: vocabulary {model_vocab} < tokenizer size {tokenizer_size} (a model of a "
                              "different tokenizer)")


# -- finding the checkpoint


def checkpoints_dir(path: str | pathlib.Path) -> pathlib.Path:
    """``<run>/checkpoints`` for a run directory, or the path itself if it already is one; absolute,
    because orbax refuses to restore from a relative path and the documented commands pass
    workdirs such as ``runs/sft_demo``."""
    path = pathlib.Path(path).absolute()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist (neither a trainer workdir nor a checkpoints directory)")
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path
    if (path / "params").is_dir() and (path / "config.json").is_file():
        raise CheckpointError(f"{path} was written by an older `convert hf-to-orbax` (params/ + config.json); "
                              "convert the HF directory again: python -m caper_jax.convert hf-to-orbax --hf_dir "
                              "HF_DIR --out OUT")
    raise CheckpointError(f"{path} is neither a trainer workdir (no checkpoints/) nor a checkpoints directory")


def latest_whole_step(ckpt_dir: pathlib.Path) -> pathlib.Path:
    """The newest ``<step>`` directory whose integrity manifest verifies."""
    steps = sorted((int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
    for step in steps:
        problem = ckpt_lib.verify(ckpt_dir / str(step))
        if problem is None:
            return ckpt_dir / str(step)
        log.warning("checkpoint %s/%d is unusable: %s; trying an older one", ckpt_dir, step, problem)
    raise CheckpointError(f"no whole checkpoint in {ckpt_dir} (steps found: {sorted(steps)})")


def _step_dir(path: str | pathlib.Path, step: int) -> pathlib.Path:
    ckpt_dir = checkpoints_dir(path)
    if step == 0:
        return latest_whole_step(ckpt_dir)
    step_dir = ckpt_dir / str(step)
    if not step_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} has no step {step}")
    if (problem := ckpt_lib.verify(step_dir)) is not None:
        raise CheckpointError(f"{step_dir}: {problem}")
    return step_dir


def stored_config(step_dir: pathlib.Path) -> dict[str, Any]:
    """The trainer config saved with a checkpoint (the ``config`` item, JSON)."""
    config = ckpt_lib.read_json_item(step_dir, "config")
    if config is None:
        raise CheckpointError(f"{step_dir} holds no trainer config (was it written by caper_jax.checkpoint?)")
    return config


# -- the run's architecture and tokenizer


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def recorded_model(fields: dict[str, Any]) -> Qwen35Config:
    """The ``Qwen35Config`` of a record's ``model`` fields."""
    # JSON gives every tuple field back as a list; the config must stay hashable (graphdef, jit keys).
    return Qwen35Config(**{name: _tuples(value) for name, value in fields.items()})


def read_run(path: str | pathlib.Path, *, step: int = 0, trainers: Sequence[str] | None = None) -> RunInfo:
    """The description of a run's checkpoint (newest whole one when ``step`` is 0); no array is read.

    ``trainers``: the trainers whose runs the caller can use (e.g. ``POLICY_TRAINERS``); None: any.
    """
    step_dir = _step_dir(path, step)
    config = stored_config(step_dir)
    if trainers is not None and config.get("trainer") not in trainers:
        wanted = "/".join(_TRAINER_NAMES.get(t, t) for t in trainers)
        raise CheckpointError(f"{step_dir} was written by the {config.get('trainer')!r} trainer, not {wanted}")
    workdir = step_dir.parent.parent
    run_item = ckpt_lib.read_json_item(step_dir, RUN_ITEM)
    if run_item is None:
        raise CheckpointError(f"{step_dir} was saved before the run record (architecture and tokenizer) existed; "
                              f"convert the run once: {UPGRADE_COMMAND} {workdir}")
    if run_item.get("format") != RUN_FORMAT:
        raise CheckpointError(f"{step_dir}/{RUN_ITEM}: format {run_item.get('format')!r}, this code reads {RUN_FORMAT}")
    try:
        model_config = recorded_model(run_item["model"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{step_dir}/{RUN_ITEM}: not a model config this code can build: {error}") from error
    tokenizer = pathlib.Path(run_item["tokenizer"]) if run_item.get("tokenizer") else None
    return RunInfo(workdir, step_dir, int(step_dir.name), config, model_config, tokenizer)


# -- loading


def load_run(path: str | pathlib.Path, *, module: ModuleBuilder, mesh, rules, what: str = "params", step: int = 0,
             trainers: Sequence[str] | None = None, dtype: str | None = None, param_dtype: str | None = None,
             remat: str = "none") -> SavedRun:
    """A run's model restored onto ``mesh``: its description (``read_run``) plus params or full state.

    ``module`` builds the run's recorded architecture (``Qwen35ForCausalLM`` for a policy run,
    ``caper_jax.prm.model.ClausePRM`` for a PRM run): the caller, who knows what it loads, passes it,
    so this module depends on no model above it; a module that does not fit the stored parameters is a
    ``CheckpointError``. ``dtype`` / ``param_dtype`` default to the run's own (stored parameters are cast
    to ``param_dtype`` on read); ``remat`` defaults to none (inference).
    """
    if what not in ("params", "state"):
        raise ValueError(f"what={what!r}; expected 'params' or 'state'")
    info = read_run(path, step=step, trainers=trainers)
    arch = info.model_config.replace(dtype=dtype or info.model_config.dtype,
                                     param_dtype=param_dtype or info.model_config.param_dtype, remat=remat)
    graphdef, abstract = rules_lib.abstract_state(lambda: module(arch, rngs=nnx.Rngs(0), mesh=mesh, rules=rules),
                                                  mesh, rules)
    fields = {**{f.name: getattr(info, f.name) for f in dataclasses.fields(RunInfo)}, "model_config": arch}
    if what == "params":
        return SavedRun(**fields, graphdef=graphdef, params=_restore_params(info.step_dir, abstract, module))
    state = _restore_state(info, abstract, mesh, rules)
    return SavedRun(**fields, graphdef=graphdef, params=state.params, state=state)


def _restore_params(step_dir: pathlib.Path, abstract_params: nnx.State, module: ModuleBuilder) -> nnx.State:
    """Reads only ``state.params`` of a checkpoint onto the shardings carried by ``abstract_params``."""
    try:
        restored = ckpt_lib.restore_state_item(step_dir, {"params": abstract_params}, partial=True)
    except ValueError as error:  # shape/structure mismatch: a wrong record, or a module of another kind of run
        name = getattr(module, "__name__", module)
        raise CheckpointError(f"{step_dir}: stored parameters do not fit the {name} built from its record: "
                              f"{error}") from error
    return restored["params"]


def _restore_state(info: RunInfo, abstract_params: nnx.State, mesh, rules):
    """The whole TrainState of a trainer checkpoint (optimizer rebuilt from the stored ``optim``)."""
    if "optim" not in info.config:
        raise CheckpointError(f"{info.step_dir} holds parameters only (written by "
                              f"{_TRAINER_NAMES.get(info.trainer, info.trainer)}), no optimizer state")
    tx = optim_lib.make_optimizer(ConfigDict(info.config["optim"]))
    state = jax.eval_shape(lambda p: optim_lib.init_state(p, tx), abstract_params)
    shardings = rules_lib.logical_to_sharding(state, mesh, rules)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    try:
        return ckpt_lib.restore_state_item(info.step_dir, abstract)
    except ValueError as error:
        raise CheckpointError(f"{info.step_dir}: the stored train state does not fit its config: {error}") from error
