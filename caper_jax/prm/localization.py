"""Root-cause localisation metrics: rank a failed query's clauses by score, lowest first.

A case is one failed query: its clause names in written order, one score per clause (a PRM score, or a
baseline's), and the index of the true root-cause clause. Ties are scored by their expectation under a
uniformly random tie-break, so a method that gives every clause the same score gets exactly the random
baseline (top-1 = 1/K, MRR = H_K / K) rather than whatever order ``argsort`` happens to pick.

Baselines the paper compares against:
* ``heuristic``: blame the first clause whose text differs from gold's clause of the same name
  (whitespace and case normalised) — what one would do without execution or a model.
* ``random``: every clause tied.
* ``execution``: an outcome-only reward says *that* the query failed, and sparse credit assignment
  puts it on the final clause: the last clause is blamed, the others tie behind it.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    clauses: tuple[str, ...]     # clause names of the prediction, written order
    scores: tuple[float, ...]    # lower = more suspicious
    true_index: int              # position of the true root-cause clause in ``clauses``

    def __post_init__(self):
        if len(self.clauses) != len(self.scores) or not 0 <= self.true_index < len(self.clauses):
            raise ValueError(f"inconsistent case: {self}")


def expected_rank_metrics(scores: Sequence[float], true_index: int) -> tuple[float, float]:
    """(P(top-1), E[1/rank]) of the true clause under a random tie-break."""
    s = np.asarray(scores, dtype=np.float64)
    target = s[true_index]
    lower = int((s < target).sum())
    ties = int((s == target).sum()) - 1
    top1 = 1.0 / (ties + 1) if lower == 0 else 0.0
    mrr = float(np.mean([1.0 / (lower + 1 + j) for j in range(ties + 1)]))
    return top1, mrr


def summarize(cases: Iterable[Case]) -> dict:
    """Top-1 and MRR overall and per true clause, plus the blamed-vs-true confusion counts."""
    per_clause: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    confusion: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    allm = []
    for case in cases:
        m = expected_rank_metrics(case.scores, case.true_index)
        true_name = case.clauses[case.true_index]
        per_clause[true_name].append(m)
        allm.append(m)
        blamed = case.clauses[int(np.argmin(np.asarray(case.scores)))]
        confusion[true_name][blamed] += 1
    def agg(ms):
        return {"top1": float(np.mean([m[0] for m in ms])) if ms else float("nan"),
                "mrr": float(np.mean([m[1] for m in ms])) if ms else float("nan"), "n": len(ms)}
    return {**agg(allm), "per_clause": {k: agg(v) for k, v in sorted(per_clause.items())},
            "confusion": {k: dict(v) for k, v in sorted(confusion.items())}}


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def heuristic_scores(pred_clauses: Sequence[tuple[str, str]], gold_clauses: Sequence[tuple[str, str]]
                     ) -> tuple[float, ...]:
    """-1 on the first (name, text) clause of pred whose text differs from gold's same-named clause."""
    gold = {name: _norm(text) for name, text in gold_clauses}
    scores = [0.0] * len(pred_clauses)
    for i, (name, text) in enumerate(pred_clauses):
        if gold.get(name) != _norm(text):
            scores[i] = -1.0
            break
    return tuple(scores)


def execution_scores(n_clauses: int) -> tuple[float, ...]:
    return tuple([0.0] * (n_clauses - 1) + [-1.0])


def random_scores(n_clauses: int) -> tuple[float, ...]:
    return tuple([0.0] * n_clauses)


def true_index_for(pred_names: Sequence[str], root_clause: str, order: Sequence[str]) -> int:
    """Position to blame when the true root is ``root_clause``.

    If the prediction lacks that clause (say, a missing WHERE), the omission shows at the next clause
    the prediction does have, in canonical order; failing that, at its last clause.
    """
    if root_clause in pred_names:
        return list(pred_names).index(root_clause)
    rank = {name: i for i, name in enumerate(order)}
    root_rank = rank.get(root_clause, len(order))
    for i, name in enumerate(pred_names):
        if rank.get(name, len(order)) > root_rank:
            return i
    return len(pred_names) - 1
