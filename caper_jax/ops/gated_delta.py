"""Gated delta rule (Gated DeltaNet) and the depthwise causal conv in front of it.

Recurrence, per head, with state S in R^{Dk x Dv} (fp32):

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T (q_t / sqrt(Dk))

Three forms share these semantics:

* `chunk_gated_delta_rule` (training, prefill): the sequence is cut into chunks of C = 64.
  Inside a chunk the C delta updates are condensed with the WY/UT representation — one unit
  lower-triangular solve per chunk, batched over all chunks at once — and a `lax.scan` over
  chunks carries the state. Work is O(T C (Dk + Dv)) in matmuls instead of T sequential
  rank-one updates, which is what makes it fast on every backend (CPU included).
* `recurrent_gated_delta_rule`: the plain per-step scan; the reference for tests.
* `gated_delta_step`: one step, for decoding with a cache.

Packed sequences: `segment_ids` [B, T] (any ids; a new segment starts wherever the id changes)
make the state restart at every segment start — the chunked form masks cross-segment pairs
inside a chunk and drops the carried state for positions after a start. An `initial_state`
belongs to the first segment.

Grouped heads: q/k may have fewer heads than v (Qwen3.5: 16 qk, 32 v); each qk head serves
`Hv // Hk` consecutive v heads (repeat-interleave, as in transformers).

All math runs in fp32 with HIGHEST matmul precision (TPU/GPU would otherwise use bf16/TF32
passes for fp32 matmuls, which the recurrent state does not tolerate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
_HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x * rsqrt(sum x^2 + eps) in fp32 (the FLA / transformers convention: eps inside the root)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand_heads(x: Array, num_heads: int) -> Array:
    """[B, T, Hk, D] -> [B, T, Hv, D], each qk head repeated for its group of v heads."""
    groups = num_heads // x.shape[2]
    return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def _check_shapes(
    query: Array, key: Array, value: Array, g: Array, beta: Array, initial_state: Array | None = None
) -> None:
    if query.shape != key.shape or query.ndim != 4:
        raise ValueError(f"query/key must both be [B, T, Hk, Dk]; got {query.shape} and {key.shape}")
    b, t, hk, _ = key.shape
    if value.ndim != 4 or value.shape[:2] != (b, t) or value.shape[2] % hk:
        raise ValueError(f"value must be [B, T, Hv, Dv] with Hv a multiple of Hk={hk}; got {value.shape}")
    if g.shape != value.shape[:3] or beta.shape != value.shape[:3]:
        raise ValueError(f"g and beta must be [B, T, Hv]={value.shape[:3]}; got {g.shape} and {beta.shape}")
    state_shape = (b, value.shape[2], key.shape[3], value.shape[3])
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv]={state_shape}; got {initial_state.shape}")


def segment_starts(segment_ids: Array) -> Array:
    """[B, T] bool: True where a new segment begins (never at t = 0: the initial state's segment)."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(changed[:, :1]), changed], axis=1)


def solve_unit_lower(lower: Array, rhs: Array, block: int = 16) -> Array:
    """Solves (I + lower) X = rhs for strictly lower-triangular `lower` [..., C, C], rhs [..., C, M].

    Blocked forward substitution: the `block`-sized diagonal blocks of (I + lower) are inverted
    with `lax.linalg.triangular_solve` (all at once), the off-diagonal blocks enter through
    matmuls. On CPU this ran ~7x faster than one triangular solve of the 64 x 64 chunks
    (docs/model.md, "Performance notes").
    """
    c = lower.shape[-1]
    block = block if c % block == 0 else c
    nb = c // block
    tiles = lower.reshape(*lower.shape[:-2], nb, block, nb, block)
    diag = jnp.stack([tiles[..., i, :, i, :] for i in range(nb)], axis=-3)  # [..., nb, block, block]
    eye = jnp.eye(block, dtype=lower.dtype)
    diag_inv = jax.lax.linalg.triangular_solve(
        diag + eye, jnp.broadcast_to(eye, diag.shape), left_side=True, lower=True, unit_diagonal=True
    )
    rhs_tiles = rhs.reshape(*rhs.shape[:-2], nb, block, rhs.shape[-1])
    solved: list[Array] = []
    for i in range(nb):
        acc = rhs_tiles[..., i, :, :]
        for j in range(i):
            acc = acc - _mm(tiles[..., i, :, j, :], solved[j])
        solved.append(_mm(diag_inv[..., i, :, :], acc))
    return jnp.concatenate(solved, axis=-2)


def _mm(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def chunk_gated_delta_rule(
    query: Array,
    key: Array,
    value: Array,
    g: Array,
    beta: Array,
    *,
    chunk_size: int = 64,
    initial_state: Array | None = None,
    segment_ids: Array | None = None,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """Chunked gated delta rule.

    Args:
      query, key: [B, T, Hk, Dk] (already L2-normalised if the model wants it).
      value: [B, T, Hv, Dv]. g: [B, T, Hv] log-decay (<= 0). beta: [B, T, Hv].
      initial_state: optional [B, Hv, Dk, Dv]. segment_ids: optional [B, T] (state resets).
      scale: query scale, default Dk ** -0.5.
    Returns:
      (output [B, T, Hv, Dv] in value.dtype, final state [B, Hv, Dk, Dv] fp32).
    """
    _check_shapes(query, key, value, g, beta, initial_state)
    out_dtype = value.dtype
    b, t, _, dk = key.shape
    hv, dv = value.shape[2:]
    c = chunk_size
    scale = dk**-0.5 if scale is None else scale
    f32 = jnp.float32

    # -> [B, H, T, D] fp32
    q, k = (_expand_heads(x, hv).astype(f32).transpose(0, 2, 1, 3) for x in (query, key))
    q = q * scale
    v = value.astype(f32).transpose(0, 2, 1, 3)
    g, beta = (x.astype(f32).transpose(0, 2, 1) for x in (g, beta))
    # Canonical segment index (0, 1, 2, ... per row), [B, T]; None when nothing is packed.
    seg = None if segment_ids is None else jnp.cumsum(segment_starts(segment_ids), axis=1)

    # Pad T to a multiple of C. Padded steps have k = v = 0, beta = 0, g = 0: they neither write
    # to nor decay the state, so the final state is exact. Padded segment ids repeat the last.
    pad = (-t) % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        if seg is not None:
            seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // c
    q, k, v = (x.reshape(b, hv, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, hv, n, c) for x in (g, beta))

    cum = jnp.cumsum(g, axis=-1)  # log decay from chunk start to position i (inclusive)
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    strictly_lower = jnp.tril(jnp.ones((c, c), dtype=bool), -1)
    if seg is None:
        same = causal                                   # [C, C]
        carry = jnp.ones((1, 1, 1, c), dtype=bool)       # position i still sees the carried state
        last_same = jnp.ones((1, 1, 1, c), dtype=bool)   # position j is in the chunk's last segment
    else:
        sc = seg.reshape(b, 1, n, c)
        first = jnp.concatenate([seg[:, :1], seg[:, c - 1 : -1 : c]], axis=1)  # segment before each chunk
        same = causal & (sc[..., :, None] == sc[..., None, :])            # [B, 1, N, C, C]
        carry = sc == first.reshape(b, 1, n, 1)
        last_same = sc == sc[..., -1:]
    # Mask before exp: the upper triangle would overflow (cum_i - cum_j > 0 for j > i).
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)   # [B, H, N, C, C]

    k_beta = k * beta[..., None]
    mm = _mm
    # UT transform: (I + L) [u | w] = [v beta | k beta exp(cum)], L strictly lower.
    lower = jnp.where(strictly_lower, mm(k_beta, jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * (jnp.exp(cum) * carry)[..., None]], axis=-1)
    solved = solve_unit_lower(lower, rhs)
    u, w = solved[..., :dv], solved[..., dv:]

    intra = mm(q, jnp.swapaxes(k, -1, -2)) * decay                       # [B, H, N, C, C]
    q_decayed = q * (jnp.exp(cum) * carry)[..., None]
    k_decayed = k * (jnp.exp(cum[..., -1:] - cum) * last_same)[..., None]
    state_decay = (jnp.exp(cum[..., -1]) * carry[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(state: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        u_i, w_i, q_i, k_i, attn_i, decay_i = xs
        v_new = u_i - mm(w_i, state)
        out = mm(q_i, state) + mm(attn_i, v_new)
        state = state * decay_i + mm(jnp.swapaxes(k_i, -1, -2), v_new)
        return state, out

    state0 = jnp.zeros((b, hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    xs = tuple(map(chunk_major, (u, w, q_decayed, k_decayed, intra, state_decay)))
    final_state, out = jax.lax.scan(step, state0, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, hv, n * c, dv)[:, :, :t]
    return out.transpose(0, 2, 1, 3).astype(out_dtype), final_state


def gated_delta_step(
    query: Array, key: Array, value: Array, g: Array, beta: Array, state: Array, *, scale: float | None = None
) -> tuple[Array, Array]:
    """One recurrence step. query/key [B, Hk, Dk], value [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv]."""
    hv = value.shape[1]
    groups = hv // key.shape[1]
    f32 = jnp.float32
    q, k = (jnp.repeat(x, groups, axis=1).astype(f32) if groups > 1 else x.astype(f32) for x in (query, key))
    q = q * (key.shape[-1] ** -0.5 if scale is None else scale)
    state = state.astype(f32) * jnp.exp(g.astype(f32))[..., None, None]
    predicted = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_HIGHEST)
    delta = (value.astype(f32) - predicted) * beta.astype(f32)[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("bhkv,bhk->bhv", state, q, precision=_HIGHEST)
    return out.astype(value.dtype), state


def recurrent_gated_delta_rule(
    query: Array,
    key: Array,
    value: Array,
    g: Array,
    beta: Array,
    *,
    initial_state: Array | None = None,
    segment_ids: Array | None = None,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """Step-by-step form of `chunk_gated_delta_rule` (same arguments and results)."""
    _check_shapes(query, key, value, g, beta, initial_state)
    b, t, _, dk = key.shape
    hv, dv = value.shape[2:]
    state0 = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state
    starts = jnp.zeros((b, t), bool) if segment_ids is None else segment_starts(segment_ids)

    def step(state: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        q_t, k_t, v_t, g_t, beta_t, start_t = xs
        state = jnp.where(start_t[:, None, None, None], 0.0, state)
        out, state = gated_delta_step(q_t, k_t, v_t, g_t, beta_t, state, scale=scale)
        return state, out

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (query, key, value, g, beta, starts)))
    final_state, out = jax.lax.scan(step, state0.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1), final_state


def causal_conv1d(
    x: Array, weight: Array, *, state: Array | None = None, segment_ids: Array | None = None
) -> tuple[Array, Array]:
    """Depthwise causal conv (no bias, no activation), as a sum of K shifted products.

    x: [B, T, C]; weight: [C, K] (torch Conv1d weight [C, 1, K] squeezed); state: [B, K-1, C],
    the inputs preceding x (zeros if None). With segment_ids, taps reaching into an earlier
    segment are dropped. Returns (y [B, T, C], new state = last K-1 inputs [B, K-1, C]).
    For K = 4 the explicit sum beats lax.conv's grouped convolution on CPU and is as good elsewhere.
    """
    b, t, ch = x.shape
    if weight.ndim != 2 or weight.shape[0] != ch:
        raise ValueError(f"weight must be [C={ch}, K]; got {weight.shape}")
    width = weight.shape[1]
    if state is None:
        state = jnp.zeros((b, width - 1, ch), x.dtype)
    elif state.shape != (b, width - 1, ch):
        raise ValueError(f"state must be {(b, width - 1, ch)}; got {state.shape}")
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, T + K - 1, C]
    if segment_ids is not None:
        seg = jnp.cumsum(segment_starts(segment_ids), axis=1)
        seg = jnp.pad(seg, ((0, 0), (width - 1, 0)))  # the state belongs to the first segment
    y = jnp.zeros((b, t, ch), jnp.promote_types(x.dtype, weight.dtype))
    for tap in range(width):
        term = padded[:, tap : tap + t] * weight[:, tap]
        if segment_ids is not None:
            term = jnp.where((seg[:, tap : tap + t] == seg[:, width - 1 :])[..., None], term, 0)
        y = y + term
    return y.astype(x.dtype), padded[:, t:]
