"""The gated delta rule and causal conv against independent references.

References: a naive per-step recurrence written in numpy (the DeltaNet equations, nothing shared
with the code under test), numpy's dense linear solve, transformers' PyTorch reference kernels
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) and torch's grouped conv1d.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from caper_jax.ops import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from caper_jax.ops.gated_delta import solve_unit_lower

# fp32, outputs and states of order 1: two algorithms (chunked solve vs recurrence over T = 150
# steps) each round at eps = 1.2e-7 per op; ~100 eps = 1.2e-5 covers the recurrence's error growth
# over T steps (observed ~1/10 of it), while a wrong gate or decay is off by 1e-2 or more.
ATOL = 1e-5
T = 150      # > 2 chunks of 64 and not a multiple of 64; one shape so each program compiles once

chunked = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")
recurrent = jax.jit(recurrent_gated_delta_rule)


def naive_gated_delta(q, k, v, g, beta, state=None, starts=None):
    """Per-step numpy recurrence: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q / sqrt(d)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    rep = hv // hk
    q, k = np.repeat(q, rep, axis=2).astype(np.float64), np.repeat(k, rep, axis=2).astype(np.float64)
    s = np.zeros((b, hv, dk, dv)) if state is None else state.astype(np.float64).copy()
    out = np.zeros((b, t, hv, dv))
    for i in range(t):
        for row in range(b):
            if starts is not None and starts[row, i]:
                s[row] = 0.0
        s = s * np.exp(g[:, i])[..., None, None]
        predicted = np.einsum("bhkv,bhk->bhv", s, k[:, i])
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i][..., None] * (v[:, i] - predicted))
        out[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i] / np.sqrt(dk))
    return out, s


