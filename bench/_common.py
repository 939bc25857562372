"""What every benchmark in bench/ shares: is the machine quiet enough for its figures to compare?

A benchmark calls ``start_load_check(own=...)`` first thing (before its imports warm the cores) and
``check.finish()`` when its measurements are done, then prints each ratio through ``check.mark``.
One that times JAX on the CPU first re-executes itself as the trainers do
(``caper_jax.utils.host_memory.reexec_with_huge_pages``: XLA:CPU's temporaries in huge pages; its child
processes, the PyTorch worker included, inherit the setting), so that its figures are the trainers';
the load line prints ``GLIBC_TUNABLES``, so that a reader sees which setting a figure had.

The rule (issue #20): the 1-minute load average must not exceed

    at start:  0.5 × cores                 (nothing else may use more than half the machine)
    at end:    own + 0.5 × cores           (the benchmark's own busy threads, plus the same margin)

where ``own`` is how many cores the benchmark itself keeps busy (its processes × threads, at most
the core count; JAX and PyTorch on CPU use every core). Above either bound the run is LOADED: its
ratios are printed with ``LOADED (not comparable)`` after them, and ``as_dict()`` (the JSON lines)
carries ``"loaded": true``. ``CAPER_BENCH_REFUSE_LOADED=1`` makes ``mark`` print
``refused: machine loaded`` instead of the value.

Why these bounds: same-run ratios (JAX vs PyTorch, annotation vs its floor) were measured at load
6–15 on 2 cores (BENCHMARKS.md), where each side got a different, unknown share of the cores; half a
machine of foreign load is the most under which the two sides still see mostly idle cores. The
1-minute average lags by about a minute, so a benchmark shorter than that is judged mostly on the
start value.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable

QUIET_SHARE = 0.5        # foreign load allowed, as a share of the cores
LOADED_MARK = "LOADED (not comparable)"


@dataclasses.dataclass
class LoadCheck:
    own: float                                   # cores the benchmark itself keeps busy
    cores: int
    start: tuple[float, float, float]
    end: tuple[float, float, float] | None = None
    print_fn: Callable[[str], None] | None = print

    @property
    def start_limit(self) -> float:
        return QUIET_SHARE * self.cores

    @property
    def end_limit(self) -> float:
        return self.own + QUIET_SHARE * self.cores

    @property
    def loaded(self) -> bool:
        """Whether the 1-min load exceeded its bound at start or (once finished) at end."""
        return self.start[0] > self.start_limit or (self.end is not None and self.end[0] > self.end_limit)

    def finish(self) -> "LoadCheck":
        self.end = os.getloadavg()
        if self.print_fn is not None:
            verdict = LOADED_MARK if self.loaded else "quiet"
            self.print_fn(f"load average at end: {_fmt(self.end)} (1-min bound {self.end_limit:.2f}); "
                          f"machine was {verdict}")
        return self

    def mark(self, text: str) -> str:
        """``text`` (a ratio) as it may be reported: marked, or refused, when the run was loaded."""
        if not self.loaded:
            return text
        if os.environ.get("CAPER_BENCH_REFUSE_LOADED", "") not in ("", "0"):
            return "refused: machine loaded"
        return f"{text} {LOADED_MARK}"

    def as_dict(self) -> dict:
        return {"load_start": list(self.start), "load_end": None if self.end is None else list(self.end),
                "load_limits": [self.start_limit, self.end_limit], "loaded": self.loaded,
                "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


def _fmt(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load) + " (1/5/15 min)"


def start_load_check(own: float | None = None, *, cores: int | None = None,
                     print_fn: Callable[[str], None] | None = print) -> LoadCheck:
    """Reads and prints the load average now; ``own``: cores the benchmark will keep busy (default all)."""
    cores = cores or os.cpu_count() or 1
    own = float(cores if own is None else min(own, cores))
    check = LoadCheck(own=own, cores=cores, start=os.getloadavg(), print_fn=print_fn)
    if print_fn is not None:
        print_fn(f"load average at start: {_fmt(check.start)}; {cores} cores, this benchmark keeps {own:g} busy; "
                 f"quiet when the 1-min load is <= {check.start_limit:.2f} at start and <= {check.end_limit:.2f} "
                 "at end (bench/_common.py); GLIBC_TUNABLES="
                 f"{os.environ.get('GLIBC_TUNABLES', '')!r} (caper_jax/utils/host_memory.py)")
    return check


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternating_min_time(fns: dict[str, Callable[[], object]], repeats: int, rounds: int = 2) -> dict[str, float]:
    """Per name, the best of ``rounds`` ``median_time``s of its function, the functions taking turns
    round by round so that each sees the same load."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_time(fn, repeats))
    return {name: min(values) for name, values in times.items()}


def wall_and_cpu_s(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call of ``fn`` (which must block until done)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
