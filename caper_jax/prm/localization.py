"""Root-cause localisation metrics: rank a failed query's clauses by score, lowest first.

A case is one failed query: its clause names in written order, one score per clause (a PRM score, or a
baseline's), and the index of the true root-cause clause. Ties are scored by their expectation under a
uniformly random tie-break, so a method that gives every clause the same score gets exactly the random
baseline (top-1 = 1/K, MRR = H_K / K) rather than whatever order ``argsort`` happens to pick.

Baselines. At inference time there is no gold query, so only the baselines that do not read it
compete with the PRM (``SEES_GOLD`` says which do):

* ``heuristic`` (SEES GOLD — a reference row, not a competitor): blame the first clause whose text
  differs from gold's clause of the same name (whitespace and case normalised).
* ``confidence``: the clause the policy is least sure of — the lowest mean log-probability of the
  clause's tokens under the SFT policy (``clause_mean_logprobs``; the stop token belongs to the last
  clause, as the end of the query is part of the last clause's state in the tuples).
* ``disagreement``: the clause the question's other samples agree with least — the share of the k
  samples whose clause at the same position has the same canonical form (``disagreement_scores``); a
  self-consistency signal that needs k samples but no gold and no model beyond the policy.
* ``execution``: an outcome-only reward says *that* the query failed, and sparse credit assignment
  puts it on the final clause: the last clause is blamed, the others tie behind it.
* ``random``: every clause tied.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Hashable, Iterable, Mapping, Sequence

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


# Whether a baseline reads the gold query (unavailable at inference time): such a row is a reference,
# never the baseline the PRM is measured against.
SEES_GOLD = {"heuristic": True, "confidence": False, "disagreement": False, "execution": False, "random": False}


def best_fair_baseline(summaries: Mapping[str, Mapping]) -> str | None:
    """The baseline (by top-1, then MRR) among those that do not see gold; None when there is none."""
    fair = [m for m in summaries if m != "prm" and not SEES_GOLD.get(m, True)]
    return max(fair, key=lambda m: (summaries[m]["top1"], summaries[m]["mrr"])) if fair else None


def clause_mean_logprobs(token_starts: Sequence[int], token_logprobs: Sequence[float],
                         clause_starts: Sequence[int]) -> tuple[float, ...]:
    """Mean log-prob of each clause's tokens; a token belongs to the clause whose span holds its start.

    ``token_starts``: character offset of each SQL token in the SQL text (the stop token, if given,
    at ``len(sql)``), ``clause_starts``: each clause's first character, increasing. A token before
    the first clause (leading whitespace) counts for the first. A clause without a token of its own
    (one token spanning two clauses) gets -inf: nothing says the policy was sure of it.
    """
    if len(token_starts) != len(token_logprobs):
        raise ValueError(f"{len(token_starts)} token offsets but {len(token_logprobs)} log-probs")
    if list(clause_starts) != sorted(clause_starts):
        raise ValueError(f"clause starts {list(clause_starts)} are not increasing")
    sums = np.zeros(len(clause_starts))
    counts = np.zeros(len(clause_starts))
    for start, logp in zip(token_starts, token_logprobs):
        i = max(0, int(np.searchsorted(clause_starts, start, side="right")) - 1)
        sums[i] += logp
        counts[i] += 1
    return tuple(float(s / c) if c else float("-inf") for s, c in zip(sums, counts))


def confidence_scores(clause_logprobs: Sequence[float]) -> tuple[float, ...]:
    """The policy's mean log-prob per clause is the score itself: least sure = lowest = blamed."""
    return tuple(float(x) for x in clause_logprobs)


def disagreement_scores(pred_keys: Sequence[tuple[str, Hashable]],
                        sample_keys: Sequence[Mapping[str, Hashable]]) -> tuple[float, ...]:
    """Per clause of the prediction, the share of the question's samples that write it the same way.

    ``pred_keys``: (position key, canonical form) per clause of the prediction; ``sample_keys``: per
    sample of the same question, position key -> canonical form (a sample lacking the position
    disagrees). The prediction may be among the samples: that adds 1/k to every clause and changes
    no rank. Lowest share = the clause the samples vary on most = blamed. No samples: all tied.
    """
    if not sample_keys:
        return tuple(0.0 for _ in pred_keys)
    return tuple(float(np.mean([s.get(position, _ABSENT) == key for s in sample_keys]))
                 for position, key in pred_keys)


_ABSENT = object()  # never equal to a canonical form


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
