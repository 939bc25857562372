"""The few lines every run ends with: its headline figures next to their baselines, the wall time,
and where the report, plots, checkpoint and export went.

Each entry point calls one function here as its last step (PRM, SFT and GRPO trainers, the
experiments in ``caper_jax.experiments`` (the miniature and the Spider verifier), ``python -m
caper_jax.evaluate``, ``python -m caper_jax.verify``); the figures come from the results dict the run returns, so the screen and
results.json never disagree. Only process 0 prints.
``render`` is the pure part (tests read it); ``finish`` prints it and returns the text.

    ======================================================================
    Clause-PRM run finished in 7 min 45 s: runs/prm_demo
      held-out metric                  Clause-PRM  heuristic  execution-only  random
      pairwise accuracy (512 tuples)     88.9 %                               50.0 %
      top-1 (204 failed predictions)     76.5 %     71.3 %       53.4 %       33.8 %
      MRR                                86.9 %     83.4 %       72.2 %       60.8 %
      report      runs/prm_demo/localization.md
      ...
    ======================================================================
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

RULE = "=" * 78
METHOD_NAMES = {"prm": "Clause-PRM", "heuristic": "heuristic", "execution": "execution-only", "random": "random"}


def pct(value: Any, std: Any = None) -> str:
    """``76.5 %`` (``27.5 ± 0.8 %`` with a std); ``-`` for a missing or non-finite value."""
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if std is not None and isinstance(std, (int, float)) and math.isfinite(std) and std > 0:
        return f"{100 * value:.1f} ± {100 * std:.1f} %"
    return f"{100 * value:.1f} %"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in rows) for i in range(max(map(len, rows)))]
    lines = []
    for row in rows:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render(title: str, *, seconds: float | None = None, where: str | pathlib.Path | None = None,
           table: Sequence[Sequence[str]] = (), tables: Sequence[Sequence[Sequence[str]]] = (),
           lines: Sequence[str] = (), files: Mapping[str, Any] = ()) -> str:
    """The summary block. ``table`` (or several ``tables``): rows of cells, the first row the header.
    ``files``: label -> path or list of paths; paths that do not exist are left out (and a label
    with none)."""
    head = f"{title} finished in {duration(seconds)}" + (f": {where}" if where else "")
    out = [RULE, head]
    for rows in ([table] if table else []) + [t for t in tables if t]:
        out += _table(rows)
    out += [f"  {line}" for line in lines]
    shown = {}
    for label, paths in dict(files).items():
        paths = [paths] if isinstance(paths, (str, pathlib.Path)) or paths is None else list(paths)
        present = [str(p) for p in paths if p is not None and pathlib.Path(p).exists()]
        if present:
            shown[label] = present
    width = max((len(label) for label in shown), default=0)
    out += [f"  {label.ljust(width)}  {'  '.join(paths)}" for label, paths in shown.items()]
    out.append(RULE)
    return "\n".join(out)


def _is_main() -> bool:
    if "jax" not in sys.modules:   # evaluate ex never imports JAX
        return True
    import jax  # loaded already: the check above

    return jax.process_index() == 0


def finish(title: str, *, stream: TextIO | None = None, **parts) -> str:
    """Prints ``render(title, **parts)`` on process 0 (stdout unless ``stream``) and returns it."""
    text = render(title, **parts)
    if _is_main():
        print(text, file=stream or sys.stdout, flush=True)
    return text


def latest_checkpoint(workdir: str | pathlib.Path) -> pathlib.Path | None:
    """``<workdir>/checkpoints/<newest step>``, or None."""
    root = pathlib.Path(workdir) / "checkpoints"
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()] if root.is_dir() else []
    return max(steps, key=lambda p: int(p.name)) if steps else None


def _first_last(workdir: pathlib.Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` at its first and last logged step (one pair if logged once)."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return []
    values = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row.get(key), (int, float)):
            values.append((int(row.get("step", 0)), float(row[key])))
    return values[:1] + values[-1:] if len(values) > 1 else values


# -- the runs


def localization_rows(pair_accuracy: Any, n_tuples: Any, localization: Mapping[str, Mapping],
                      n_failures: Any) -> list[list[str]]:
    """The README's table: pairwise accuracy (no row when ``n_tuples`` is None: no pairs were scored),
    then top-1 / MRR of the PRM and each baseline."""
    known = [m for m in ("heuristic", "execution", "random") if m in localization]   # the README's order
    methods = ["prm", *known, *[m for m in localization if m not in ("prm", *known)]]
    rows = [["held-out metric", *[METHOD_NAMES.get(m, m) for m in methods]]]
    chance = {"random": pct(0.5)} if "random" in methods else {}
    if n_tuples is not None:
        rows.append([f"pairwise accuracy ({n_tuples} tuples)", pct(pair_accuracy),
                     *[chance.get(m, "") for m in methods[1:]]])
    for metric, label in (("top1", f"top-1 ({n_failures} failed predictions)"), ("mrr", "MRR")):
        rows.append([label, *[pct(localization.get(m, {}).get(metric)) for m in methods]])
    return rows


def prm_run(results: Mapping, workdir: str | pathlib.Path, seconds: float | None, *, export: bool = True,
            stream: TextIO | None = None) -> str:
    """End of ``caper_jax.prm.trainer.run``."""
    workdir = pathlib.Path(workdir)
    metrics = results.get("metrics", {})
    localization = results.get("localization", {})
    lines = [] if localization else ["no held-out failed predictions with a known root clause: no localisation"]
    return finish("Clause-PRM run", seconds=seconds, where=workdir, lines=lines,
                  table=localization_rows(metrics.get("eval/pair_accuracy"), results.get("n_eval_tuples"),
                                          localization, results.get("n_failures")),
                  files={"report": workdir / "localization.md", "results": workdir / "results.json",
                         "plots": [workdir / "loss_curve.png", workdir / "localization_per_clause.png"],
                         "metrics": workdir / "metrics.jsonl", "checkpoint": latest_checkpoint(workdir),
                         "export": workdir / "hf_export" if export else None}, stream=stream)


def policy_run(kind: str, results: Mapping, workdir: str | pathlib.Path, seconds: float | None, *,
               eval_split: str = "dev", png: str = "loss_curve.png", export: bool = True,
               stream: TextIO | None = None) -> str:
    """End of the SFT and GRPO trainers: greedy EX on held-out questions and how training moved."""
    workdir = pathlib.Path(workdir)
    table: list[list[str]] = []
    if "eval/greedy_ex" in results:
        table = [[f"held-out {eval_split} ({results.get('eval/n')} questions)", "greedy EX", "executable"],
                 ["policy after training", pct(results["eval/greedy_ex"]), pct(results.get("eval/executable"))]]
    lines = [] if table else ["no end-of-run EX (eval.num_examples = 0); "
                              "python -m caper_jax.evaluate --config=configs/eval.py evaluates a policy workdir"]
    for key, label, as_pct in (("rollout/ex", "rollout EX (sampled groups)", True),
                               ("rollout/reward_mean", "mean execution reward", False),
                               ("train/loss", "train loss", False)):
        logged = _first_last(workdir, key)
        if logged:
            lines.append(f"{label}: " + " -> ".join(f"{pct(v) if as_pct else f'{v:.4f}'} (step {step})"
                                                     for step, v in logged))
            if kind == "SFT":
                break
    return finish(f"{kind} run", seconds=seconds, where=workdir, table=table, lines=lines,
                  files={"results": workdir / "results.json", "predictions": workdir / "predictions_eval.jsonl",
                         "plots": workdir / png, "metrics": workdir / "metrics.jsonl",
                         "checkpoint": latest_checkpoint(workdir),
                         "export": workdir / "hf_export" if export else None}, stream=stream)


def _mean_std(entry: Any) -> tuple[Any, Any]:
    if isinstance(entry, Mapping):
        return entry.get("mean"), entry.get("std")
    return entry, None


def reproduce_run(results: Mapping, out: str | pathlib.Path, seconds: float | None, *,
                  stream: TextIO | None = None) -> str:
    """End of the miniature (``caper_jax.experiments.miniature``): the headline rows of results.md (Tables 1 and 2)."""
    out = pathlib.Path(out)
    localization = {"prm": {"top1": results.get("localization_top1"), "mrr": results.get("localization_mrr")},
                    **{m: b for m, b in results.get("baselines", {}).items()}}
    table = localization_rows(results.get("pair_accuracy"), "held-out", localization,
                              results.get("localization_n"))
    k, how = results.get("k"), results.get("rerank_aggregate")
    rerank = results.get("rerank8", {}).get(how, {}) if how else {}
    policies = [["policy (EX, " + f"{results.get('n_eval_questions')} questions)", "greedy", f"MV@{k}",
                 f"PRM@{k} ({how})"]]
    for name, entry in results.get("ex", {}).items():
        policies.append([name, pct(*_mean_std(entry)), pct(*_mean_std(results.get("mv8", {}).get(name))),
                         pct(*_mean_std(rerank.get(name)))])
    sees_gold = [m for m, b in results.get("baselines", {}).items() if b.get("sees_gold")]
    lines = [f"baselines that see the gold (reference only): {', '.join(sees_gold)}"] if sees_gold else []
    runs = [out / "sft", out / "prm", *sorted((out / "grpo").glob("*"))]
    return finish("Reproduction", seconds=seconds, where=out, tables=[table, policies], lines=lines,
                  files={"report": out / "results.md", "results": out / "results.json",
                         "plots": [out / "grpo_curves.png", out / "localization_per_clause.png"],
                         "checkpoint": [latest_checkpoint(run) for run in runs],
                         "export": [run / "hf_export" for run in runs],
                         "stage times": out / "stage_seconds.json"}, stream=stream)


def spider_verifier_run(results: Mapping, out: str | pathlib.Path, seconds: float | None, *,
                        stream: TextIO | None = None) -> str:
    """End of the plug-and-play verifier run (configs/spider_verifier.py): localisation of the systems'
    real failures against the baselines, then EX of the candidate pool by each selection."""
    out = pathlib.Path(out)
    localization = results.get("localization", {})
    table = localization_rows(results.get("pair_accuracy"), "held-out", localization,
                              localization.get("prm", {}).get("n"))
    k, picked = results.get("k"), results.get("rerank_aggregate")
    rerank = results.get("rerank", {})
    pool = [["selection (EX, " + f"{results.get('n_dev')} dev questions)", "first", f"MV@{k}",
             *[f"PRM {how}" + (" (picked)" if how == picked else "") for how in rerank], f"oracle@{k}"],
            ["the systems' pool", pct(results.get("first")), pct(results.get("mv")), *[pct(v) for v in rerank.values()],
             pct(results.get("oracle"))]]
    sees_gold = [m for m, b in localization.items() if b.get("sees_gold")]
    lines = [f"baselines that see the gold (reference only): {', '.join(sees_gold)}"] if sees_gold else []
    alone = results.get("ex_alone", {})
    if alone:
        lines.append("each system alone: " + ", ".join(f"{name} {pct(ex)}" for name, ex in alone.items()))
    return finish("Spider verifier", seconds=seconds, where=out, tables=[table, pool], lines=lines,
                  files={"report": out / "results.md", "results": out / "results.json",
                         "checkpoint": [latest_checkpoint(out / "sft"), latest_checkpoint(out / "prm")],
                         "stage times": out / "stage_seconds.json"}, stream=stream)


def _counts(counts: Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) if isinstance(counts, Mapping) and counts else "none"


def evaluate_ex_run(summary: Mapping, predictions: str | pathlib.Path, semantics: str, seconds: float | None, *,
                    output: str | pathlib.Path | None = None, stream: TextIO | None = None) -> str:
    """End of ``python -m caper_jax.evaluate ex`` (printed to stderr: stdout's last line stays the JSON)."""
    table = [["EX", "n", "excluded", "malformed lines"],
             [pct(summary.get("ex")), str(summary.get("n")), _counts(summary.get("excluded")),
              str(summary.get("malformed"))]]
    lines = []
    if "mv" in summary:
        mv = summary["mv"]
        lines.append(f"candidate lines ({mv['n']}): first {pct(mv['first'])}, majority vote {pct(mv['vote'])}, "
                     f"any (oracle) {pct(mv['any'])}")
    return finish(f"EX ({semantics})", seconds=seconds, where=predictions, table=table, lines=lines,
                  files={"per-line results": output}, stream=stream or sys.stderr)


def policy_eval_run(results: Mapping, workdir: str | pathlib.Path, seconds: float | None, *,
                    stream: TextIO | None = None) -> str:
    """End of ``python -m caper_jax.evaluate --config=configs/eval.py`` (stderr, like evaluate ex)."""
    workdir = pathlib.Path(workdir)
    metrics = results.get("metrics", {})
    k = results.get("k")
    header = ["selection (EX)", "greedy"]
    row = [f"{results.get('n')} {results.get('split', '')} questions", pct(metrics.get("greedy"))]
    if k:
        header += ["sample@1", f"MV@{k}", *[f"PRM@{k} {how}" for how in metrics.get("prm", {})], f"oracle@{k}"]
        row += [pct(metrics.get("first_sample")), pct(metrics.get("majority_vote")),
                *[pct(v) for v in metrics.get("prm", {}).values()], pct(metrics.get("oracle"))]
    return finish("Policy evaluation", seconds=seconds, where=workdir, table=[header, row],
                  lines=[f"greedy executable {pct(metrics.get('greedy_executable'))}; excluded "
                         f"{_counts(results.get('excluded'))}; semantics {results.get('semantics')}"],
                  files={"report": workdir / "results.md", "results": workdir / "results.json",
                         "predictions": workdir / "predictions.jsonl"}, stream=stream or sys.stderr)


def verify_rerank_run(summary: Mapping, candidates: str | pathlib.Path, semantics: str, seconds: float | None, *,
                      output: str | pathlib.Path | None = None, stream: TextIO | None = None) -> str:
    """End of ``python -m caper_jax.verify [rerank]`` (stderr: stdout's last line stays the JSON)."""
    by_aggregate = summary.get("prm_by_aggregate", {})
    table = [["selection (EX)", "first", "majority vote", *[f"PRM {how}" for how in by_aggregate], "any (oracle)"],
             [f"{summary.get('n')} lines", pct(summary.get("first")), pct(summary.get("vote")),
              *[pct(v) for v in by_aggregate.values()], pct(summary.get("any"))]]
    lines = [f"chosen by: PRM {summary.get('aggregate')} = {pct(summary.get('prm'))}; excluded "
             f"{_counts(summary.get('excluded'))}; malformed lines {summary.get('malformed')}"]
    return finish(f"Rerank ({semantics})", seconds=seconds, where=candidates, table=table, lines=lines,
                  files={"per-line choices": output}, stream=stream or sys.stderr)


def verify_localize_run(results: Mapping, skipped: Mapping, output_dir: str | pathlib.Path, seconds: float | None, *,
                        stream: TextIO | None = None) -> str:
    """End of ``python -m caper_jax.verify localize`` (stderr, like rerank)."""
    output_dir = pathlib.Path(output_dir)
    rows = localization_rows(None, None, results.get("localization", {}), results.get("n"))   # no pairs here
    return finish("Root-cause localisation", seconds=seconds, where=output_dir, table=rows,
                  lines=[f"skipped {_counts(skipped)}"],
                  files={"report": output_dir / "localization.md", "results": output_dir / "localization.json",
                         "plots": sorted(output_dir.glob("*.png"))}, stream=stream or sys.stderr)


__all__ = ["duration", "evaluate_ex_run", "finish", "latest_checkpoint", "localization_rows", "pct",
           "policy_eval_run", "policy_run", "prm_run", "render", "reproduce_run", "spider_verifier_run",
           "verify_localize_run", "verify_rerank_run"]
