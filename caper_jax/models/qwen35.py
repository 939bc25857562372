"""Qwen3.5 text model (gated DeltaNet + gated attention hybrid) in Flax NNX.

A faithful port of transformers' `modeling_qwen3_5.py` (text part), shaped for scale:

* Layers are scanned. `config.period` (Qwen3.5: 3 x DeltaNet + 1 x attention) is one scan step;
  the parameters of each position in the period are stacked over the `num_groups` repetitions
  (leading `layers` axis), so the 9B model compiles one group, not 32 layers. The scan body
  re-merges one group's parameter slices into the same modules (`nnx.split` / `nnx.merge`), so
  every module's code reads like an unstacked layer.
* Rematerialisation per group: `config.remat` = none | full | dots (save matmul outputs) | layers
  (save only each layer's input; each layer is checkpointed and consecutive layers of one kind are
  scanned inside the group, so the backward holds one layer's FSDP-gathered weights, gradients and
  intermediates at a time; docs/scale.md "Fitting a 16 GiB chip").
* Precision: matmuls in `config.dtype`; RMSNorms, gates (sigmoid / SiLU of z), the DeltaNet decay
  and recurrent state in fp32 (as transformers does); logits returned in fp32.
* Every parameter carries logical axis names (`out_sharding` metadata; names listed in
  docs/model.md) and activations go through `Sharding.constrain`, a no-op without a mesh.

Padding and packing: `attention_mask` marks real tokens (0 = pad; left or right). Pads are
masked as attention keys and zeroed before DeltaNet (so they never reach its state), and RoPE
positions count real tokens only, like `generate` does — a left-padded row gives the same
outputs as the unpadded one. `segment_ids` packs several sequences in a row: attention is
block-diagonal per segment, the DeltaNet conv and recurrent state restart at segment starts, and
positions restart at 0.

The cache API (`init_cache`, `prefill`, `decode_step`) holds per-layer-group K/V buffers, conv
states and fp32 recurrent states in a `Qwen35Cache` pytree; both steps are pure functions of
(model, inputs, cache) and can be jitted with the cache donated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from caper_jax.models.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config, on_cpu_unless
from caper_jax.ops.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
    segment_starts,
)
from caper_jax.parallel.rules import logical_to_spec

Array = jax.Array
LogicalRules = Sequence[tuple[str, Any]]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def to_dtype(name: str | jnp.dtype) -> jnp.dtype:
    return jnp.dtype(DTYPES.get(name, name)) if isinstance(name, str) else jnp.dtype(name)


# Sharding hook ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Logical-axis → mesh mapping for activations; without a mesh, `constrain` returns x as is."""

    mesh: Mesh | None = None
    rules: tuple[tuple[str, Any], ...] = ()

    def constrain(self, x: Array, names: tuple[str | None, ...]) -> Array:
        if self.mesh is None:
            return x
        spec = logical_to_spec(names, self.rules, shape=x.shape, mesh=self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def take_rows(self, table: Array, ids: Array) -> Array:
        """``jnp.take(table, ids, axis=0)`` for a ``("vocab", "embed")`` table, gathered in the table's own layout.

        The rows come out with their hidden dim split as the table's ``embed`` dim and the batch split only
        over the other batch axes (the ids likewise). Gathered straight into the activations' layout (batch
        over ``data × fsdp``, hidden whole), GSPMD cannot keep the table's hidden split: its backward, a
        scatter-add, was built as a full-size f32[vocab, hidden] gradient (3.79 GiB for Qwen3.5-9B) and
        all-reduced over every chip whenever ``data > 1`` (the TPU compiler's v5e-256 program: docs/scale.md).
        In this layout the scatter stays on each chip's [vocab, hidden / fsdp] slice and only the ``data``
        replicas reduce it, as for every other weight.
        """
        if self.mesh is None:
            return jnp.take(table, ids, axis=0)
        embed_axes = _spec_axes(logical_to_spec(("vocab", "embed"), self.rules, shape=table.shape, mesh=self.mesh)[1])
        batch_axes = [a for a in _spec_axes(logical_to_spec(("act_batch",), self.rules, shape=ids.shape[:1],
                                                             mesh=self.mesh)[0]) if a not in embed_axes]
        batch = None if not batch_axes else tuple(batch_axes)
        embed = None if not embed_axes else tuple(embed_axes)
        ids = jax.lax.with_sharding_constraint(ids, NamedSharding(self.mesh, PartitionSpec(batch, None)))
        rows = jnp.take(table, ids, axis=0)
        return jax.lax.with_sharding_constraint(rows, NamedSharding(self.mesh, PartitionSpec(batch, None, embed)))


def _spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# Parameters ------------------------------------------------------------------------------------

Init = Callable[[Array, tuple[int, ...], jnp.dtype], Array]
_normal = nnx.initializers.normal(0.02)


def _a_log_init(key: Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Array:
    # transformers: A ~ U(0.01, 16), stored as log A.
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


def _param(
    rngs: nnx.Rngs, init: Init, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: jnp.dtype, stack: int | None
) -> nnx.Param:
    """A parameter with logical axis names; `stack` adds the leading scanned `layers` axis."""
    if stack is not None:
        shape, names = (stack, *shape), ("layers", *names)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def _dense(x: Array, kernel: Array, dtype: jnp.dtype) -> Array:
    """x [..., in] @ kernel [in, out], computed on the rows flattened to one axis.

    The flattening is a free reshape, and it keeps the weight gradient a plain 2-D GEMM
    (rows^T @ grads): with [B, T, in] XLA:CPU contracted two axes and inserted transposes of every
    activation in the backward pass, ~25 % of a tiny-preset PRM step (docs/model.md, measured).
    """
    lead = x.shape[:-1]
    y = jnp.matmul(x.reshape(-1, x.shape[-1]).astype(dtype), kernel.astype(dtype))
    return y.reshape(*lead, kernel.shape[-1])


# Layers ----------------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """x * rsqrt(mean x^2 + eps) * (1 + w) in fp32, w zero-centred (transformers Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float, axis: str, *, dtype: jnp.dtype, stack: int | None, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = _param(rngs, nnx.initializers.zeros, (dim,), (axis,), dtype, stack)

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """DeltaNet output norm: plain weight w (init 1), gated by silu(z) (transformers Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, stack: int | None, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = _param(rngs, nnx.initializers.ones, (dim,), ("head_dim",), dtype, stack)

    def __call__(self, x: Array, gate: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        # Same cast order as transformers: normalise in fp32, scale in the input dtype, gate in fp32.
        y = self.weight[...].astype(x.dtype) * y
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, config: Qwen35Config, *, stack: int | None, rngs: nnx.Rngs):
        h, m, pd = config.hidden_size, config.intermediate_size, to_dtype(config.param_dtype)
        self.dtype = to_dtype(config.dtype)
        self.gate_proj = _param(rngs, _normal, (h, m), ("embed", "mlp"), pd, stack)
        self.up_proj = _param(rngs, _normal, (h, m), ("embed", "mlp"), pd, stack)
        self.down_proj = _param(rngs, _normal, (m, h), ("mlp", "embed"), pd, stack)

    def __call__(self, x: Array, ctx: "_Context") -> Array:
        hidden = jax.nn.silu(_dense(x, self.gate_proj[...], self.dtype)) * _dense(x, self.up_proj[...], self.dtype)
        hidden = ctx.sharding.constrain(hidden, ("act_batch", "act_length", "act_mlp"))
        return _dense(hidden, self.down_proj[...], self.dtype)


def rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_partial_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [B, T, H, D]; cos/sin [B, T, R]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x_rot * cos + rotate_half(x_rot) * sin, x_pass], axis=-1)


def rope_tables(positions: Array, rotary_dim: int, theta: float) -> tuple[Array, Array]:
    """cos, sin [B, T, rotary_dim] (fp32) for integer positions [B, T]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class GatedAttention(nnx.Module):
    """Full attention with an output gate: q_proj emits [q | gate] per head; q/k RMSNorm before RoPE."""

    def __init__(self, config: Qwen35Config, *, stack: int | None, rngs: nnx.Rngs):
        h, d, pd = config.hidden_size, config.head_dim, to_dtype(config.param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.dtype = to_dtype(config.dtype)
        self.q_proj = _param(rngs, _normal, (h, 2 * self.num_heads * d), ("embed", "heads"), pd, stack)
        self.k_proj = _param(rngs, _normal, (h, self.num_kv_heads * d), ("embed", "kv_heads"), pd, stack)
        self.v_proj = _param(rngs, _normal, (h, self.num_kv_heads * d), ("embed", "kv_heads"), pd, stack)
        self.o_proj = _param(rngs, _normal, (self.num_heads * d, h), ("heads", "embed"), pd, stack)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, "head_dim", dtype=pd, stack=stack, rngs=rngs)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, "head_dim", dtype=pd, stack=stack, rngs=rngs)

    def __call__(self, x: Array, ctx: "_Context", cache: dict[str, Array] | None) -> tuple[Array, dict | None]:
        b, t, _ = x.shape
        q_gate = _dense(x, self.q_proj[...], self.dtype).reshape(b, t, self.num_heads, 2 * self.head_dim)
        q, gate = jnp.split(q_gate, 2, axis=-1)
        k = _dense(x, self.k_proj[...], self.dtype).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = _dense(x, self.v_proj[...], self.dtype).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_partial_rope(self.q_norm(q), ctx.cos, ctx.sin)
        k = apply_partial_rope(self.k_norm(k), ctx.cos, ctx.sin)
        q = ctx.sharding.constrain(q, ("act_batch", "act_length", "act_heads", None))
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(cache["key"].dtype), ctx.write_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(cache["value"].dtype), ctx.write_index, axis=1)
            cache = {"key": k, "value": v}
            k, v = k.astype(self.dtype), v.astype(self.dtype)
        out = jax.nn.dot_product_attention(q, k, v, mask=ctx.attn_mask, scale=self.head_dim**-0.5)
        out = out.reshape(b, t, self.num_heads * self.head_dim)
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.reshape(out.shape).astype(jnp.float32))).astype(self.dtype)
        return _dense(out, self.o_proj[...], self.dtype), cache


