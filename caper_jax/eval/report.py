"""Markdown tables and PNG plots of evaluation results (matplotlib, Agg backend, no display).

* Localisation (``python -m caper_jax.verify localize``): top-1 and MRR per true root clause for the
  PRM and its baselines (tables from ``caper_jax.prm.heldout``), bar plots of both, and the
  PRM's true-vs-blamed confusion as a table and a heat map (rows normalised, counts printed).
* Policy evaluation (``python -m caper_jax.evaluate --config=configs/eval.py``): one table of EX per
  decoding/selection method.
"""
from __future__ import annotations

import pathlib

import numpy as np

from caper_jax.prm.heldout import confusion_table, localization_table
from caper_jax.sql.contract import CLAUSE_ORDER
from caper_jax.utils.monitoring import plot_bars


def _clause_key(name: str) -> int:
    return CLAUSE_ORDER.index(name) if name in CLAUSE_ORDER else len(CLAUSE_ORDER)


def plot_confusion(confusion: dict[str, dict[str, int]], out_png: pathlib.Path, *, title: str) -> None:
    """Heat map of ``confusion[true][blamed]`` counts, colour = share of the true clause's row."""
    import matplotlib  # matplotlib loads only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    true = sorted(confusion, key=_clause_key)
    blamed = sorted({b for row in confusion.values() for b in row} | set(true), key=_clause_key)
    counts = np.asarray([[confusion[t].get(b, 0) for b in blamed] for t in true], np.float64)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(blamed), 1.0 + 0.6 * len(true)))
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for i in range(len(true)):
        for j in range(len(blamed)):
            ax.text(j, i, int(counts[i, j]), ha="center", va="center",
                    color="white" if shares[i, j] > 0.6 else "black", fontsize=8)
    ax.set_xticks(range(len(blamed)), blamed, rotation=30)
    ax.set_yticks(range(len(true)), true)
    ax.set_xlabel("blamed (lowest PRM score)")
    ax.set_ylabel("true root clause")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def write_localization_report(results: dict, out_dir: pathlib.Path) -> None:
    """``localization.md`` plus ``localization_top1.png``, ``localization_mrr.png``, ``confusion.png``."""
    localization = results["localization"]
    text = ["# Root-cause localisation\n",
            f"Failed predictions ranked: {results['n']} (root clause: "
            + ", ".join(f"{k} {v}" for k, v in sorted(results.get("root_source", {}).items())) + "); skipped: "
            + (", ".join(f"{k} {v}" for k, v in sorted(results.get("skipped", {}).items())) or "none") + ".\n",
            "Clauses ranked by PRM score, lowest first; top-1 and MRR in %. Baselines: "
            "`heuristic` (first clause differing from gold's text), `random` (all tied), "
            "`execution` (outcome-only credit: the last clause).\n",
            localization_table(localization)]
    if "prm" in localization:
        text += ["\n## Clause-PRM: true vs blamed clause (counts)\n", confusion_table(localization["prm"])]
        for metric, label in (("top1", "top-1"), ("mrr", "MRR")):
            groups = {m: {"all": s[metric], **{c: v[metric] for c, v in s["per_clause"].items()}}
                      for m, s in localization.items()}
            plot_bars(groups, out_dir / f"localization_{metric}.png", ylabel=label,
                      title=f"Root-cause localisation {label} by true clause")
        plot_confusion(localization["prm"]["confusion"], out_dir / "confusion.png",
                       title="Clause-PRM: true vs blamed clause")
    (out_dir / "localization.md").write_text("\n".join(text))


def policy_table(results: dict) -> str:
    """Markdown: EX (%) of greedy, first sample, majority vote, PRM best-of-k per aggregate, oracle."""
    metrics = results["metrics"]
    k = results["k"]
    rows = [("greedy", "greedy decoding", metrics.get("greedy")),
            ("sample@1", "first of the k samples", metrics.get("first_sample")),
            (f"MV@{k}", "majority vote by execution result", metrics.get("majority_vote"))]
    rows += [(f"PRM-{how}@{k}", f"PRM-weighted vote: result class with the most sigmoid({how[5:]}) of its members"
              if how.startswith("vote_") else f"best of k by PRM, clause scores aggregated by {how}", value)
             for how, value in metrics.get("prm", {}).items()]
    rows.append((f"oracle@{k}", "some sample correct (upper bound)", metrics.get("oracle")))
    lines = ["| method | selection | EX (%) |", "|---|---|---|"]
    lines += [f"| {name} | {what} | {100 * value:.1f} |" for name, what, value in rows if value is not None]
    return "\n".join(lines) + "\n"
