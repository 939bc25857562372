"""token_logprobs against a full-softmax reference (values, entropy, gradients) and its memory."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.policy.logprobs import token_logprobs
from tests.helpers import simulated_devices_env


def numpy_logprobs(hidden, head, targets, temperature=1.0):
    """float64 full softmax: log-probs of targets and entropies."""
    logits = np.einsum("bth,hv->btv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
    logits /= temperature
    top = logits.max(-1, keepdims=True)
    log_norm = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    logp_all = logits - log_norm[..., None]
    logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    return logp, -(np.exp(logp_all) * logp_all).sum(-1)


def naive_jax(hidden, head, targets):
    logp_all = jax.nn.log_softmax(hidden @ head, axis=-1)
    return jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]


def problem(b=2, t=13, h=16, v=300, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k[0], (b, t, h), dtype)
    head = (jax.random.normal(k[1], (h, v)) * 0.5).astype(dtype)
    targets = jax.random.randint(k[2], (b, t), 0, v)
    return hidden, head, targets


@pytest.mark.parametrize("chunk_size", [5, 13, 64])  # T = 13: uneven, exact, chunk > T
def test_values_and_entropy_match_full_softmax(chunk_size):
    hidden, head, targets = problem()
    logp, entropy = token_logprobs(hidden, head, targets, chunk_size, return_entropy=True)
    ref_logp, ref_entropy = numpy_logprobs(hidden, head, targets)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), ref_entropy, rtol=1e-5, atol=1e-5)


def test_tied_embedding_and_temperature():
    hidden, head, targets = problem(seed=1)
    tied = token_logprobs(hidden, head.T, targets, 5, tied=True, temperature=0.7)
    ref, _ = numpy_logprobs(hidden, head, targets, temperature=0.7)
    np.testing.assert_allclose(np.asarray(tied), ref, rtol=1e-5, atol=1e-5)


# keep_logits_bytes: 0 recomputes each chunk's logits in the backward; the default keeps these small ones.
KEEP, RECOMPUTE = {}, {"keep_logits_bytes": 0}


@pytest.mark.parametrize("keep", [KEEP, RECOMPUTE], ids=["kept", "recomputed"])
def test_gradients_match_full_softmax(keep):
    hidden, head, targets = problem(seed=2)
    weights = jax.random.normal(jax.random.key(3), targets.shape)  # a non-uniform cotangent

    def loss(fn):
        return lambda h, w: jnp.sum(weights * fn(h, w, targets))

    chunked = jax.grad(loss(lambda h, w, y: token_logprobs(h, w, y, 4, **keep)), argnums=(0, 1))(hidden, head)
    full = jax.grad(loss(naive_jax), argnums=(0, 1))(hidden, head)
    for got, want in zip(chunked, full):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keep", [KEEP, RECOMPUTE], ids=["kept", "recomputed"])
@pytest.mark.parametrize("tied", [False, True])
def test_gradients_of_entropy_tied_and_tempered_match_full_softmax(tied, keep):
    # The backward is hand-written (a custom VJP); autodiff of the plain full softmax is the reference
    # for both outputs' cotangents at once, with a temperature and either head layout.
    hidden, head, targets = problem(seed=5)
    k = jax.random.split(jax.random.key(6), 2)
    w_logp, w_entropy = (jax.random.normal(key, targets.shape) for key in k)
    layout = (lambda w: w.T) if tied else (lambda w: w)

    def full(h, w):
        logp_all = jax.nn.log_softmax(h @ layout(w) / 0.7, axis=-1)
        logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    def chunked(h, w):
        return token_logprobs(h, w, targets, 5, tied=tied, temperature=0.7, return_entropy=True, **keep)

    def loss(fn):
        return lambda h, w: jnp.sum(w_logp * fn(h, w)[0] + w_entropy * fn(h, w)[1])

    w = layout(head)
    for got, want in zip(jax.grad(loss(chunked), argnums=(0, 1))(hidden, w),
                         jax.grad(loss(full), argnums=(0, 1))(hidden, w)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keep", [KEEP, RECOMPUTE], ids=["kept", "recomputed"])
def test_bf16_gradients_keep_the_input_dtypes(keep):
    hidden, head, targets = problem(seed=7, h=64, dtype=jnp.bfloat16)
    grads = jax.grad(lambda h, w: token_logprobs(h, w, targets, 8, **keep).sum(), argnums=(0, 1))(hidden, head)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
    ref = jax.grad(lambda h, w: naive_jax(h, w, targets).sum(), argnums=(0, 1))(
        hidden.astype(jnp.float32), head.astype(jnp.float32))
    for got, want in zip(grads, ref):  # bf16 rounding of the cotangent and the result
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=5e-2, atol=5e-2)


def test_bf16_params_accumulate_in_fp32():
    hidden, head, targets = problem(seed=4, h=64, dtype=jnp.bfloat16)
    logp = token_logprobs(hidden, head, targets, 8)
    assert logp.dtype == jnp.float32
    # Reference: the same bf16 values, multiplied and normalised in float64.
    ref, _ = numpy_logprobs(hidden.astype(jnp.float32), head.astype(jnp.float32), targets)
    np.testing.assert_allclose(np.asarray(logp), ref, rtol=1e-4, atol=1e-4)


def test_backward_memory_is_chunked():
    # V = 32768, B·T = 512: the full fp32 logits alone are 64 MiB; one 32-position chunk is 8 MiB.
    b, t, h, v = 2, 256, 32, 32768
    hidden = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    head = jax.ShapeDtypeStruct((h, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda x, w, y: fn(x, w, y).sum(), argnums=(0, 1)))
        return grad.lower(hidden, head, targets).compile().memory_analysis().temp_size_in_bytes

    full_logits = b * t * v * 4
    naive = temp_bytes(naive_jax)
    # Just below the bound the logits are recomputed; at it, kept (the bound counts every byte).
    chunked = temp_bytes(lambda x, w, y: token_logprobs(x, w, y, 32, keep_logits_bytes=full_logits - 1))
    kept = temp_bytes(lambda x, w, y: token_logprobs(x, w, y, 32, keep_logits_bytes=full_logits))
    assert naive >= full_logits
    assert chunked < full_logits / 2
    assert chunked < naive / 4
    assert kept >= full_logits
    # And the forward jaxpr never holds a [B, T, V] value: the largest logits are one chunk's.
    jaxpr = jax.make_jaxpr(lambda x, w, y: token_logprobs(x, w, y, 32, keep_logits_bytes=0))(hidden, head, targets)
    shapes = [var.aval.shape for eqn in _all_eqns(jaxpr.jaxpr) for var in eqn.outvars]
    assert (b, t, v) not in shapes and (b, 32, v) in shapes


@pytest.mark.parametrize("tied", [False, True])
def test_kept_logits_save_one_head_gemm(tied):
    # Forward + backward of the head: 3 GEMMs with the logits kept (forward, input and weight
    # gradients), 4 when the backward recomputes them; the default bound keeps these small logits.
    hidden, head, targets = problem(seed=8)
    head = head.T if tied else head

    def dots(**keep):
        grad = jax.grad(lambda x, w: token_logprobs(x, w, targets, 5, tied=tied, **keep).sum(), argnums=(0, 1))
        return sum(eqn.primitive.name == "dot_general" for eqn in _all_eqns(jax.make_jaxpr(grad)(hidden, head).jaxpr))

    assert (dots(), dots(**RECOMPUTE)) == (3, 4)


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, descending into scan/remat/jit bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


SHARDED_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from caper_jax.policy.logprobs import token_logprobs
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
k = jax.random.split(jax.random.key(0), 3)
h = jax.random.normal(k[0], (4, 40, 16)); w = jax.random.normal(k[1], (16, 512))
y = jax.random.randint(k[2], (4, 40), 0, 512)
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
hs, ws, ys = put(h, "data"), put(w, None, "tensor"), put(y, "data")
grad = lambda f: jax.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))
out = jax.jit(lambda a, b: token_logprobs(a, b, ys, 16))(hs, ws)
gh, gw = jax.jit(grad(lambda a, b: token_logprobs(a, b, ys, 16)))(hs, ws)
full = lambda a, b: jnp.take_along_axis(jax.nn.log_softmax(a @ b, -1), y[..., None], -1)[..., 0]
rh, rw = grad(full)(h, w)
np.testing.assert_allclose(out, full(h, w), rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(gh, rh, rtol=1e-4, atol=1e-5)
np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-5)
assert out.sharding.spec == P("data") and gw.sharding.spec == P(None, "tensor"), (out.sharding, gw.sharding)
"""


def test_sharded_batch_and_vocab_on_eight_cpu_devices():
    # A fresh process: the simulated device count must be set before jax initialises.
    result = subprocess.run([sys.executable, "-c", SHARDED_CHECK], env=simulated_devices_env(8), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_bad_input_raises():
    hidden, head, targets = problem()
    with pytest.raises(ValueError, match=r"\[H, V\]"):
        token_logprobs(hidden, head.T, targets, 4)
    with pytest.raises(ValueError, match=r"\[V, H\]"):
        token_logprobs(hidden, head, targets, 4, tied=True)
    with pytest.raises(ValueError, match=r"\[H, V\]"):
        token_logprobs(hidden, head[0], targets, 4)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(hidden, head, targets.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, head, targets, 0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_logprobs(hidden, head, targets[:, :3], 4)
