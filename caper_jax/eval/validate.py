"""configs/eval.py built into ``EvalSettings`` and checked before any model or data is loaded (policy
evaluation, and the experiments' evaluation stages, caper_jax/experiments/)."""
from __future__ import annotations

import pathlib

from caper_jax.eval.settings import EvalSettings
from caper_jax.sections import check_devices
from caper_jax.settings import from_config


def validate(config) -> EvalSettings:
    """The config built into ``EvalSettings`` (its values checked there), then ``check_job``."""
    settings = from_config(EvalSettings, config)
    check_job(settings)
    return settings


def check_job(settings: EvalSettings) -> None:
    """What the settings alone cannot say: one policy to evaluate, paths that exist, devices for the mesh."""
    if bool(settings.policy.workdir) == bool(settings.policy.hf_dir):
        raise ValueError("set exactly one of policy.workdir and policy.hf_dir")
    for key, path in (("policy.workdir", settings.policy.workdir), ("policy.hf_dir", settings.policy.hf_dir),
                      ("prm.path", settings.prm.path), ("data.dir", settings.data.dir)):
        if path and not pathlib.Path(path).exists():
            raise ValueError(f"{key}={path!r} does not exist")
    check_devices(settings)
