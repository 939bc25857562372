"""Device mesh from a config: named axes ``data``, ``fsdp``, ``tensor`` with one ``-1`` fill.

Why these three axes: ``data`` is pure data parallelism (params replicated, batch split), ``fsdp``
splits the batch *and* every param's ``embed`` dimension (ZeRO-3: weights are all-gathered per layer,
gradients reduce-scattered), ``tensor`` splits heads / MLP features (Megatron). Any of them may be 1.

Why ``AxisType.Auto`` on purpose: ``jax.make_mesh`` defaults to Explicit axes in this JAX, where every
op must have an unambiguous sharding and many ops need manual ``reshard`` calls. Our model code only
annotates params (and a few activations via ``with_sharding_constraint``) and lets GSPMD propagate the
rest, which is what Auto means.

Device order: ``mesh_utils.create_device_mesh`` lays the axes out over the physical topology (ICI
rings on TPU), with the *last* axis the most local. So ``tensor`` (most communication) is innermost and
``data`` (least) outermost; on multi-host GPU the outer axes therefore span hosts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")


class MeshShapeError(ValueError):
    """A mesh shape that cannot be laid over the available devices."""


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces the (at most one) ``-1`` in ``shape`` so the product equals ``num_devices``."""
    shape = tuple(int(s) for s in shape)
    if any(s == 0 or s < -1 for s in shape):
        raise MeshShapeError(f"mesh axis sizes must be positive or -1, got {shape}")
    fills = shape.count(-1)
    if fills > 1:
        raise MeshShapeError(f"at most one mesh axis may be -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if fills == 1:
        if num_devices % known:
            raise MeshShapeError(f"cannot fill {shape}: {num_devices} devices not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise MeshShapeError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {num_devices}")
    return shape


def make_mesh(
    shape: Sequence[int] | Mapping[str, int] = (1, -1, 1),
    axis_names: Sequence[str] = MESH_AXES,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a Mesh with Auto axis types.

    Args:
      shape: sizes per axis, in ``axis_names`` order, or a mapping ``{axis: size}`` (missing axes get
        size 1). One size may be ``-1``: it takes all remaining devices. Default: all devices on fsdp.
      axis_names: mesh axis names; the default ``("data", "fsdp", "tensor")`` is what the rules use.
      devices: defaults to ``jax.devices()`` (all processes' devices).
    """
    axis_names = tuple(axis_names)
    if isinstance(shape, Mapping):
        unknown = set(shape) - set(axis_names)
        if unknown:
            raise MeshShapeError(f"unknown mesh axes {sorted(unknown)}; axes are {axis_names}")
        shape = tuple(shape.get(name, 1) for name in axis_names)
    if len(shape) != len(axis_names):
        raise MeshShapeError(f"mesh shape {tuple(shape)} does not match axes {axis_names}")
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(shape, len(devices))
    try:
        device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError):
        # Topologies mesh_utils does not know (CPU, some GPU hosts): plain row-major order, which
        # keeps each process's devices contiguous on the innermost axes.
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))
