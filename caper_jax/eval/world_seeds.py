"""The miniature reproduction over several world seeds: every table with its spread.

One reproduction (``configs/reproduce.py``) repeats bit for bit on one machine, but not across
processors (XLA:CPU compiles for the processor it finds, and 600 SFT steps amplify the rounding).
The spread over seeds of the demo world (``--config.seed``: world, SFT, samples, PRM and the
evaluation keys all change with it) on one machine is the noise a processor change is comparable
to; this module puts the runs side by side:

    for s in 0 1 2; do
      python -m caper_jax.train --config=configs/reproduce.py --config.seed=$s --workdir=runs/rep_s$s
    done
    python -m caper_jax.eval.world_seeds --output=runs/world_seeds.md runs/rep_s0 runs/rep_s1 runs/rep_s2

Each cell is the mean ± sample standard deviation over the world seeds of one run's figure (for
GRPO policies, a run's figure is already its mean over GRPO seeds), followed by the per-seed values.
Reads only each run's ``results.json``; no JAX.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
from collections.abc import Sequence

from absl import app, flags

from caper_jax.utils.atomic import check_output, write_text_atomic
from caper_jax.utils.cli import usage_error

POLICIES = ("sft", "sparse", "token", "clause")


def read_runs(workdirs: Sequence[str | pathlib.Path]) -> list[dict]:
    """``results.json`` of each reproduction workdir (a clear error for a missing or unfinished run)."""
    runs = []
    for workdir in workdirs:
        path = pathlib.Path(workdir) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no results.json (is {workdir} a finished reproduction?)")
        results = json.loads(path.read_text())
        for key in ("localization_top1", "baselines", "ex", "mv8", "rerank8", "oracle8"):
            if key not in results:
                raise ValueError(f"{path}: not a reproduction's results.json (no {key!r})")
        if results["localization_top1"] is None:   # its policy left no held-out failure to localise
            raise ValueError(f"{path}: no localisation figures (the run had no held-out failed samples, as a "
                             "short :fast run may not); the spread needs them")
        runs.append(results)
    if len(runs) < 2:
        raise ValueError(f"a spread needs at least 2 runs, got {len(runs)}")
    return runs


def spread(values: Sequence[float], scale: float = 100.0) -> str:
    """'mean ± std (v1 / v2 / ...)' in percent: the sample std over the runs."""
    scaled = [scale * v for v in values]
    mean, std = statistics.fmean(scaled), statistics.stdev(scaled)
    return f"{mean:.1f} ± {std:.1f} ({' / '.join(f'{v:.1f}' for v in scaled)})"


def _run_mean(results: dict, table: str, policy: str, aggregate: str | None = None) -> float:
    cell = results[table][aggregate][policy] if aggregate else results[table][policy]
    return cell["mean"]


def spread_report(runs: Sequence[dict], names: Sequence[str]) -> str:
    """Markdown: the reproduction's tables, each cell as the spread over the runs."""
    lines = ["# Miniature reproduction over world seeds", "",
             f"{len(runs)} runs ({', '.join(map(str, names))}); each cell: mean ± sample std over the runs, "
             "then each run's value in that order. A GRPO policy's value is its run's mean over GRPO seeds.", ""]

    lines += ["## Table 1 — root-cause localisation on held-out failures", "",
              "| method | sees gold | top-1 | MRR |", "|---|---|---|---|",
              f"| Clause-PRM | no | {spread([r['localization_top1'] for r in runs])} | "
              f"{spread([r['localization_mrr'] for r in runs])} |"]
    for method in runs[0]["baselines"]:
        rows = [r["baselines"][method] for r in runs]
        gold = "**yes** (reference only)" if rows[0].get("sees_gold") else "no"
        lines.append(f"| {method} | {gold} | {spread([b['top1'] for b in rows])} | {spread([b['mrr'] for b in rows])} |")
    fair = [r.get("best_fair_baseline") for r in runs]
    margins = [r["localization_top1"] - r["baselines"][f]["top1"] for r, f in zip(runs, fair) if f]
    lines += ["", f"Held-out failures per run: {' / '.join(str(r.get('localization_n')) for r in runs)}. "
              f"Held-out pairwise accuracy of the PRM: {spread([r['pair_accuracy'] for r in runs])}. "
              f"Best baseline that does not see gold, per run: {' / '.join(map(str, fair))}; "
              f"PRM top-1 minus it: {spread(margins)} points.", ""]

    lines += ["## Table 2 — execution accuracy (%) of the policies", "",
              "| policy | greedy EX | MV@8 | PRM rerank@8 (each run's pick) | oracle@8 |", "|---|---|---|---|---|"]
    for policy in POLICIES:
        picked = [_run_mean(r, "rerank8", policy, r["rerank_aggregate"]) for r in runs]
        lines.append(f"| {policy} | {spread([_run_mean(r, 'ex', policy) for r in runs])} | "
                     f"{spread([_run_mean(r, 'mv8', policy) for r in runs])} | {spread(picked)} | "
                     f"{spread([_run_mean(r, 'oracle8', policy) for r in runs])} |")
    lines += ["", f"Reranker picked on training questions, per run: {' / '.join(r['rerank_aggregate'] for r in runs)}.", ""]

    aggregates = list(runs[0]["rerank8"])
    lines += ["## Table 3 — PRM reranking minus majority vote (EX points)", "",
              "| policy | " + " | ".join(aggregates) + " |", "|---|" + "---|" * len(aggregates)]
    for policy in POLICIES:
        cells = [spread([_run_mean(r, "rerank8", policy, a) - _run_mean(r, "mv8", policy) for r in runs])
                 for a in aggregates]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append("")

    paired = runs[0].get("paired_differences", {}).get("greedy_ex", {})
    if paired:
        lines += ["## GRPO: greedy EX, paired by GRPO seed within each run (EX points)", ""]
        for pair in paired:
            lines.append(f"- {pair}: {spread([r['paired_differences']['greedy_ex'][pair]['mean'] for r in runs])}")
        lines.append("")
    if all("seconds" in r for r in runs):
        walls = [sum(r["seconds"].values()) / 60 for r in runs]
        lines += [f"Stage wall time per run (minutes): {' / '.join(f'{w:.1f}' for w in walls)}.", ""]
    return "\n".join(lines)


_OUTPUT = flags.DEFINE_string("output", None, "markdown file to write (stdout when unset)")


def main(argv: Sequence[str]) -> int:
    workdirs = argv[1:]
    if not workdirs:
        usage_error("usage: python -m caper_jax.eval.world_seeds [--output=F] WORKDIR WORKDIR [...]")
    if _OUTPUT.value:
        check_output(_OUTPUT.value, [pathlib.Path(w) / "results.json" for w in workdirs])
    try:
        text = spread_report(read_runs(workdirs), [pathlib.Path(w).name for w in workdirs])
    except (FileNotFoundError, ValueError) as error:
        print(f"world_seeds: {error}", file=sys.stderr)
        return 2
    if _OUTPUT.value:
        write_text_atomic(_OUTPUT.value, text + "\n")
        print(f"wrote {_OUTPUT.value}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    app.run(main)
