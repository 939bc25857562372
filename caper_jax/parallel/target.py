"""The devices a job's programs are built for: this process's, or a TPU slice compiled for from here.

``python -m caper_jax.train ... --compile_for=v5e-256`` compiles every program of a step for a slice that is not
attached (``caper_jax.parallel.compile_for``). Inside ``compiling_for(devices)`` the mesh is laid over those
compile-only devices and every choice that depends on the backend (``models.config.on_cpu_unless``: unrolled
layers, per-group weight copies in the sampler) follows the *target's* platform, not the host's: a CPU host
compiling for a TPU must produce the TPU's program. Outside it, both are this process's (``jax.devices()``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax

_TARGET: tuple | None = None


@contextlib.contextmanager
def compiling_for(devices: Sequence) -> Iterator[None]:
    """Within: ``devices()`` is ``devices`` and ``platform()`` theirs."""
    global _TARGET
    previous, _TARGET = _TARGET, tuple(devices)
    try:
        yield
    finally:
        _TARGET = previous


def devices() -> list:
    """The devices meshes are laid over: the compile target's, else all of this job's (``jax.devices()``)."""
    return list(_TARGET) if _TARGET is not None else jax.devices()


def platform() -> str:
    """``cpu``, ``gpu`` or ``tpu``: the platform programs are compiled for."""
    return _TARGET[0].platform if _TARGET is not None else jax.default_backend()
