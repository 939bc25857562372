"""The cores' fp32 FMA peak, and XLA's 2048³ GEMM as a share of it: the roofline under the roofline.

bench/model.py takes "the fp32 GEMM roofline" to be JAX's own 2048³ GEMM rate measured in the same
run. This says how far that rate is from what the processor can do at all: a small C loop of
independent FMA chains (12 accumulators, AVX-512 with 16 lanes where the compiler's
``-march=native`` has it, else AVX2 with 8), compiled here with the system's C compiler, runs on
every core at once (one process per core, pinned), and its per-core GFLOP/s add up to the
machine's fp32 peak. It is a wall-clock rate: a core shared with another process shows less, which is
why the load check matters here too. The multiplier and addend come from the command line, so the
compiler cannot fold the loop away; before timing, a 3-round run with acc <- 2·acc + 1 is checked
against its closed form (every lane, every chain), so a kernel that computed something else would be
caught.

    python bench/fma_peak.py                    # the peak, then JAX's 2048³ fp32 GEMM as a share of it
    python bench/fma_peak.py --gemm 0           # the peak only

x86-64 only (the C kernel uses the Intel intrinsics); elsewhere it stops with a message. The load
average is printed at start and end (bench/_common.py); a loaded run marks its share.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import median_time, start_load_check  # noqa: E402

CHAINS = 12   # independent FMA chains (written out in KERNEL): more than latency (4) x pipes (2)

KERNEL = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#if defined(__AVX512F__)
typedef __m512 vec; enum { LANES = 16 };
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec; enum { LANES = 8 };
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
#else
#error "no AVX2 + FMA: this benchmark measures x86-64 FMA only"
#endif
int main(int argc, char **argv) {
    /* acc_j <- acc_j * x + y, from acc_j = j, for `iterations` rounds */
    long iterations = atol(argv[1]);
    float xf = (float)atof(argv[2]), yf = (float)atof(argv[3]);
    vec acc[12];
    for (int j = 0; j < 12; j++) acc[j] = SET1((float)j);
    vec x = SET1(xf), y = SET1(yf);
    double t0 = now();
    /* written out, so that the accumulators stay in registers at -O2 */
#define STEP(j) acc[j] = FMA(acc[j], x, y);
    for (long i = 0; i < iterations; i++) {
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
    }
    double seconds = now() - t0;
    float lanes[LANES]; double sum = 0;
    for (int j = 0; j < 12; j++) { STORE(lanes, acc[j]); for (int l = 0; l < LANES; l++) sum += lanes[l]; }
    printf("lanes=%d seconds=%.6f checksum=%.9g\n", LANES, seconds, sum);
    return 0;
}
"""


def expected_checksum(iterations: int, x: float, y: float, lanes: int) -> float:
    """Sum over chains and lanes of acc_j after ``iterations`` rounds of acc <- acc*x + y from acc_j = j."""
    total = 0.0
    for j in range(CHAINS):
        acc = float(j)
        for _ in range(iterations):
            acc = acc * x + y
        total += lanes * acc
    return total


def build(workdir: str) -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("fma_peak: no C compiler (set CC, or install gcc)")
    source, binary = os.path.join(workdir, "fma.c"), os.path.join(workdir, "fma")
    with open(source, "w") as f:
        f.write(KERNEL)
    proc = subprocess.run([compiler, "-O2", "-march=native", "-o", binary, source], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"fma_peak: the FMA kernel did not compile here ({compiler}):\n{proc.stderr.strip()}")
    return binary


def run_kernel(binary: str, iterations: int, x: float, y: float, cores: list[int]) -> list[dict]:
    """One kernel process per core, all at once (each pinned where the OS allows it)."""
    def pin(core):
        return (lambda: os.sched_setaffinity(0, {core})) if hasattr(os, "sched_setaffinity") else None
    procs = [subprocess.Popen([binary, str(iterations), repr(x), repr(y)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=pin(core)) for core in cores]
    results = []
    for core, proc in zip(cores, procs):
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"fma_peak: the kernel on core {core} exited with {proc.returncode}")
        fields = dict(re.findall(r"(\w+)=(\S+)", out))
        lanes, seconds = int(fields["lanes"]), float(fields["seconds"])
        gflops = iterations * CHAINS * lanes * 2 / max(seconds, 1e-9) / 1e9
        results.append({"core": core, "lanes": lanes, "gflops": gflops, "checksum": float(fields["checksum"])})
    return results


def verify_kernel(binary: str, core: int) -> None:
    """3 rounds of acc <- 2 acc + 1 are exact in fp32: the kernel must give the closed form."""
    (result,) = run_kernel(binary, 3, 2.0, 1.0, [core])
    expected = expected_checksum(3, 2.0, 1.0, result["lanes"])
    if result["checksum"] != expected:
        raise SystemExit(f"fma_peak: the kernel's checksum {result['checksum']:.9g} is not {expected:.9g}: "
                         "it does not compute what it is timed for")


def jax_gemm_gflops(size: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    return 2 * size ** 3 / median_time(lambda: matmul(a, b).block_until_ready(), repeats) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=100_000_000,
                        help="FMA rounds per core (each: 12 vector FMAs); ~1 s per 10^8 on a 3.5 GHz core")
    parser.add_argument("--gemm", type=int, default=2048, help="JAX GEMM size (0: skip)")
    parser.add_argument("--repeats", type=int, default=5, help="GEMM calls timed (median)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")

    check = start_load_check()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as workdir:
        binary = build(workdir)
        verify_kernel(binary, cores[0])
        # x = 1, y = 0: every round is a full FMA whose value stays put (no overflow, no denormals)
        per_core = run_kernel(binary, args.iterations, 1.0, 0.0, cores)
    for r in per_core:
        print(f"core {r['core']}: {r['gflops']:.1f} GFLOP/s fp32 FMA ({r['lanes']} lanes)")
    peak = sum(r["gflops"] for r in per_core)
    print(f"fp32 FMA peak, {len(per_core)} cores at once: {peak:.1f} GFLOP/s")
    result = {"cores": per_core, "peak_gflops": peak}
    if args.gemm:
        gemm = jax_gemm_gflops(args.gemm, args.repeats)
        check.finish()
        share = check.mark(f"{100 * gemm / peak:.1f} % of the FMA peak")
        print(f"JAX {args.gemm}^3 fp32 GEMM: {gemm:.1f} GFLOP/s = {share}")
        result.update(gemm_size=args.gemm, gemm_gflops=gemm, gemm_share=gemm / peak)
    else:
        check.finish()
    result.update(check.as_dict())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    from caper_jax.utils.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()   # XLA:CPU's temporaries in huge pages, as the trainers run (bench/_common.py)
    main()
