"""The trainers' head + log-prob loss (``token_logprobs``) against autodiff of the same chunked loss.

``caper_jax.policy.logprobs.token_logprobs`` computes ``log softmax(h @ W)[y]`` a chunk of positions
at a time and has a hand-written backward (a ``custom_vjp``). The reference, measured in the same
run, is what it replaced: ``jax.value_and_grad`` of a ``jax.checkpoint``-ed chunk function under
``lax.map`` (same chunks, same recomputation of the logits in the backward, autodiff's cotangent).
The custom VJP runs twice: recomputing the logits in the backward (``keep_logits_bytes=0``, what
the 9B head does) and keeping them (what ``token_logprobs`` does by default where the fp32 logits
fit its 1 GiB bound, as they do here). All are timed on value and gradients of ``-mean(logp)`` and
checked to agree; the roofline is the head GEMMs each needs at the fp32 GEMM rate measured here:
four with the recomputation (forward, recomputed forward, hidden and head gradients), three without.

    python bench/head_loss.py                    # B=4, T=511, H=512, V=32000 (bench/model.py's head)
    python bench/head_loss.py --vocab 151936     # a larger vocabulary

The load average is printed at start and end (bench/_common.py); a loaded run marks its ratios.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import alternating_min_time, median_time, start_load_check  # noqa: E402
from caper_jax.policy.logprobs import token_logprobs  # noqa: E402


def autodiff_chunked_logprobs(hidden, head, targets, chunk_size):
    """The reference: the same chunking, the chunk remat-ed and differentiated by JAX."""
    batch, length, width = hidden.shape
    chunks = -(-length // chunk_size)
    padding = chunks * chunk_size - length
    hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0))).reshape(batch, chunks, chunk_size, width).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, padding))).reshape(batch, chunks, chunk_size).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(h, y):
        logits = jnp.einsum("bch,hv->bcv", h, head, preferred_element_type=jnp.float32)
        return jnp.take_along_axis(logits, y[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)

    logp = jax.lax.map(lambda xs: chunk(*xs), (hidden, targets))
    return logp.swapaxes(0, 1).reshape(batch, chunks * chunk_size)[:, :length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=511)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--chunk_size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    load = start_load_check()
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (args.batch, args.length, args.hidden))
    head = jax.random.normal(keys[1], (args.hidden, args.vocab)) * 0.02
    targets = jax.random.randint(keys[2], (args.batch, args.length), 0, args.vocab)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda h, w: -fn(h, w, targets, args.chunk_size).mean(), argnums=(0, 1)))

    variants = {
        "recomputed": loss(lambda h, w, y, c: token_logprobs(h, w, y, c, keep_logits_bytes=0)),
        "kept": loss(lambda h, w, y, c: token_logprobs(h, w, y, c, keep_logits_bytes=1 << 62)),
        "autodiff": loss(autodiff_chunked_logprobs),
    }
    results = {name: fn(hidden, head) for name, fn in variants.items()}
    ref_loss, ref_grads = results["autodiff"]
    for name in ("recomputed", "kept"):
        fused_loss, fused_grads = results[name]
        grad_diff = max(float(jnp.abs(a - b).max()) for a, b in zip(fused_grads, ref_grads))
        print(f"{name} vs autodiff: |loss diff| {float(abs(fused_loss - ref_loss)):.2e}, max |grad diff| {grad_diff:.2e}")

    size = 2048
    a = jax.random.normal(keys[0], (size, size))
    square = jax.jit(lambda x: x @ x)
    jax.block_until_ready(square(a))
    gemm_rate = 2 * size**3 / median_time(lambda: jax.block_until_ready(square(a)), args.repeats)

    best = alternating_min_time({name: lambda fn=fn: jax.block_until_ready(fn(hidden, head))
                                 for name, fn in variants.items()}, args.repeats)
    load.finish()

    gemm_flops = 2 * args.batch * args.length * args.hidden * args.vocab
    gemms = {"recomputed": 4, "kept": 3, "autodiff": 4}
    print(f"head loss B={args.batch} T={args.length} H={args.hidden} V={args.vocab} chunk {args.chunk_size}; "
          f"fp32 GEMM {size}^3: {gemm_rate / 1e9:.0f} GFLOP/s, one head GEMM {gemm_flops / 1e9:.1f} GFLOP "
          f"-> {gemm_flops / gemm_rate:.3f} s")
    for name, seconds in best.items():
        floor = gemms[name] * gemm_flops / gemm_rate
        print(f"value+grad, {name}: {seconds:.3f} s, {gemms[name]} head GEMMs, {floor / seconds:.0%} of their floor")
    print("custom VJP recomputing the logits against autodiff: "
          + load.mark(f"speed-up {best['autodiff'] / best['recomputed']:.2f}x"))
    print("custom VJP keeping the logits against recomputing them: "
          + load.mark(f"speed-up {best['recomputed'] / best['kept']:.2f}x"))


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
