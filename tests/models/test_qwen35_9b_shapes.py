"""The published Qwen3.5-9B shapes: the released config.json (tests/models/fixtures, source in the README
there) against ``Qwen35Config.qwen35_9b()`` and ``from_hf``, and a shape-faithful parity test against
transformers: every 9B dimension and the real vocabulary, two layers (one Gated DeltaNet, one gated
attention), random weights written as the release ships them (bf16, sharded safetensors + index,
multimodal tensor names, vision and MTP tensors beside the text model's).
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import pathlib
import resource
import time

import numpy as np
import pytest

from caper_jax.models import ConfigError, Qwen35Config, from_hf
from caper_jax.models.hf_io import read_config

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "qwen35_9b_config.json"

# Every key of the released text_config is either read into Qwen35Config (under the same name, or
# as named here) or has no effect on a text-only forward, for the reason given. A release that adds
# a key fails test_every_published_key_is_read_or_explained until someone decides which it is.
READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings",
    "eos_token_id", "layer_types",
    "rope_parameters",        # -> rope_theta, partial_rotary_factor (rope_type checked)
    "hidden_act",             # checked: silu only
    "attention_bias",         # checked: False only
    "attn_output_gate",       # checked: True only
    "model_type",             # checked: qwen3_5_text
}
NO_EFFECT = {
    "attention_dropout": "training-time dropout, 0.0",
    "dtype": "storage dtype of the release; a run sets its own (from_hf(dtype=...))",
    "full_attention_interval": "layer_types is given explicitly and wins",
    "initializer_range": "random init only",
    "mlp_only_layers": "empty: every layer has the dense MLP",
    "mtp_num_hidden_layers": "multi-token-prediction head: mtp.* tensors, skipped for the text model",
    "mtp_use_dedicated_embeddings": "same",
    "use_cache": "transformers' generate flag",
    "mamba_ssm_dtype": "float32: the DeltaNet state is always fp32 here",
}
# rope_parameters: theta and the rotary fraction are read; mRoPE with text-only positions (all three
# components equal) is exactly 1-D RoPE, so the sections and their interleaving change nothing.
ROPE_NO_EFFECT = {"mrope_interleaved", "mrope_section"}


def published() -> dict:
    return json.loads(FIXTURE.read_text())


def test_qwen35_9b_preset_equals_the_published_config_field_by_field():
    released = Qwen35Config.from_hf_dict(published())
    preset = Qwen35Config.qwen35_9b()
    for field in dataclasses.fields(Qwen35Config):
        assert getattr(preset, field.name) == getattr(released, field.name), field.name
    # ... and against the JSON itself, not only through from_hf_dict:
    text = published()["text_config"]
    for key in READ - {"rope_parameters", "hidden_act", "attention_bias", "attn_output_gate", "model_type"}:
        expected = tuple(text[key]) if key == "layer_types" else text[key]
        assert getattr(preset, key) == expected, key
    rope = text["rope_parameters"]
    assert (preset.rope_theta, preset.partial_rotary_factor) == (rope["rope_theta"], rope["partial_rotary_factor"])
    assert preset.tie_word_embeddings is published()["tie_word_embeddings"] is False
    assert (preset.vocab_size, preset.rotary_dim, preset.period, preset.num_groups) == (
        248_320, 64, ("linear_attention",) * 3 + ("full_attention",), 8)
    assert (preset.linear_key_dim, preset.linear_value_dim, preset.conv_dim) == (2048, 4096, 8192)


def test_every_published_key_is_read_or_explained():
    text = published()["text_config"]
    assert set(text) == READ | set(NO_EFFECT), set(text) ^ (READ | set(NO_EFFECT))
    rope = text["rope_parameters"]
    assert set(rope) == {"rope_theta", "partial_rotary_factor", "rope_type"} | ROPE_NO_EFFECT
    assert rope["rope_type"] == "default" and sum(rope["mrope_section"]) * 2 == Qwen35Config.qwen35_9b().rotary_dim
    assert text["mlp_only_layers"] == [] and text["mamba_ssm_dtype"] == "float32"
    assert text["full_attention_interval"] == 4 and text["layer_types"][3::4] == ["full_attention"] * 8


def test_from_hf_reads_the_published_config(tmp_path):
    (tmp_path / "config.json").write_text(FIXTURE.read_text())
    config = read_config(tmp_path, dtype="bfloat16", param_dtype="bfloat16")
    assert config == Qwen35Config.qwen35_9b(dtype="bfloat16", param_dtype="bfloat16")
    bad = published()
    bad["text_config"]["attn_output_gate"] = False
    with pytest.raises(ConfigError, match="attn_output_gate"):
        Qwen35Config.from_hf_dict(bad)


# -- the shape-faithful parity test --------------------------------------------------------------
# One check, two sizes: every published 9B dimension (`heavy`: 2.46 B parameters, ~14 GB of RAM and
# ~4 min on 2 cores; `CAPER_HEAVY=1 python -m pytest -m heavy tests/models/test_qwen35_9b_shapes.py`),
# and the same path at SCALED_DOWN widths in the default suite: the release's file layout (sharded
# bf16 safetensors + index, multimodal names, vision and MTP tensors), the loader, the bit-exact read,
# the orbax round trip and the logits against transformers in bf16 and fp32.

T = 24          # tokens per row: the DeltaNet chunk path with a partial chunk, and attention over a few keys

# The 9B text_config's widths cut down, its ratios kept (4 query heads per KV head, twice as many
# DeltaNet value heads as key heads, a quarter of the head rotated, MLP 3x hidden); every other key
# (eps, rope theta, gates, activation) is the release's.
SCALED_DOWN = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                   linear_value_head_dim=32)


def two_layer_text_config(vocab_size: int, **widths) -> dict:
    """The published text_config with the depth cut to one DeltaNet and one attention layer (and the
    widths replaced by ``widths``, if given)."""
    text = dict(published()["text_config"])
    text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=vocab_size,
                **widths)
    if text["eos_token_id"] >= vocab_size:   # the small-vocabulary variant has no <|endoftext|>
        text["eos_token_id"] = None
    return text


def build_torch_model(text: dict, dtype, seed: int):
    """transformers' Qwen3_5ForCausalLM at ``text``, random weights created in ``dtype``; the weights
    transformers initialises to constants randomised so a mis-wired norm or gate cannot hide."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "dtype"})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = transformers.Qwen3_5ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                param.normal_(0.0, 0.3)
            elif name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
    return model


