"""Metrics, progress and plots for long jobs.

Every trainer logs through ``MetricWriter``: TensorBoard event files (tensorboardX, so no TensorFlow is
needed) plus a ``metrics.jsonl`` that plots and tests read back without a TensorBoard parser. Only
process 0 writes in a multi-host run.
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import time
from typing import Any, Mapping

import numpy as np

from caper_jax.utils.atomic import write_text_atomic

log = logging.getLogger("caper_jax")


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is installed but not yet imported.

    tensorboardX's writer imports torch when it can, only to accept torch tensors (this writer passes floats):
    1.4 s and ~200 MB more for every process that writes metrics (measured with torch 2.13 CPU). Hidden during
    that one import, ``import torch`` raises ImportError and tensorboardX takes its no-torch path; torch stays
    importable afterwards. No thread of a training process imports torch while the writer opens."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _scalar(value: Any) -> float:
    return float(np.asarray(value))


class MetricWriter:
    """Writes scalar metrics to TensorBoard and to ``<workdir>/metrics.jsonl``."""

    def __init__(self, workdir: str | pathlib.Path, *, enabled: bool = True):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None            # opened at the first write, after a resume's rewind
        self._purge_step = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _tensorboard(self):
        if self._tb is None:
            SummaryWriter = _summary_writer_class()   # deferred: only the writing process needs it
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=self._purge_step)
        return self._tb

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: _scalar(v) for k, v in metrics.items()}
        tensorboard = self._tensorboard()
        for key, value in scalars.items():
            # TensorBoard tags allow no spaces ("eval/pair_accuracy/GROUP BY"); the JSONL keeps the name.
            tensorboard.add_scalar(key.replace(" ", "_"), value, step)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(step), **scalars}) + "\n")

    def rewind(self, step: int) -> None:
        """After a resume from checkpoint ``step``: the rows of later steps, written before the
        interruption by a trajectory the run is about to redo, leave metrics.jsonl (rewritten
        atomically) and are hidden in TensorBoard (tensorboardX's ``purge_step``), so that no step is
        logged twice."""
        if not self.enabled:
            return
        if self.path.exists():
            lines = self.path.read_text().splitlines(keepends=True)
            kept = [line for line in lines if _step_of(line) <= step]
            if len(kept) != len(lines):
                write_text_atomic(self.path, "".join(kept))
        self.close()
        self._tb, self._purge_step = None, step + 1

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a line a killed process left half written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """Steps/s and ETA over a sliding window, measured on the host clock; ``unit``/``units`` name what
    is counted (the trainers' steps, the sampler's batches)."""

    def __init__(self, total_steps: int, first_step: int = 0, *, unit: str = "step", units: str = "steps"):
        self.total = total_steps
        self.unit, self.units = unit, units
        self._mark_step = first_step
        self._mark_time = time.perf_counter()
        self.steps_per_s = float("nan")

    def update(self, step: int) -> str:
        now = time.perf_counter()
        if step > self._mark_step:
            self.steps_per_s = (step - self._mark_step) / max(now - self._mark_time, 1e-9)
            self._mark_step, self._mark_time = step, now
        remaining = max(self.total - step, 0)
        eta = remaining / self.steps_per_s if self.steps_per_s > 0 else math.nan
        return f"{self.unit} {step}/{self.total}  {self.steps_per_s:.2f} {self.units}/s  ETA {_fmt_seconds(eta)}"


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    m, s = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


def plot_curves(rows: list[dict], keys: list[str], out_png: str | pathlib.Path, title: str = "") -> None:
    """One panel per metric key against step (rows from ``read_metrics``)."""
    import matplotlib  # matplotlib loads only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    keys = [k for k in keys if any(k in r for r in rows)]
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_bars(groups: Mapping[str, Mapping[str, float]], out_png: str | pathlib.Path, *, title: str,
              ylabel: str) -> None:
    """Grouped bars: ``groups[series][category] = value`` (e.g. top-1 per clause per method)."""
    import matplotlib  # matplotlib loads only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    series = list(groups)
    categories = sorted({c for s in series for c in groups[s]}, key=lambda c: (c == "all", c))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories)), 3.6))
    for i, name in enumerate(series):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [groups[name].get(c, 0.0) for c in categories], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
