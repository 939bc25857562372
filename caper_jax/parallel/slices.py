"""Cloud TPU slices as users name them (``v5e-256``, ``v5p-64``, ``v6e-64``), mapped to the topologies libtpu
compiles for, and the chip figures a compiled program is measured against.

``--compile_for=SLICE`` (``caper_jax.parallel.compile_for``) builds its mesh from ``slice_devices(name)``:
compile-only TPU devices of that topology, which libtpu provides on a machine with no TPU
(``jax.experimental.topologies``; ``pip install "jax[tpu]"``). Nothing here is allocated or run.

Slice names follow Cloud TPU's accelerator types: v5e and v6e count chips (``v5e-256`` = 256 chips, a 16×16
torus); v5p counts TensorCores, two per chip (``v5p-64`` = 32 chips, 2×4×4). One table says it once.

Chip figures (per chip, from Cloud TPU's system-architecture pages for v5e, v5p and v6e):

=====  ===============  =============  ===========================================  ======================
chip   peak bf16        HBM bandwidth  ICI bandwidth, bidirectional                 HBM the compiler allows
=====  ===============  =============  ===========================================  ======================
v5e    197 TFLOP/s      819 GB/s       400 GB/s                                     15.75 GiB (16 GB HBM)
v5p    459 TFLOP/s      2,765 GB/s     1,200 GB/s                                   95.74 GiB (95 GB HBM)
v6e    918 TFLOP/s      1,638 GB/s     800 GB/s                                     31.25 GiB (32 GB HBM)
=====  ===============  =============  ===========================================  ======================

The last column is what libtpu 0.0.42's compiler reports as available HBM (its ``RESOURCE_EXHAUSTED`` message
names it; ../shared/docs/ENV.md); a program is measured against it, not against the marketing figure.
"""
from __future__ import annotations

import dataclasses
import math

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    kind: str                  # as jax names the device (``device_kind``)
    hbm_bytes: int             # what the TPU compiler allows one program per chip
    peak_bf16_flops: float     # FLOP/s
    hbm_bytes_per_s: float
    ici_bytes_per_s: float     # bidirectional, per chip


CHIPS = {
    "v5e": Chip("TPU v5 lite", int(15.75 * GiB), 197e12, 819e9, 400e9),
    "v5p": Chip("TPU v5", int(95.74 * GiB), 459e12, 2765e9, 1200e9),
    "v6e": Chip("TPU v6 lite", int(31.25 * GiB), 918e12, 1638e9, 800e9),
}

# Slice sizes Cloud TPU offers per generation (accelerator-type suffixes), and the chip topology of each.
_TOPOLOGIES = {
    "v5e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v6e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    # v5p-N: N TensorCores, N/2 chips, a 3-D torus.
    "v5p": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8",
            1024: "8x8x8"},
}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    name: str                  # v5e-256
    generation: str            # v5e
    topology: str              # 16x16 (chips)
    chip: Chip

    @property
    def chips(self) -> int:
        return math.prod(int(n) for n in self.topology.split("x"))

    @property
    def topology_name(self) -> str:
        """The name ``jax.experimental.topologies.get_topology_desc`` takes: ``v5e:16x16``."""
        return f"{self.generation}:{self.topology}"


SLICE_NAMES = tuple(f"{gen}-{size}" for gen, sizes in _TOPOLOGIES.items() for size in sizes)


def tpu_slice(name: str) -> TpuSlice:
    """The slice ``name`` (``v5e-256``); a ValueError naming the known ones otherwise."""
    generation, _, size = name.partition("-")
    if generation not in _TOPOLOGIES or not size.isdigit() or int(size) not in _TOPOLOGIES[generation]:
        raise ValueError(f"--compile_for={name!r}: unknown TPU slice; known: {', '.join(SLICE_NAMES)}")
    return TpuSlice(name, generation, _TOPOLOGIES[generation][int(size)], CHIPS[generation])


def slice_devices(tpu: TpuSlice) -> list:
    """Compile-only devices of the slice's topology (libtpu; no TPU needed). One clear error without libtpu."""
    import os

    from jax.experimental import topologies

    # libtpu takes a lock file so that two processes do not drive one TPU; compiling for a topology drives none,
    # and several compiles (a test run beside a command) may hold it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = topologies.get_topology_desc(tpu.topology_name, platform="tpu").devices
    except RuntimeError as error:   # no libtpu: "Unknown backend tpu", "Unable to initialize backend 'tpu'"
        raise ValueError(f"--compile_for={tpu.name} needs the TPU compiler: pip install -e '.[tpu]' "
                         f"(libtpu, pinned to jax); {str(error).splitlines()[0]}") from None
    if len(devices) != tpu.chips:
        raise ValueError(f"{tpu.topology_name} gave {len(devices)} devices, expected {tpu.chips}")
    return list(devices)