def write_as_released(model, directory: pathlib.Path, text: dict, shard_bytes: int) -> dict[str, str]:
    """bf16/fp32 tensors under the release's names (``model.language_model.*``, ``lm_head.weight``) in
    ``model-0000i-of-0000n.safetensors`` shards of at most ``shard_bytes`` plus
    ``model.safetensors.index.json``, a vision and an MTP tensor beside them, and the multimodal
    config.json (the fixture with ``text``). Returns {text-model name: sha1 of its bytes}."""
    import torch
    from safetensors.torch import save_file

    named = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in model.state_dict().items()}
    dtype = next(iter(named.values())).dtype
    named["model.visual.patch_embed.proj.weight"] = torch.ones(8, 3, dtype=dtype)
    named["mtp.fc.weight"] = torch.ones(4, 4, dtype=dtype)
    shards, current, size = [], {}, 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = published()
    config["text_config"] = text
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return {k: _digest(v) for k, v in model.state_dict().items()}


def _digest(tensor) -> str:
    import torch

    t = tensor.detach().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def _np_digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()


def _peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def jax_logits(model, ids: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    return np.asarray(fn(state, jnp.asarray(ids, jnp.int32)))


def params_digest(model, config) -> dict[str, str]:
    """{transformers name: sha1} of the model's parameters in the HF layout (the loader's inverse)."""
    from caper_jax.models.hf_io import hf_state_dict

    return {name: _np_digest(array) for name, array in hf_state_dict(model, config)}


@pytest.mark.heavy   # 2.46 B parameters in bf16, written, loaded and checkpointed: ~14 GB of RAM, ~4 min on 2 cores
def test_shape_faithful_two_layer_model_matches_transformers_and_round_trips(tmp_path):
    """Every 9B dimension, depth cut to [DeltaNet, attention], compared with transformers twice:

    * bf16 at the real vocabulary (248,320): embedding + untied head alone are 2 x 1.02 B parameters, so
      two frameworks' fp32 copies (20 GB) do not fit a 24 GiB CI machine; both sides compute in bf16.
      Bound: bf16 keeps 8 significant bits (relative rounding 2^-9 per op); the two implementations round
      in different places (fused vs separate casts, accumulation order over 4096- and 12288-long dot
      products), so their logits differ by a few bf16 ulps of the largest hidden activations, carried
      through the head: max |Δ| <= 2^-4 · max |logit| (measured: see docs/model.md), while a mis-read
      tensor (a transpose, a swapped shard, a skipped prefix) changes logits by their own size.
    * fp32 with the same dimensions and a 4,096-token vocabulary: fp32 rounding (eps 1.2e-7) over dot
      products of 4096-12288 terms and two layers stays below 1e-4 relative to max |logit|.

    Also: the loaded parameters are bit-identical to the tensors written (HF -> caper_jax is exact), and
    the bf16 model round-trips through an orbax checkpoint (caper_jax.checkpoint) bit-exactly.
    """
    check_two_layer_parity(tmp_path, two_layer_text_config(248_320), two_layer_text_config(4096),
                           shard_bytes=(2 * 2**30, 2**30), min_parameters=2_400_000_000)


def test_scaled_down_two_layer_model_matches_transformers_and_round_trips(tmp_path):
    """The shape-faithful test's whole path (release layout, loader, bit-exact read, orbax round trip, logits
    against transformers in bf16 and fp32, same bounds) at SCALED_DOWN widths: what the heavy test
    checks at 9B widths, except the sizes themselves, on every run of the suite."""
    check_two_layer_parity(tmp_path, two_layer_text_config(8192, **SCALED_DOWN),
                           two_layer_text_config(4096, **SCALED_DOWN),
                           shard_bytes=(2**20, 2**20), min_parameters=4_000_000, widths=SCALED_DOWN)


def check_two_layer_parity(tmp_path, bf16_text: dict, fp32_text: dict, shard_bytes: tuple[int, int],
                           min_parameters: int, widths: dict | None = None) -> None:
    """bf16 at ``bf16_text`` (written as released in shards of ``shard_bytes[0]``), loaded, read bit-exactly,
    compared with transformers and round-tripped through orbax; then fp32 at ``fp32_text``."""
    import jax
    import torch

    from caper_jax.checkpoint import Checkpointer, abstract_state
    from flax import nnx

    timings = {}
    ids = np.random.default_rng(0).integers(0, bf16_text["vocab_size"], (2, T))

    # -- bf16 ------------------------------------------------------------------------------------------
    start = time.perf_counter()
    text = bf16_text
    hf_dir = tmp_path / "bf16"
    hf_dir.mkdir()
    model = build_torch_model(text, torch.bfloat16, seed=0)
    assert sum(p.numel() for p in model.parameters()) > min_parameters
    written = write_as_released(model, hf_dir, text, shard_bytes=shard_bytes[0])
    assert len(set(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    expected = torch_logits(model, ids)
    del model
    gc.collect()
    timings["bf16 torch"] = (round(time.perf_counter() - start, 1), _peak_gib())

    start = time.perf_counter()
    ours, config = from_hf(hf_dir, dtype="bfloat16")
    assert config == Qwen35Config.qwen35_9b(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                            dtype="bfloat16", param_dtype="bfloat16",
                                            vocab_size=text["vocab_size"], eos_token_id=text["eos_token_id"],
                                            **(widths or {}))
    assert params_digest(ours, config) == written          # every tensor read bit-exactly
    logits = jax_logits(ours, ids)
    scale = np.abs(expected).max()
    bf16_error = np.abs(logits - expected).max()
    print(f"bf16, vocab {text['vocab_size']}: max |logit| {scale:.3f}, max |Δlogit| {bf16_error:.4f}, "
          f"mean |Δ| {np.abs(logits - expected).mean():.5f}")
    assert bf16_error <= 2 ** -4 * scale, (bf16_error, scale)
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    timings["bf16 caper_jax"] = (round(time.perf_counter() - start, 1), _peak_gib())

    start = time.perf_counter()
    state = nnx.state(ours)
    before = {"/".join(map(str, path)): _np_digest(np.asarray(jax.device_get(leaf)).view(np.uint16))
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0] if leaf.dtype.itemsize == 2}
    target = abstract_state(state)
    with Checkpointer(tmp_path / "orbax", async_save=False) as checkpointer:
        checkpointer.save(0, state, force=True)
    del ours, state
    gc.collect()
    with Checkpointer(tmp_path / "orbax", async_save=False) as checkpointer:
        restored = checkpointer.restore(0, target).state
    after = {"/".join(map(str, path)): _np_digest(np.asarray(jax.device_get(leaf)).view(np.uint16))
             for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0] if leaf.dtype.itemsize == 2}
    assert len(before) > 20 and after == before
    del restored
    gc.collect()
    timings["orbax round trip"] = (round(time.perf_counter() - start, 1), _peak_gib())

    # -- fp32, same dimensions, a smaller vocabulary -----------------------------------------------------
    start = time.perf_counter()
    text = fp32_text
    hf_dir = tmp_path / "fp32"
    hf_dir.mkdir()
    model = build_torch_model(text, torch.float32, seed=1)
    write_as_released(model, hf_dir, text, shard_bytes=shard_bytes[1])
    small_ids = ids % text["vocab_size"]
    expected = torch_logits(model, small_ids)
    del model
    gc.collect()
    ours, _ = from_hf(hf_dir, dtype="float32")
    logits = jax_logits(ours, small_ids)
    scale = np.abs(expected).max()
    fp32_error = np.abs(logits - expected).max()
    print(f"fp32, vocab {text['vocab_size']}: max |logit| {scale:.3f}, max |Δlogit| {fp32_error:.2e}")
    assert fp32_error <= 1e-4 * scale, (fp32_error, scale)
    timings["fp32"] = (round(time.perf_counter() - start, 1), _peak_gib())
    print("seconds, peak RSS so far (GiB):", timings)
