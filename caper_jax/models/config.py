"""Qwen3.5 text-model configuration.

One frozen dataclass holds both the architecture (field names follow transformers'
`Qwen3_5TextConfig`, so `from_hf_dict` / `to_hf_dict` are near-identity maps) and the few
run-time choices that are not part of a checkpoint (compute/param dtype, rematerialisation,
DeltaNet chunk size). Only the architecture fields are written back to config.json.

The layer pattern (`layer_types`) is reduced to its smallest repeating period (Qwen3.5:
3 x linear_attention + 1 x full_attention); the model stacks the parameters of each position in
the period over the `num_groups` repetitions and scans over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_KINDS = (LINEAR_ATTENTION, FULL_ATTENTION)
REMAT_POLICIES = ("none", "full", "dots", "layers")
DTYPES = ("float32", "bfloat16", "float16")

# HF fields we read; anything architectural outside this set that would change the maths is
# checked explicitly in `from_hf_dict` (hidden_act, attention_bias, rope_type).
_ARCH_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


class ConfigError(ValueError):
    """A configuration this port cannot represent faithfully."""


def _default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Architecture of a Qwen3.5 text model plus run-time options (defaults: the 9B text model)."""

    vocab_size: int = 248_320
    hidden_size: int = 4096
    intermediate_size: int = 12_288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()  # empty: every 4th layer is full attention (HF default)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Run-time options (not part of a checkpoint).
    dtype: str = "float32"        # activations / matmul inputs; norms, gates, DeltaNet state stay fp32
    param_dtype: str = "float32"  # storage dtype of the parameters
    remat: str = "none"           # none | full | dots (save matmul outputs), per layer group | layers (save layer inputs only)
    chunk_size: int = 64          # gated-delta-rule chunk length
    # The layer groups as one lax.scan (False) or unrolled (True); None: unrolled on the CPU only, where
    # the scanned backward's slicing and transposes cost 9 % of a train step (BENCHMARKS.md), scanned on
    # accelerators (one compiled group however deep the model). Dry runs, which model accelerators on
    # CPU devices, pass False.
    unroll_layers: bool | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", _default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._validate()

    def _validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_KINDS)
        if unknown:
            raise ConfigError(f"unknown layer types {sorted(unknown)}; expected {LAYER_KINDS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even, in (0, head_dim]"
            )
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}; expected one of {DTYPES}")
        if self.chunk_size <= 0:
            raise ConfigError("chunk_size must be positive")
        if self.unroll_layers not in (None, True, False):
            raise ConfigError(f"unroll_layers={self.unroll_layers!r}; expected None, True or False")

    # Derived sizes -------------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def period(self) -> tuple[str, ...]:
        """Smallest repeating unit of `layer_types` (the scanned layer group)."""
        n = self.num_hidden_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
                return self.layer_types[:p]
        raise AssertionError("unreachable: the full pattern is always a period")

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // len(self.period)

    # HF config.json ----------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **runtime: Any) -> "Qwen35Config":
        """Reads a `qwen3_5_text` config.json, or the text part of a multimodal `qwen3_5` one."""
        tie_override = None
        if d.get("model_type") == "qwen3_5" or "text_config" in d:
            if "text_config" not in d:
                raise ConfigError("multimodal qwen3_5 config without text_config")
            # The multimodal wrapper ties (or not) its own lm_head: its flag wins.
            tie_override = d.get("tie_word_embeddings")
            d = d["text_config"]
        model_type = d.get("model_type", "qwen3_5_text")
        if model_type != "qwen3_5_text":
            raise ConfigError(f"expected model_type qwen3_5_text, got {model_type!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r}; only silu is implemented")
        if d.get("attention_bias", False):
            raise ConfigError("attention_bias=True is not implemented (Qwen3.5 has no attention bias)")
        if not d.get("attn_output_gate", True):
            raise ConfigError("attn_output_gate=False is not implemented (Qwen3.5 gates every attention output)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"rope_type={rope_type!r}; only default (text mRoPE == 1-D RoPE) is implemented")
        kwargs = {k: d[k] for k in _ARCH_FIELDS if k in d and (d[k] is not None or k.endswith("token_id"))}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])  # keeps the config hashable
        if d.get("layer_types"):
            kwargs["layer_types"] = tuple(d["layer_types"])
        elif "num_hidden_layers" in d:
            kwargs["layer_types"] = _default_layer_types(d["num_hidden_layers"], d.get("full_attention_interval", 4))
        kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10_000.0)))
        kwargs["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        tie = d.get("tie_word_embeddings", False) if tie_override is None else tie_override
        kwargs["tie_word_embeddings"] = bool(tie)
        return cls(**kwargs, **runtime)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `qwen3_5_text` config.json that `transformers.Qwen3_5ForCausalLM` loads."""
        d: dict[str, Any] = {k: getattr(self, k) for k in _ARCH_FIELDS}
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        d.update(
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            layer_types=list(self.layer_types),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            tie_word_embeddings=self.tie_word_embeddings,
            dtype=self.param_dtype,
            use_cache=True,
        )
        return d

    # Presets -----------------------------------------------------------------------------

    @classmethod
    def qwen35_9b(cls, **overrides: Any) -> "Qwen35Config":
        """The released 9B text model: field by field the ``text_config`` of ``Qwen/Qwen3.5-9B``'s
        config.json (tests/models/fixtures/qwen35_9b_config.json, where it comes from is in the README
        beside it): θ = 1e7, 262,144 positions, eos 248044 (``<|endoftext|>``), untied head. For real
        weights prefer the checkpoint's own config.json (``from_hf`` reads it)."""
        published = dict(rope_theta=1e7, max_position_embeddings=262_144, eos_token_id=248_044)
        return cls(**{**published, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> "Qwen35Config":
        """A few-hundred-k-parameter model with the full architecture, for tests and demos."""
        base = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            max_position_embeddings=2048,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes: Any) -> "Qwen35Config":
        return dataclasses.replace(self, **changes)


def on_cpu_unless(choice: bool | None) -> bool:
    """A run-time choice whose default (None) is True on the CPU only (``unroll_layers``,
    ``SamplingConfig.copy_layer_weights``: measured wins on XLA:CPU, not on accelerators)."""
    if choice is not None:
        return choice
    from caper_jax.parallel import target   # the config module itself imports no JAX

    return target.platform() == "cpu"   # the compile target's (--compile_for), else this process's backend


def qwen35_9b(**overrides: Any) -> Qwen35Config:
    return Qwen35Config.qwen35_9b(**overrides)