def random_inputs(seed, b=2, t=150, hk=2, hv=4, dk=16, dv=8):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = unit(rng.normal(size=(b, t, hk, dk))).astype(np.float32)
    k = unit(rng.normal(size=(b, t, hk, dk))).astype(np.float32)
    v = rng.normal(size=(b, t, hv, dv)).astype(np.float32)
    g = (-0.5 * np.exp(rng.normal(size=(b, t, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))).astype(np.float32)
    state = rng.normal(size=(b, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def test_chunked_and_recurrent_match_naive_recurrence():
    q, k, v, g, beta, state = random_inputs(0, t=T)
    expected_out, expected_state = naive_gated_delta(q, k, v, g, beta, state)
    for fn in (chunked, recurrent):
        out, final = fn(q, k, v, g, beta, initial_state=state)
        np.testing.assert_allclose(np.asarray(out), expected_out, atol=ATOL, err_msg=fn.__name__)
        np.testing.assert_allclose(np.asarray(final), expected_state, atol=ATOL, err_msg=fn.__name__)
    assert np.abs(expected_out).max() > 0.2  # the comparison is not between near-zero tensors


def test_small_chunk_size_matches_naive():
    """Many chunks (and a chunk size that is not a multiple of the 16-row solve block)."""
    q, k, v, g, beta, _ = random_inputs(1, t=77)
    expected_out, expected_state = naive_gated_delta(q, k, v, g, beta)
    out, final = chunked(q, k, v, g, beta, chunk_size=24)
    np.testing.assert_allclose(np.asarray(out), expected_out, atol=ATOL)
    np.testing.assert_allclose(np.asarray(final), expected_state, atol=ATOL)


def test_matches_transformers_reference_kernels():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    rng = np.random.default_rng(2)
    _, _, v, g, beta, state = random_inputs(2)
    raw_q, raw_k = (rng.normal(size=(2, T, 2, 16)).astype(np.float32) for _ in range(2))
    tt = torch.from_numpy
    q, k = l2_normalize(raw_q), l2_normalize(raw_k)  # transformers normalises inside its kernels
    ours_chunk = chunked(q, k, v, g, beta, initial_state=state)
    ours_rec = recurrent(q, k, v, g, beta, initial_state=state)
    kwargs = dict(initial_state=tt(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunk = torch_chunk_gated_delta_rule(tt(raw_q), tt(raw_k), tt(v), tt(g), tt(beta), **kwargs)
    ref_rec = torch_recurrent_gated_delta_rule(tt(raw_q), tt(raw_k), tt(v), tt(g), tt(beta), **kwargs)
    for ours, ref in ((ours_chunk, ref_chunk), (ours_rec, ref_rec), (ours_chunk, ref_rec)):
        np.testing.assert_allclose(np.asarray(ours[0]), ref[0].numpy(), atol=ATOL)
        np.testing.assert_allclose(np.asarray(ours[1]), ref[1].numpy(), atol=ATOL)


def test_segment_ids_restart_the_state():
    """Packed rows equal each segment run on its own (the initial state belongs to segment one)."""
    q, k, v, g, beta, state = random_inputs(3, t=T)
    segment_ids = np.zeros((2, T), np.int32)
    segment_ids[0, 40:], segment_ids[0, 100:] = 1, 2        # starts inside chunks
    segment_ids[1, 64:], segment_ids[1, 65:] = 5, 3         # a start on a chunk boundary, a 1-token segment
    starts = np.zeros((2, T), bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    expected_out, expected_state = naive_gated_delta(q, k, v, g, beta, state, starts)
    for fn in (chunked, recurrent):
        out, final = fn(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids)
        np.testing.assert_allclose(np.asarray(out), expected_out, atol=ATOL, err_msg=fn.__name__)
        np.testing.assert_allclose(np.asarray(final), expected_state, atol=ATOL, err_msg=fn.__name__)
    # Independent of the naive code: the last segment of row 0 equals a fresh run on it.
    alone, _ = naive_gated_delta(q[:1, 100:], k[:1, 100:], v[:1, 100:], g[:1, 100:], beta[:1, 100:])
    np.testing.assert_allclose(np.asarray(out)[:1, 100:], alone, atol=ATOL)


def test_step_continues_a_chunked_prefix():
    """Decoding: one recurrent step from the chunked form's final state extends the sequence."""
    q, k, v, g, beta, state = random_inputs(4, t=T + 1)
    expected_out, expected_state = naive_gated_delta(q, k, v, g, beta, state)
    _, prefix_state = chunked(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], initial_state=state)
    out, final = gated_delta_step(q[:, T], k[:, T], v[:, T], g[:, T], beta[:, T], prefix_state)
    np.testing.assert_allclose(np.asarray(out), expected_out[:, T], atol=ATOL)
    np.testing.assert_allclose(np.asarray(final), expected_state, atol=ATOL)


@pytest.mark.parametrize("c", [64, 24])
def test_blocked_unit_lower_solve_matches_numpy(c):
    rng = np.random.default_rng(5)
    lower = np.tril(rng.normal(size=(3, c, c)) * 0.3, -1).astype(np.float32)
    rhs = rng.normal(size=(3, c, 5)).astype(np.float32)
    expected = np.linalg.solve(np.eye(c) + lower.astype(np.float64), rhs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(solve_unit_lower(lower, rhs)), expected, rtol=1e-4, atol=1e-4)


def test_solve_gradient_matches_closed_form():
    """Autodiff through the blocked solve vs the closed-form VJP of X = (I + L)^-1 R in numpy:
    dR = (I + L)^-T W, dL = -strictly_lower(dR X^T), for the objective sum(W * X)."""
    rng = np.random.default_rng(9)
    lower = np.tril(rng.normal(size=(2, 32, 32)) * 0.3, -1)
    rhs, weights = rng.normal(size=(2, 32, 3)), rng.normal(size=(2, 32, 3))
    system = np.eye(32) + lower
    solution = np.linalg.solve(system, rhs)
    d_rhs = np.linalg.solve(np.swapaxes(system, -1, -2), weights)
    d_lower = -np.tril(d_rhs @ np.swapaxes(solution, -1, -2), -1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = jax.grad(lambda l, r: jnp.sum(solve_unit_lower(l, r) * f32(weights)), argnums=(0, 1))(f32(lower), f32(rhs))
    np.testing.assert_allclose(np.tril(np.asarray(got[0]), -1), d_lower, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1]), d_rhs, rtol=1e-4, atol=1e-4)


def test_causal_conv_matches_torch_and_streams():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 37, 12)).astype(np.float32)
    w = rng.normal(size=(12, 4)).astype(np.float32)
    expected = torch.nn.functional.conv1d(
        torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w)[:, None], padding=3, groups=12
    )[:, :, :37].transpose(1, 2).numpy()
    y, state = causal_conv1d(x, w)
    np.testing.assert_allclose(np.asarray(y), expected, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(state), x[:, -3:])
    # Streaming: a prefix, then one token at a time through the carried state.
    y1, state = causal_conv1d(x[:, :30], w)
    pieces = [np.asarray(y1)]
    for i in range(30, 37):
        yi, state = causal_conv1d(x[:, i : i + 1], w, state=state)
        pieces.append(np.asarray(yi))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), expected, atol=ATOL)


def test_causal_conv_segments_do_not_mix():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(1, 20, 6)).astype(np.float32)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    segment_ids = np.array([[0] * 9 + [1] * 11])
    y, _ = causal_conv1d(x, w, segment_ids=segment_ids)
    first, _ = causal_conv1d(x[:, :9], w)
    second, _ = causal_conv1d(x[:, 9:], w)
    np.testing.assert_allclose(np.asarray(y), np.concatenate([first, second], axis=1), atol=ATOL)


def test_bad_shapes_raise():
    q, k, v, g, beta, state = random_inputs(8, t=10)
    with pytest.raises(ValueError, match="g and beta"):
        chunk_gated_delta_rule(q, k, v, g[:, :5], beta)
    with pytest.raises(ValueError, match="multiple of Hk"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state[:, :2])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(v[..., 0], np.zeros((3, 4), np.float32))