class GatedDeltaNet(nnx.Module):
    """Linear attention with the gated delta rule (transformers Qwen3_5GatedDeltaNet)."""

    def __init__(self, config: Qwen35Config, *, stack: int | None, rngs: nnx.Rngs):
        h, pd = config.hidden_size, to_dtype(config.param_dtype)
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.chunk_size = config.chunk_size
        self.dtype = to_dtype(config.dtype)
        self.in_proj_qkv = _param(rngs, _normal, (h, config.conv_dim), ("embed", "conv"), pd, stack)
        self.in_proj_z = _param(rngs, _normal, (h, self.value_dim), ("embed", "v_heads"), pd, stack)
        self.in_proj_b = _param(rngs, _normal, (h, self.num_v_heads), ("embed", "v_heads"), pd, stack)
        self.in_proj_a = _param(rngs, _normal, (h, self.num_v_heads), ("embed", "v_heads"), pd, stack)
        self.conv1d = _param(
            rngs, _normal, (config.conv_dim, config.linear_conv_kernel_dim), ("conv", "conv_kernel"), pd, stack
        )
        self.A_log = _param(rngs, _a_log_init, (self.num_v_heads,), ("v_heads",), pd, stack)
        self.dt_bias = _param(rngs, nnx.initializers.ones, (self.num_v_heads,), ("v_heads",), pd, stack)
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps, dtype=pd, stack=stack, rngs=rngs)
        self.out_proj = _param(rngs, _normal, (self.value_dim, h), ("v_heads", "embed"), pd, stack)

    def __call__(self, x: Array, ctx: "_Context", cache: dict[str, Array] | None) -> tuple[Array, dict | None]:
        b, t, _ = x.shape
        if ctx.token_mask is not None:  # transformers' apply_mask_to_padding_states
            x = x * ctx.token_mask[..., None].astype(x.dtype)
        mixed = _dense(x, self.in_proj_qkv[...], self.dtype)
        z = _dense(x, self.in_proj_z[...], self.dtype).reshape(b, t, self.num_v_heads, self.value_head_dim)
        b_gate = _dense(x, self.in_proj_b[...], self.dtype)
        a = _dense(x, self.in_proj_a[...], self.dtype)

        conv_state = None if cache is None else cache["conv"]
        mixed, conv_state = causal_conv1d(
            mixed, self.conv1d[...].astype(self.dtype), state=conv_state, segment_ids=ctx.segment_ids
        )
        mixed = jax.nn.silu(mixed)
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(b, t, self.num_k_heads, self.key_head_dim))
        k = l2_normalize(k.reshape(b, t, self.num_k_heads, self.key_head_dim))
        v = v.reshape(b, t, self.num_v_heads, self.value_head_dim)
        beta = jax.nn.sigmoid(b_gate.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )

        state = None if cache is None else cache["recurrent"]
        if cache is not None and t == 1:
            out, state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            out = out[:, None]
        else:
            out, state = chunk_gated_delta_rule(
                q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state, segment_ids=ctx.segment_ids
            )
        out = self.norm(out.astype(self.dtype), z).reshape(b, t, self.value_dim)
        new_cache = None if cache is None else {"conv": conv_state.astype(cache["conv"].dtype), "recurrent": state}
        return _dense(out, self.out_proj[...], self.dtype), new_cache


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: token mixer (DeltaNet or attention) then SwiGLU MLP."""

    def __init__(self, config: Qwen35Config, kind: str, *, stack: int | None, rngs: nnx.Rngs):
        pd = to_dtype(config.param_dtype)
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, "embed", dtype=pd, stack=stack, rngs=rngs)
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, stack=stack, rngs=rngs)
        elif kind == FULL_ATTENTION:
            self.self_attn = GatedAttention(config, stack=stack, rngs=rngs)
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, "embed", dtype=pd, stack=stack, rngs=rngs
        )
        self.mlp = MLP(config, stack=stack, rngs=rngs)

    def __call__(self, x: Array, ctx: "_Context", cache: dict[str, Array] | None) -> tuple[Array, dict | None]:
        mixer = self.linear_attn if self.kind == LINEAR_ATTENTION else self.self_attn
        mixed, cache = mixer(self.input_layernorm(x), ctx, cache)
        x = x + mixed
        x = x + self.mlp(self.post_attention_layernorm(x), ctx)
        return ctx.sharding.constrain(x, ("act_batch", "act_length", "act_embed")), cache


# Model -----------------------------------------------------------------------------------------


class _Context(NamedTuple):
    """Per-call inputs every layer needs (closed over by the layer scan)."""

    cos: Array                    # [B, T, rotary_dim]
    sin: Array
    attn_mask: Array              # [B, 1, T, S] bool
    token_mask: Array | None      # [B, T] bool, zeroes pads before DeltaNet; None: no padding
    segment_ids: Array | None     # [B, T] packed-sequence ids; None: one sequence per row
    write_index: Array | None     # cache slot of the first new token
    sharding: Sharding


@struct.dataclass
class Qwen35Cache:
    """Decoding state. `blocks[j]` belongs to position j of the layer period, stacked over groups:
    attention {"key", "value"}: [G, B, S, kv_heads, head_dim]; DeltaNet {"conv": [G, B, K-1, conv_dim],
    "recurrent": [G, B, v_heads, key_head_dim, value_head_dim] fp32}. `index`: next free slot (scalar);
    `positions` [B]: next RoPE position (real tokens so far); `valid` [B, S]: slots holding real tokens.

    `per_group()` gives the same state with `blocks[g][j]` unstacked (the arrays without their G axis),
    the layout `decode_step` takes with `layer_groups`: a decode loop then carries every layer's state
    as a buffer of its own, which XLA:CPU updates in place, instead of slicing each group's state out of
    the stacked buffer and writing it back at every token (copies of every recurrent state and K/V
    cache; the bench config's decode loop 9 % faster without them, BENCHMARKS.md). `stacked()` goes back."""

    blocks: tuple[Any, ...]
    index: Array
    positions: Array
    valid: Array
    grouped: bool = struct.field(pytree_node=False, default=False)

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def per_group(self) -> "Qwen35Cache":
        if self.grouped:
            return self
        groups = jax.tree.leaves(self.blocks)[0].shape[0]
        blocks = tuple(tuple(jax.tree.map(lambda x, g=g: x[g], block) for block in self.blocks)
                       for g in range(groups))
        return self.replace(blocks=blocks, grouped=True)

    def stacked(self) -> "Qwen35Cache":
        if not self.grouped:
            return self
        blocks = tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *per_position) for per_position in zip(*self.blocks))
        return self.replace(blocks=blocks, grouped=False)


