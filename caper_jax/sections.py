"""The settings sections the trainers share (``caper_jax.settings`` builds them from a config).

``ModelSettings``, ``OptimSettings``, ``WorldSettings`` (the data fields every trainer's world needs),
``MeshSettings`` (mesh and sharding rules) and ``TrainerSettings`` (those, the seed, the log and checkpoint
schedule): each checks its own
values in ``__post_init__``; ``check_world`` is the rule across the data and model sections. What only the
machine can answer (how many devices the mesh needs) is ``check_devices``, called by each trainer's
``validate``. The configs in ``configs/`` hold every default; these classes hold none.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

from caper_jax.data.data_world import WorldError
from caper_jax.models.config import REMAT_POLICIES
from caper_jax.models.presets import PRESETS
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import rules as rules_lib
from caper_jax.settings import Settings, one_of

# (logical axis name, mesh axis | mesh axes | None): caper_jax/parallel/rules.py
ShardingRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
MomentDtype = Literal["float32", "bfloat16"]
# The HF export's tensors (caper_jax.models.hf_io.EXPORT_DTYPES): bfloat16 as the Qwen3.5 release ships,
# float32 for bit-exact round trips of fp32 parameters.
ExportDtype = Literal["float32", "bfloat16"]
frozen = dataclasses.dataclass(frozen=True, kw_only=True)


@frozen
class ModelSettings:
    preset: str                 # tiny | small | qwen35_9b; with hf_dir only the dry run's shapes
    hf_dir: str
    tokenizer_dir: str
    dtype: str
    param_dtype: str
    remat: str

    def __post_init__(self):
        # An HF directory brings its own architecture; the preset then only names the dry run's shapes
        # (loop.check_dry_run refuses an unknown one there).
        if self.preset not in PRESETS and not self.hf_dir:
            raise ValueError(f"model.preset={self.preset!r}; expected one of {PRESETS} or model.hf_dir")
        one_of(self.remat, REMAT_POLICIES, "model.remat")


@frozen
class OptimSettings:
    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    b1: float
    b2: float
    grad_clip: float
    mu_dtype: MomentDtype       # AdamW moment storage (docs/scale.md "Fitting 16 GiB")
    nu_dtype: MomentDtype
    max_consecutive_nonfinite: int

    def __post_init__(self):
        if self.total_steps < 1 or self.lr <= 0:
            raise ValueError("optim.total_steps must be >= 1 and optim.lr > 0")
        if not math.isfinite(self.lr):   # NaN passes "lr <= 0"; the first update would make every weight NaN
            raise ValueError(f"optim.lr={self.lr} must be a finite number > 0")


@frozen
class WorldSettings:
    """The data fields ``caper_jax.data.data_world.prepare_world`` reads."""
    kind: str                   # demo | spider
    dir: str                    # Spider/BIRD layout; demo: built under the workdir when empty
    train_split: str
    eval_split: str
    demo_train_size: int
    demo_dev_size: int

    def __post_init__(self):
        one_of(self.kind, ("demo", "spider"), "data.kind", error=WorldError)


def check_bucket_lengths(buckets: tuple[int, ...], max_len: int) -> None:
    if list(buckets) != sorted(set(buckets)) or not buckets or buckets[-1] > max_len:
        raise ValueError(f"data.bucket_lengths={buckets} must be increasing and <= data.max_len")


def check_world(data: WorldSettings, model: ModelSettings) -> None:
    """Spider data needs its folder and a tokenizer (whether the folder holds a layout: ``prepare_world``)."""
    if data.kind == "spider":
        if not data.dir:
            raise WorldError("data.kind='spider' needs --config.data.dir=<Spider/BIRD layout directory>")
        if not (model.tokenizer_dir or model.hf_dir):
            raise WorldError("Spider data needs a tokenizer: set model.tokenizer_dir or model.hf_dir")


def check_positive(settings, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(settings, name)}")


@frozen
class MeshSettings(Settings):
    """The device mesh and the logical-axis rules of a job (trainers, the policy evaluation)."""
    mesh_shape: Mapping[str, int]    # data x fsdp x tensor; -1: all remaining devices
    sharding_rules: ShardingRules

    def __post_init__(self):
        rules_lib.rules_dict(self.sharding_rules)


@frozen
class TrainerSettings(MeshSettings):
    """What every trainer's settings hold besides its sections."""
    trainer: str
    seed: int
    log_every: int
    ckpt_every: int
    ckpt_keep: int
    export_hf: bool
    export_dtype: ExportDtype        # the end-of-run HF export's tensors

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, ("log_every", "ckpt_every"))


def check_devices(settings) -> None:
    """The mesh fits the devices of this job (``validate``: the machine, not the config, answers)."""
    from caper_jax.parallel import target   # counted only here: building settings touches no backend

    mesh_lib.resolve_mesh_shape(tuple(settings.mesh_shape.values()), len(target.devices()))

