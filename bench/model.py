"""caper_jax vs transformers (PyTorch) on CPU: LM train step and greedy decoding, same weights.

One run, two processes: JAX in this one, PyTorch in bench/_torch_worker.py (so the JAX side runs as a
trainer does, in a process that never imported PyTorch), driven in lockstep so that every figure
shares the machine state. The model is the ~58M-parameter
Qwen3.5-architecture config of ENV.md (hidden 512, 8 layers = 2 groups of 3 DeltaNet + 1 attention,
attention 8 q / 2 kv heads of 64, DeltaNet 4 qk / 8 v heads of 64, MLP 1408, vocab 32000), fp32.
transformers builds it with random weights, saves it, and caper_jax loads that checkpoint via
``from_hf``, so both sides compute the same function (the script prints the loss difference and the
greedy-token agreement as a check).

  * train: forward + backward of the mean next-token cross-entropy on a 4 × 512 batch (no optimizer
    update on either side); median wall time of ``--repeats`` runs after one warm-up (JAX: compile),
    JAX and PyTorch alternating so that both see the same background load (the 2-core machine is
    shared; the side not running waits on a pipe), each timed run right after an untimed one of its
    own side (``--settle``; see ``interleaved``); each process's CPU seconds are printed too.
  * decode: greedy, batch 8, 64-token prompts, exactly ``--new_tokens`` new tokens (no stop token);
    new tokens per second.
  * roofline: an fp32 GEMM timed with both libraries; the faster rate bounds any fp32 step, and
    the train step's matmul FLOPs (counted on its jaxpr) divided by it is the step's floor.
  * decode roofline: at batch 8 a decode step is a row of matrix-vector products, bound by memory,
    not FLOPs: every step reads every weight it multiplies (all but the untied input embedding, of
    which it gathers 8 rows) and the whole cache (attention runs over all its slots), and writes the
    recurrent states. Those bytes over the faster streaming rate (a jitted / torch sum over 512 MiB,
    far beyond the caches) are the step's floor.

    python bench/model.py            # about 5 minutes on 2 cores

The load average is printed at start and end; a run on a machine that was not quiet (bench/_common.py:
1-min load above half the cores at start, or above this benchmark's threads + half the cores at end)
prints its ratios with "LOADED (not comparable)" after them.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench._common import median_time, start_load_check, wall_and_cpu_s  # noqa: E402
from caper_jax.models import Qwen35Config, from_hf  # noqa: E402
from caper_jax.models.sampler import SamplingConfig, generate  # noqa: E402
from caper_jax.parallel.dry_run import jaxpr_matmul_flops  # noqa: E402
from caper_jax.policy.logprobs import sequence_logprobs  # noqa: E402

BENCH_CONFIG = dict(
    vocab_size=32_000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    max_position_embeddings=4096,
)


class TorchWorker:
    """bench/_torch_worker.py in a process of its own: ``worker.call("gemm", n=2048, repeats=5)``
    runs that method of its ``TorchSide`` there and returns the result (or raises its error here)."""

    def __init__(self, threads: int):
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench._torch_worker", str(child_in), str(child_out), str(threads)],
            pass_fds=(child_in, child_out), cwd=REPO,
        )
        os.close(child_in)
        os.close(child_out)
        self._outbox, self._inbox = os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb")

    def call(self, command: str, **kwargs):
        pickle.dump((command, kwargs), self._outbox)
        self._outbox.flush()
        try:
            status, value = pickle.load(self._inbox)
        except EOFError:
            raise RuntimeError(f"the PyTorch worker exited (code {self._process.wait()}) during {command!r}") from None
        if status == "error":
            raise RuntimeError(f"the PyTorch worker failed in {command!r}:\n{value}")
        return value

    def close(self) -> None:
        try:
            pickle.dump(("stop", {}), self._outbox)
            self._outbox.close()
        except BrokenPipeError:
            pass
        self._inbox.close()
        self._process.wait(timeout=60)

    def __enter__(self) -> "TorchWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def interleaved(jax_fn: Callable[[], object], torch_step: Callable[[], tuple[float, float]],
                repeats: int, settle: int = 1) -> dict[str, float]:
    """Median wall and process-CPU seconds of each side, alternating so both see the same load.
    ``torch_step`` runs one step in the worker and returns its own (wall, CPU) seconds.

    Each timed run follows ``settle`` untimed runs of its own side, as in a training loop: on the
    VMs measured here, the first step after the other library's step pays 2-3x the system time for
    the same page faults (the pages the other side just freed; BENCHMARKS.md), which neither library
    pays when it runs alone."""
    samples: dict[str, list[float]] = {"jax_s": [], "torch_s": [], "jax_cpu_s": [], "torch_cpu_s": []}
    for _ in range(repeats):
        for _ in range(settle):
            jax_fn()
        jax_wall, jax_cpu = wall_and_cpu_s(jax_fn)
        samples["jax_s"].append(jax_wall)
        samples["jax_cpu_s"].append(jax_cpu)
        for _ in range(settle):
            torch_step()
        torch_wall, torch_cpu = torch_step()
        samples["torch_s"].append(torch_wall)
        samples["torch_cpu_s"].append(torch_cpu)
    return {k: statistics.median(v) for k, v in samples.items()}


def gemm_rate(worker: TorchWorker, n: int, repeats: int) -> dict[str, float]:
    """fp32 GFLOP/s of an n×n×n matmul in JAX and in PyTorch."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    jax_s = median_time(lambda: matmul(a, a).block_until_ready(), repeats)
    return {"jax": 2.0 * n**3 / jax_s / 1e9, "torch": worker.call("gemm", n=n, repeats=repeats)}


