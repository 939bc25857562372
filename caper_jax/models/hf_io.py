"""transformers (safetensors) <-> caper_jax Qwen3.5 parameters.

Loading streams: the model is built abstractly (`nnx.eval_shape`, nothing allocated), then each
target parameter is read from the memory-mapped safetensors files (for a scanned parameter: its
`num_groups` per-layer tensors, stacked on the host), converted to our layout and dtype, and
placed with `jax.make_array_from_callback` straight onto its target sharding (NamedSharding from
mesh + logical rules; one device otherwise). Every device receives only its own shard, and the
host holds at most one (stacked) parameter at a time — never the whole model.

Layout differences (the only transforms): projection kernels are stored [in, out] (torch Linear
is [out, in]); conv1d [C, 1, K] -> [C, K]; layer i = g * period + j lives at index g of the
stacked parameter of period position j. Names otherwise mirror transformers'.

Checkpoint variants accepted: a single `model.safetensors` or a sharded index; text-only
(`model.`) or multimodal (`model.language_model.`) prefixes; `model.visual.*` and `mtp.*` are
skipped; tied heads (no `lm_head.weight`) and untied ones.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from caper_jax.models.config import Qwen35Config
from caper_jax.models.qwen35 import Qwen35ForCausalLM, to_dtype
from caper_jax.parallel.multihost import fetch
from caper_jax.parallel.rules import logical_to_spec
from caper_jax.utils.errors import CheckpointError

ParamPath = tuple[Any, ...]
_PROJECTIONS = frozenset({
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
})
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
_TEXT_PREFIXES = ("model.language_model.", "model.")
SAFE_INDEX = "model.safetensors.index.json"
# Dtypes an export writes: bfloat16 as the Qwen3.5 release ships (and vLLM-CPU's DeltaNet kernel needs),
# float32 for bit-exact round trips of fp32 parameters.
EXPORT_DTYPES = ("float32", "bfloat16")
SAFE_SINGLE = "model.safetensors"


# Name mapping -----------------------------------------------------------------------------------


def hf_tensor_names(path: ParamPath, config: Qwen35Config) -> list[str]:
    """transformers tensor names of one of our parameters (one per scanned group, in order)."""
    keys = [str(k) for k in path]
    if keys[0] == "layers":
        position, local = int(keys[1]), keys[2:]
        suffix = ".".join(local) + ("" if _layout(path) == "identity" else ".weight")
        period = len(config.period)
        return [f"model.layers.{g * period + position}.{suffix}" for g in range(config.num_groups)]
    if keys == ["lm_head"]:
        return ["lm_head.weight"]
    if keys == ["embed_tokens"]:
        return ["model.embed_tokens.weight"]
    return ["model." + ".".join(keys)]


def _layout(path: ParamPath) -> str:
    name = str(path[-1])
    if name in _PROJECTIONS:
        return "transpose"
    if name == "conv1d":
        return "conv"
    return "identity"


def _from_hf_layout(tensor: np.ndarray, layout: str) -> np.ndarray:
    if layout == "transpose":
        return tensor.T
    if layout == "conv":
        return tensor[:, 0, :]
    return tensor


def _to_hf_layout(tensor: np.ndarray, layout: str) -> np.ndarray:
    if layout == "transpose":
        return np.ascontiguousarray(tensor.T)
    if layout == "conv":
        return np.ascontiguousarray(tensor[:, None, :])
    return np.ascontiguousarray(tensor)


# Reading ----------------------------------------------------------------------------------------


def _safe_open(path: pathlib.Path):
    """``safe_open``, with a damaged file (a truncated download, another format) as a CheckpointError."""
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or damaged?): {error}") from error


class _SafetensorsDir:
    """Tensor name -> lazily read numpy array, over a single file or a sharded index."""

    def __init__(self, directory: pathlib.Path):
        index = directory / SAFE_INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (directory / SAFE_SINGLE).exists():
            with _safe_open(directory / SAFE_SINGLE) as f:
                weight_map = {name: SAFE_SINGLE for name in f.keys()}
        else:
            raise CheckpointError(f"{directory}: neither {SAFE_INDEX} nor {SAFE_SINGLE}")
        self.directory = directory
        self.files: dict[str, Any] = {}
        # Canonical text-model name ("model.layers.0...", "lm_head.weight") -> stored name.
        self.names: dict[str, str] = {}
        self.weight_map = weight_map
        for stored in weight_map:
            if stored.startswith(_SKIPPED_PREFIXES):
                continue
            canonical = stored
            for prefix in _TEXT_PREFIXES:
                if stored.startswith(prefix):
                    canonical = "model." + stored[len(prefix):]
                    break
            self.names[canonical] = stored

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str) -> np.ndarray:
        stored = self.names[name]
        file = self.weight_map[stored]
        if file not in self.files:
            self.files[file] = _safe_open(self.directory / file)
        try:
            return self.files[file].get_tensor(stored)
        except Exception as error:  # noqa: BLE001 - safetensors raises its own (not exported) error types
            raise CheckpointError(f"{self.directory / file}: tensor {stored!r} cannot be read (truncated or "
                                  f"damaged file?): {error}") from error


def read_tensor(path: str | os.PathLike, name: str) -> np.ndarray:
    """One tensor of an HF checkpoint directory (single file or sharded index) as a host array."""
    tensors = _SafetensorsDir(pathlib.Path(path))
    if name not in tensors:
        raise CheckpointError(f"{path}: no tensor {name!r}")
    return tensors.read(name)


def _target_sharding(variable: nnx.Variable, mesh: Mesh | None, rules: Sequence[tuple[str, Any]] | None):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    names = variable.get_metadata().get("out_sharding")
    return NamedSharding(mesh, logical_to_spec(names, tuple(rules or ()), shape=variable.shape, mesh=mesh))


def read_config(path: str | os.PathLike, **runtime: Any) -> Qwen35Config:
    config_file = pathlib.Path(path) / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} not found")
    return Qwen35Config.from_hf_dict(json.loads(config_file.read_text()), **runtime)


def abstract_model(
    config: Qwen35Config, mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None
) -> Qwen35ForCausalLM:
    """The model with ShapeDtypeStruct parameters (no memory allocated)."""
    return nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules))


def from_hf(
    path: str | os.PathLike,
    dtype: str = "float32",
    mesh: Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
    *,
    allow_unused: Sequence[str] = (),
    **runtime: Any,
) -> tuple[Qwen35ForCausalLM, Qwen35Config]:
    """Loads a transformers Qwen3.5 checkpoint directory. `dtype` is the param and compute dtype;
    `runtime` overrides other run-time config fields (remat, chunk_size, param_dtype).
    `allow_unused`: tensor names the checkpoint may hold beyond the model's (e.g. a PRM's
    ``score.weight``, read with `read_tensor`); any other unused tensor is an error."""
    directory = pathlib.Path(path)
    config = read_config(directory, **{"dtype": dtype, "param_dtype": dtype, **runtime})
    tensors = _SafetensorsDir(directory)
    model = abstract_model(config, mesh, rules)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    used: set[str] = set()
    loaded = []
    for var_path, variable in nnx.to_flat_state(params):
        names = hf_tensor_names(var_path, config)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"{directory}: missing tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")
        layout = _layout(var_path)
        parts = [_from_hf_layout(tensors.read(n), layout) for n in names]
        host = np.stack(parts) if var_path[0] == "layers" else parts[0]
        if host.shape != variable.shape:
            raise CheckpointError(f"{names[0]}: shape {host.shape} in our layout, expected {variable.shape}")
        host = host.astype(to_dtype(config.param_dtype), copy=False)
        sharding = _target_sharding(variable, mesh, rules)
        value = jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index])
        loaded.append((var_path, variable.replace(value)))
        used.update(names)
    unused = set(tensors.names) - used - set(allow_unused)
    if config.tie_word_embeddings:
        unused.discard("lm_head.weight")  # some exporters write the tied copy
    if unused:
        raise CheckpointError(f"{directory}: tensors this model does not use: {sorted(unused)[:5]}")
    model = nnx.merge(graphdef, nnx.from_flat_state(loaded), rest)
    return model, config


# Writing ----------------------------------------------------------------------------------------


def export_dtype(dtype: str | None, config: Qwen35Config) -> str:
    """The dtype an export writes: ``dtype``, or the parameters' own when None; ValueError if unknown."""
    dtype = dtype or config.param_dtype
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: expected one of {EXPORT_DTYPES}")
    return dtype


