"""Errors raised by more than one module, defined once so that one ``except`` catches them all.

Standard library only: the command-line entry points (``caper_jax.verify``, ``caper_jax.convert``)
import these without pulling in jax.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, or does not fit what is asked of it.

    Raised for an HF directory that does not hold a loadable Qwen3.5 text model or Clause-PRM
    export (``caper_jax.models.hf_io``, ``caper_jax.prm.export``) and for an orbax checkpoint that
    cannot serve the requested restore, e.g. one without data iterator state
    (``caper_jax.checkpoint``). A ValueError: the checkpoint given is a bad input, as the command
    lines report it.
    """


class NonFiniteLossError(RuntimeError):
    """The run kept producing non-finite losses or gradients (SFT, PRM and GRPO trainers)."""


class Preempted(Exception):
    """SIGTERM (a scheduler's preemption notice) stopped the run after it saved a checkpoint at ``step``
    in ``directory``; the same command resumes from there (``caper_jax.loop.TrainingRun.train``)."""

    def __init__(self, step: int, directory):
        super().__init__(f"stopped by SIGTERM after saving step {step} in {directory}; the same command "
                         "resumes from it")
        self.step = step