def positions_from_mask(valid: Array, segment_ids: Array | None = None) -> Array:
    """RoPE positions counting real tokens only, restarting at each segment start. [B, T] int32."""
    valid = valid.astype(jnp.int32)
    count = jnp.cumsum(valid, axis=1)
    if segment_ids is None:
        return jnp.maximum(count - 1, 0)
    starts = segment_starts(segment_ids).at[:, 0].set(True)
    base = jax.lax.cummax(jnp.where(starts, count - valid, 0), axis=1)
    return jnp.maximum(count - base - 1, 0)


def _kind_runs(period: Sequence[str]) -> list[list[int]]:
    """Positions of the period grouped into runs of consecutive equal layer kinds ([[0, 1, 2], [3]])."""
    runs: list[list[int]] = []
    for j, kind in enumerate(period):
        if runs and period[runs[-1][-1]] == kind:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


LAYER_INPUT = "layer_input"  # checkpoint_name of each layer's input under remat="layers"


def _remat(fn: Callable, policy: str) -> Callable:
    if policy == "none":
        return fn
    saveable = {"dots": jax.checkpoint_policies.checkpoint_dots,
                "layers": jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)}.get(policy)  # full: None
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)


class Qwen35ForCausalLM(nnx.Module):
    """Qwen3.5 text decoder with an LM head (tied to the embedding when the config says so)."""

    def __init__(
        self,
        config: Qwen35Config,
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
        rules: LogicalRules | None = None,
    ):
        self.config = config
        self.sharding = Sharding(mesh, tuple(tuple(r) for r in rules or ()))
        pd = to_dtype(config.param_dtype)
        self.dtype = to_dtype(config.dtype)
        self.embed_tokens = _param(rngs, _normal, (config.vocab_size, config.hidden_size), ("vocab", "embed"), pd, None)
        self.layers = nnx.List(
            [DecoderLayer(config, kind, stack=config.num_groups, rngs=rngs) for kind in config.period]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "embed", dtype=pd, stack=None, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, _normal, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pd, None)

    # Forward -------------------------------------------------------------------------------

    def _embed(self, input_ids: Array) -> Array:
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integer [B, T]; got {input_ids.dtype} {input_ids.shape}")
        h = self.sharding.take_rows(self.embed_tokens[...], input_ids).astype(self.dtype)
        return self.sharding.constrain(h, ("act_batch", "act_length", "act_embed"))

    def layer_groups(self) -> list[nnx.State]:
        """The stacked layer weights cut into one state per group (copies), for ``prefill``'s and
        ``decode_step``'s ``layer_groups``: sliced once per generation instead of once per token
        (docs/model.md)."""
        _, params = nnx.split(self.layers)
        return [jax.tree.map(lambda x, g=g: x[g], params) for g in range(self.config.num_groups)]

    def _layer_stack(self, h: Array, ctx: _Context, caches: tuple[dict, ...] | None,
                     layer_groups: list[nnx.State] | None = None) -> tuple[Array, tuple | None]:
        graphdef, params = nnx.split(self.layers)
        if layer_groups is not None:
            # The groups unrolled over weights cut beforehand, and over caches per group
            # (`caches[g][j]`, Qwen35Cache.per_group): XLA:CPU copies a scanned layer's slice of the
            # stacked weights out before its GEMMs, at every step of a decode loop.
            new_caches = []
            for group_params, group_caches in zip(layer_groups, caches, strict=True):
                new_group = []
                for layer, cache in zip(nnx.merge(graphdef, group_params), group_caches, strict=True):
                    h, cache = layer(h, ctx, cache)
                    new_group.append(cache)
                new_caches.append(tuple(new_group))
            return h, tuple(new_caches)

        per_layer = self.config.remat == "layers" and caches is None
        runs = _kind_runs(self.config.period)

        def one_layer(layer_def):
            def apply(state, h):
                return nnx.merge(layer_def, state)(h, ctx, None)[0]
            checkpointed = jax.checkpoint(apply, prevent_cse=False)
            return lambda state, h: checkpointed(state, checkpoint_name(h, LAYER_INPUT))

        def group(h: Array, xs: tuple[Any, Any]) -> tuple[Array, Any]:
            group_params, group_caches = xs
            layers = nnx.merge(graphdef, group_params)
            if per_layer:
                # remat="layers": each layer checkpointed, and a run of consecutive layers of one kind
                # (Qwen3.5: the 3 DeltaNet layers) scanned, so XLA gathers one layer's FSDP weights
                # and reduces one layer's gradients at a time instead of the whole group's.
                for run in runs:
                    layer_def, first = nnx.split(layers[run[0]])
                    if len(run) == 1:
                        h = one_layer(layer_def)(first, h)
                        continue
                    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layers[j]) for j in run])
                    h, _ = jax.lax.scan(lambda h, state: (one_layer(layer_def)(state, h), None), h, stacked)
                return h, None
            new_caches = []
            for j, layer in enumerate(layers):
                h, cache = layer(h, ctx, None if group_caches is None else group_caches[j])
                new_caches.append(cache)
            return h, None if group_caches is None else tuple(new_caches)

        return jax.lax.scan(_remat(group, self.config.remat), h, (params, caches),
                            unroll=on_cpu_unless(self.config.unroll_layers))

    def project(self, h: Array) -> Array:
        """Hidden states [..., H] -> fp32 logits [..., V]."""
        kernel = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return jnp.matmul(h.astype(self.dtype), kernel.astype(self.dtype), preferred_element_type=jnp.float32)

    def hidden_states(
        self,
        input_ids: Array,
        attention_mask: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
    ) -> Array:
        """[B, T] token ids -> [B, T, H] after the final norm (in `config.dtype`).

        attention_mask: [B, T], 0 at pads. segment_ids: [B, T] packed-sequence ids (a change of
        id starts a new sequence). positions: RoPE positions [B, T]; default counts real tokens
        per segment (`positions_from_mask`).
        """
        b, t = input_ids.shape
        for name, extra in (("attention_mask", attention_mask), ("segment_ids", segment_ids), ("positions", positions)):
            if extra is not None and extra.shape != input_ids.shape:
                raise ValueError(f"{name} must have the shape of input_ids {input_ids.shape}; got {extra.shape}")
        valid = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            positions = positions_from_mask(valid, segment_ids)
        mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        cos, sin = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta)
        ctx = _Context(
            cos=cos,
            sin=sin,
            attn_mask=mask[:, None],
            token_mask=None if attention_mask is None else valid,
            segment_ids=segment_ids,
            write_index=None,
            sharding=self.sharding,
        )
        h, _ = self._layer_stack(self._embed(input_ids), ctx, None)
        return self.norm(h)

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
    ) -> Array:
        """[B, T] token ids -> fp32 logits [B, T, V]."""
        logits = self.project(self.hidden_states(input_ids, attention_mask, segment_ids, positions))
        return self.sharding.constrain(logits, ("act_batch", "act_length", "act_vocab"))

    # Cached decoding -----------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: str | jnp.dtype | None = None) -> Qwen35Cache:
        """An empty cache for `batch` rows of up to `max_len` tokens (prompt + generated)."""
        c = self.config
        dtype = self.dtype if dtype is None else to_dtype(dtype)
        g = c.num_groups
        blocks = []
        for kind in c.period:
            if kind == FULL_ATTENTION:
                shape = (g, batch, max_len, c.num_key_value_heads, c.head_dim)
                blocks.append({"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)})
            else:
                blocks.append({
                    "conv": jnp.zeros((g, batch, c.linear_conv_kernel_dim - 1, c.conv_dim), dtype),
                    "recurrent": jnp.zeros(
                        (g, batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), jnp.float32
                    ),
                })
        return Qwen35Cache(
            blocks=tuple(blocks),
            index=jnp.zeros((), jnp.int32),
            positions=jnp.zeros((batch,), jnp.int32),
            valid=jnp.zeros((batch, max_len), bool),
        )

    def _cached_step(self, input_ids: Array, valid: Array, cache: Qwen35Cache,
                     layer_groups: list[nnx.State] | None = None) -> tuple[Array, Qwen35Cache]:
        t = input_ids.shape[1]
        if valid.shape != input_ids.shape or input_ids.shape[0] != cache.valid.shape[0]:
            raise ValueError(
                f"input_ids {input_ids.shape} / attention_mask {valid.shape} do not fit a cache of "
                f"batch {cache.valid.shape[0]}"
            )
        if t > cache.max_len:
            raise ValueError(f"{t} tokens do not fit a cache of max_len {cache.max_len}")
        if cache.grouped != (layer_groups is not None):
            raise ValueError("layer_groups go with a per-group cache (cache.per_group()), stacked weights "
                             f"with a stacked one; got layer_groups={layer_groups is not None}, "
                             f"cache.grouped={cache.grouped}")
        slots = jnp.arange(cache.max_len)
        query_slots = cache.index + jnp.arange(t)
        slot_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.index, axis=1)
        mask = (slots[None, :] <= query_slots[:, None])[None] & slot_valid[:, None, :]
        positions = cache.positions[:, None] + jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
        cos, sin = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta)
        ctx = _Context(
            cos=cos,
            sin=sin,
            attn_mask=mask[:, None],
            token_mask=valid if t > 1 else None,
            segment_ids=None,
            write_index=cache.index,
            sharding=self.sharding,
        )
        h, blocks = self._layer_stack(self._embed(input_ids), ctx, cache.blocks, layer_groups)
        logits = self.project(self.norm(h[:, -1]))
        new_cache = cache.replace(
            blocks=blocks,
            index=cache.index + t,
            positions=cache.positions + valid.sum(axis=1, dtype=jnp.int32),
            valid=slot_valid,
        )
        return logits, new_cache

    def prefill(self, input_ids: Array, attention_mask: Array, cache: Qwen35Cache,
                layer_groups: list[nnx.State] | None = None) -> tuple[Array, Qwen35Cache]:
        """Runs LEFT-padded prompts [B, T] into the cache; returns last-position logits [B, V] (fp32).

        The cache must have room: cache.index + T <= max_len (not checked under jit).
        layer_groups: as for ``decode_step`` (with a per-group cache), so that a prefill and the
        decode loop after it read one set of per-group weights.
        """
        return self._cached_step(input_ids, attention_mask.astype(bool), cache, layer_groups)

    def decode_step(self, token_ids: Array, cache: Qwen35Cache,
                    layer_groups: list[nnx.State] | None = None) -> tuple[Array, Qwen35Cache]:
        """Feeds one token per row [B]; returns next-token logits [B, V] (fp32) and the cache.

        layer_groups: ``self.layer_groups()`` computed once outside a decode loop, so the loop's
        steps read each group's weights in place (the same result as without); the cache must then
        be ``cache.per_group()``, and so is the one returned.
        """
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be [B]; got {token_ids.shape}")
        return self._cached_step(token_ids[:, None], jnp.ones((token_ids.shape[0], 1), bool), cache, layer_groups)