def hf_state_dict(model: Qwen35ForCausalLM, config: Qwen35Config,
                  dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (transformers name, host array) one tensor at a time, in our parameter order, cast to
    ``dtype`` (None: the parameters' dtype; numpy's cast to bfloat16 rounds to nearest even, as torch's)."""
    target = np.dtype(to_dtype(export_dtype(dtype, config)))
    for var_path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = hf_tensor_names(var_path, config)
        host = fetch(variable[...])
        parts = list(host) if var_path[0] == "layers" else [host]
        for name, part in zip(names, parts, strict=True):
            yield name, _to_hf_layout(part, _layout(var_path)).astype(target, copy=False)


def to_hf(
    model: Qwen35ForCausalLM, config: Qwen35Config, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
    dtype: str | None = None,
) -> pathlib.Path:
    """Writes safetensors (sharded with an index past `max_shard_bytes`) and config.json that
    `transformers.Qwen3_5ForCausalLM.from_pretrained` loads, the tensors and config.json's ``dtype`` in
    `dtype` (one of EXPORT_DTYPES).

    `dtype` None keeps the parameters' dtype, so HF -> caper_jax -> HF is bit-exact. Only process 0
    writes; every process must call this (gathering a sharded parameter is collective). What a server
    needs beside the weights (token ids, generation_config.json, the chat template) is
    ``caper_jax.data.serving.add_serving_files``.
    """
    dtype = export_dtype(dtype, config)
    hf_config = {**config.to_hf_dict(), "dtype": dtype}
    return write_safetensors(hf_state_dict(model, config, dtype), out_dir, hf_config, max_shard_bytes)


def write_safetensors(
    tensors: Iterable[tuple[str, np.ndarray]],
    out_dir: str | os.PathLike,
    hf_config: Mapping[str, Any],
    max_shard_bytes: int = 5 * 2**30,
) -> pathlib.Path:
    """Streams (name, array) pairs into `model.safetensors`, or `model-0000k.safetensors` shards of at
    most `max_shard_bytes` plus `model.safetensors.index.json`; writes `hf_config` as config.json.
    Holds at most one shard in host memory. Only process 0 touches the file system."""
    out = pathlib.Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        if writer:
            save_file(shard, out / files[-1], metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, files[-1]))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
    if shard or not files:
        flush()
    if writer:
        if len(files) == 1:
            (out / files[0]).rename(out / SAFE_SINGLE)
        else:
            total = int(sum(os.path.getsize(out / f) for f in files))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        (out / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True))
    return out