def stream_rate(worker: TorchWorker, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of reading an fp32 array of ``nbytes`` once (its sum) in JAX and in PyTorch."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    jax_s = median_time(lambda: total(x).block_until_ready(), repeats)
    return {"jax": nbytes / jax_s / 1e9, "torch": worker.call("stream", nbytes=nbytes, repeats=repeats)}


def gemv_rate(worker: TorchWorker, batch: int, k: int, n: int, repeats: int) -> dict[str, float]:
    """GB/s of weights read by a [batch, k] x [k, n] fp32 matmul (a decode step's shape) in JAX and PyTorch."""
    x, w = jnp.ones((batch, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(x, w).block_until_ready()
    jax_s = median_time(lambda: matmul(x, w).block_until_ready(), repeats)
    return {"jax": k * n * 4 / jax_s / 1e9, "torch": worker.call("gemv", batch=batch, k=k, n=n, repeats=repeats)}


def decode_step_bytes(jax_model, batch: int, max_len: int) -> int:
    """Bytes one decode step must move at least: the weights it multiplies, the cache it reads, the
    recurrent (DeltaNet) and conv states it writes back (module docstring)."""
    def nbytes(x) -> int:
        return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize

    weights = sum(map(nbytes, jax.tree.leaves(nnx.state(jax_model, nnx.Param))))
    if not jax_model.config.tie_word_embeddings:   # the input embedding: `batch` rows gathered, not read
        vocab, hidden = jax_model.embed_tokens.shape
        weights -= (vocab - batch) * hidden * jnp.dtype(jax_model.embed_tokens.dtype).itemsize
    cache = jax.eval_shape(lambda: jax_model.init_cache(batch, max_len))
    read = sum(map(nbytes, jax.tree.leaves(cache.blocks)))
    written = sum(nbytes(x) for block in cache.blocks for name, x in block.items() if name in ("recurrent", "conv"))
    return weights + read + written


def build_models(worker: TorchWorker, tmp: str, seed: int):
    """transformers builds the model with random weights in the worker and saves it to ``tmp``;
    caper_jax loads that checkpoint. Returns (the JAX model, the parameter count)."""
    config = Qwen35Config(**BENCH_CONFIG)
    n_params = worker.call("build", path=tmp, config=config.to_hf_dict(), seed=seed)
    jax_model, _ = from_hf(tmp, dtype="float32")
    return jax_model, n_params


LOSSES = ("logits", "chunked")


def make_train_step(jax_model, loss: str = "logits", chunk_size: int = 128) -> tuple[Callable, nnx.State]:
    """The benchmarked JAX step: jitted (loss, grads) of the mean next-token cross-entropy, and the
    model's state to pass it (``step(state, ids)``); shared with bench/profile_step.py.

    ``loss="logits"``: the [B, T, V] logits, then cross-entropy on ``logits[:, :-1]`` (what
    transformers' ``labels=`` loss does). ``loss="chunked"``: the path the SFT and PRM trainers take
    (``caper_jax.policy.logprobs.sequence_logprobs``): the head on the first T-1 hidden states only, a
    ``chunk_size``-position chunk at a time, each chunk's logits recomputed in the backward instead
    of kept. The same function: both losses agree to fp32 rounding (main prints the difference).
    """
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}; expected one of {LOSSES}")
    graphdef, state = nnx.split(jax_model)

    def loss_fn(state, ids):
        model = nnx.merge(graphdef, state)
        if loss == "chunked":
            return -sequence_logprobs(model, ids, jnp.ones_like(ids), chunk_size=chunk_size).mean()
        logits = model(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss_fn)), state


def bench_train(worker: TorchWorker, jax_model, ids: np.ndarray, repeats: int, loss: str = "logits",
                settle: int = 1) -> dict[str, float]:
    step, state = make_train_step(jax_model, loss)
    ids_jax = jnp.asarray(ids)
    start = time.perf_counter()
    jax_loss, _ = jax.block_until_ready(step(state, ids_jax))
    compile_s = time.perf_counter() - start
    flops = jaxpr_matmul_flops(step.trace(state, ids_jax).jaxpr.jaxpr)

    torch_loss = worker.call("train_prepare", ids=ids)
    times = interleaved(lambda: jax.block_until_ready(step(state, ids_jax)), lambda: worker.call("train_step"),
                        repeats, settle)
    worker.call("train_finish")
    return {**times, "jax_compile_s": compile_s, "matmul_flops": flops, "loss_diff": abs(float(jax_loss) - torch_loss)}


def bench_decode(worker: TorchWorker, jax_model, prompts: np.ndarray, new_tokens: int, repeats: int,
                 settle: int = 1) -> dict[str, float]:
    config = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)
    ids_jax, mask_jax = jnp.asarray(prompts), jnp.ones(prompts.shape, jnp.int32)

    def jax_generate():
        return jax.block_until_ready(generate(jax_model, ids_jax, mask_jax, jax.random.key(0), config))

    start = time.perf_counter()
    jax_out = jax_generate()
    compile_s = time.perf_counter() - start

    torch_tokens = worker.call("decode_prepare", prompts=prompts, new_tokens=new_tokens)
    times = interleaved(jax_generate, lambda: worker.call("decode"), repeats, settle)
    generated = prompts.shape[0] * new_tokens
    agree = float(np.mean(np.asarray(jax_out.tokens) == torch_tokens))
    return {
        **times, "jax_tok_s": generated / times["jax_s"], "torch_tok_s": generated / times["torch_s"],
        "jax_compile_s": compile_s, "token_agreement": agree,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--settle", type=int, default=1,
                        help="untimed runs of a side before each of its timed runs (0: strict alternation)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    load = start_load_check(own=args.threads)   # JAX and PyTorch both keep every thread busy
    with TorchWorker(args.threads) as worker:
        torch_version = worker.call("version")
        rates = gemm_rate(worker, 2048, 5)
        streams = stream_rate(worker, 512 * 2**20, 5)
        # The LM head's shape at decode: the largest of a step's matrix-vector products.
        gemvs = gemv_rate(worker, 8, BENCH_CONFIG["hidden_size"], BENCH_CONFIG["vocab_size"], 7)
        with tempfile.TemporaryDirectory() as tmp:
            jax_model, n_params = build_models(worker, tmp, seed=0)
        train_ids = rng.integers(0, BENCH_CONFIG["vocab_size"], (4, 512), dtype=np.int32)
        train = bench_train(worker, jax_model, train_ids, args.repeats, settle=args.settle)
        # The trainers' loss path on the same batch, against PyTorch again (alternating, same load).
        chunked = bench_train(worker, jax_model, train_ids, args.repeats, loss="chunked", settle=args.settle)
        prompts = rng.integers(1, BENCH_CONFIG["vocab_size"], (8, 64), dtype=np.int32)
        decode = bench_decode(worker, jax_model, prompts, args.new_tokens, args.repeats, settle=args.settle)

    peak = max(rates.values())
    floor_s = train["matmul_flops"] / (peak * 1e9)
    stream_peak = max(streams.values())
    step_bytes = decode_step_bytes(jax_model, prompts.shape[0], prompts.shape[1] + args.new_tokens)
    decode_floor_tok_s = prompts.shape[0] / (step_bytes / (stream_peak * 1e9))
    load.finish()
    mark = load.mark
    print(f"jax {jax.__version__} / torch {torch_version}, {args.threads} threads (each process), "
          f"{os.cpu_count()} CPUs, {n_params / 1e6:.1f}M params, fp32, {args.settle} untimed run(s) of a side "
          f"before each timed one; "
          f"load average at start {load.start[0]:.2f}, at end {load.end[0]:.2f}")
    print(f"fp32 GEMM 2048^3: jax {rates['jax']:.0f} GFLOP/s, torch {rates['torch']:.0f} GFLOP/s")
    print(f"train 4x512 fwd+bwd: jax {train['jax_s']:.3f} s, torch {train['torch_s']:.3f} s, "
          f"ratio jax/torch {mark(format(train['jax_s'] / train['torch_s'], '.2f'))} (target <= 0.6); process CPU s: "
          f"jax {train['jax_cpu_s']:.2f}, torch {train['torch_cpu_s']:.2f}; "
          f"jax compile {train['jax_compile_s']:.1f} s; |loss diff| {train['loss_diff']:.2e}")
    print(f"train roofline: {train['matmul_flops'] / 1e9:.1f} GFLOP matmul -> floor {floor_s:.3f} s at "
          f"{peak:.0f} GFLOP/s; jax at {mark(format(floor_s / train['jax_s'], '.0%'))} of it, "
          f"torch at {mark(format(floor_s / train['torch_s'], '.0%'))}")
    print(f"train 4x512 fwd+bwd, the trainers' chunked loss (policy.logprobs.sequence_logprobs): jax "
          f"{chunked['jax_s']:.3f} s, torch {chunked['torch_s']:.3f} s, ratio jax/torch "
          f"{mark(format(chunked['jax_s'] / chunked['torch_s'], '.2f'))}; jax at "
          f"{mark(format(floor_s / chunked['jax_s'], '.0%'))} of the roofline (the full-logits step's "
          f"matmul FLOPs); |loss diff| {chunked['loss_diff']:.2e}")
    print(f"greedy decode 8x{args.new_tokens}: jax {decode['jax_tok_s']:.0f} tok/s, torch "
          f"{decode['torch_tok_s']:.0f} tok/s, ratio {mark(format(decode['jax_tok_s'] / decode['torch_tok_s'], '.2f'))} "
          f"(target >= 3); process CPU s: jax {decode['jax_cpu_s']:.2f}, torch {decode['torch_cpu_s']:.2f}; "
          f"jax compile {decode['jax_compile_s']:.1f} s; greedy token agreement "
          f"{decode['token_agreement']:.1%}")
    print(f"decode roofline: {step_bytes / 1e6:.0f} MB per step at {stream_peak:.1f} GB/s (fp32 read: jax "
          f"{streams['jax']:.1f}, torch {streams['torch']:.1f}) -> at most {decode_floor_tok_s:.0f} tok/s; jax at "
          f"{mark(format(decode['jax_tok_s'] / decode_floor_tok_s, '.0%'))} of it, torch at "
          f"{mark(format(decode['torch_tok_s'] / decode_floor_tok_s, '.0%'))}; the 3x target "
          f"({3 * decode['torch_tok_s']:.0f} tok/s) is {3 * decode['torch_tok_s'] / decode_floor_tok_s:.2f}x the floor's rate")
    gemv_cap = prompts.shape[0] / (step_bytes / (gemvs["jax"] * 1e9))
    print(f"decode GEMV [8,{BENCH_CONFIG['hidden_size']}]x[{BENCH_CONFIG['hidden_size']},{BENCH_CONFIG['vocab_size']}]: "
          f"jax {gemvs['jax']:.1f} GB/s, torch {gemvs['torch']:.1f} GB/s of weights; at jax's rate a step's bytes "
          f"cap decode at {gemv_cap:.0f} tok/s (jax at {mark(format(decode['jax_tok_s'] / gemv_cap, '.0%'))} of that)")


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
