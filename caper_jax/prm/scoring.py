"""Clause-PRM inference: load a trained PRM, score every clause of many queries, aggregate.

Loading (``load_scorer(path)``) accepts what the PRM trainer writes:

* a trainer workdir (or its ``checkpoints/``): ``caper_jax.runs.load_run`` restores the newest whole
  orbax checkpoint — parameters only, no optimizer moments — into the architecture the run recorded,
  with the run's tokenizer;
* an HF export (``hf_export/``: ``Qwen3_5TextForSequenceClassification`` safetensors with
  ``score.weight``, and the tokenizer files ``export_prm_to_hf`` saves next to them).

Scoring (``ClausePrmScorer.score_queries(rows)``): rows are ``{question, schema, sql}``; each query
is ONE forward pass (``prompt + sql``, the score of every clause read at its last token — the causal
backbone makes every clause prefix visible at once; ``caper_jax.data.prm_scoring_batches.score_batch``).
Rows are sorted by length before batching so a batch pads to the shortest bucket that holds it, and
every batch is padded to ``batch_size`` rows, so jit compiles once per bucket length. The result,
in input order, is one float64 array per row with one score per clause of ``split_clauses(sql)``:
NaN for a clause whose last token was cut off by left truncation, and an EMPTY array for SQL that
does not parse (it has no clauses to score).

Aggregation of a query's clause scores into one number (``aggregate``), used to rerank candidates:

* ``min``  — the weakest clause decides (a query is as good as its worst step; the PRM literature's
  usual choice for best-of-n);
* ``mean`` — the average clause;
* ``last`` — the score after the final clause, i.e. the PRM's value of the complete query.

NaN (truncated) clauses are ignored; a query with no scored clause (unparseable) aggregates to
``-inf`` so it is never chosen over a query that parses.

**PRM-weighted voting** (``vote_min``, ``vote_mean``, ``vote_last``; ``weighted_vote``): candidates
are grouped by execution result as majority vote groups them; a group scores the sum of its
members' weights ``sigmoid(aggregate)``, and the best group's best-scored member is chosen. Why the
sigmoid: the PRM is trained with a Bradley-Terry (logistic) pair loss with its scores centred near 0,
so ``sigmoid(score)`` is on the scale the loss gives meaning to, and each member adds a bounded vote
in (0, 1): three agreeing candidates the PRM finds middling still outvote one it likes, as in a vote,
while the PRM breaks near-ties. ``exp(score)`` would let a single high score outweigh any group, i.e.
drift back to best-of-k. Failed executions cast no vote; unparseable SQL weighs 0. When no candidate
executes, the choice falls back to best-of-k by the same aggregate.
"""
from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from caper_jax import runs
from caper_jax.data.prm_scoring_batches import score_batch
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.prm import step as step_lib
from caper_jax.prm.aggregates import AGGREGATES, SELECTORS, VOTE_PREFIX
from caper_jax.prm.export import load_prm_from_hf
from caper_jax.prm.model import ClausePRM
from caper_jax.sql.clauses import SqlParseError, split_clauses
from caper_jax.sql.execution import results_equal
from caper_jax.sql.semantics import comparison
from caper_jax.utils.errors import CheckpointError

DEFAULT_MAX_LEN = 1024


class ScoringError(ValueError):
    """Bad scorer input: an unknown aggregate, a row without question/schema/sql, a non-PRM HF export."""


# -- aggregation


def aggregate(scores: np.ndarray, how: str) -> float:
    """One number per query from its clause scores (module docstring); -inf when none is finite."""
    if how not in AGGREGATES:
        raise ScoringError(f"unknown aggregate {how!r}; expected one of {AGGREGATES}")
    scores = np.asarray(scores, np.float64)
    finite = scores[np.isfinite(scores)]
    if finite.size == 0:
        return float("-inf")
    if how == "min":
        return float(finite.min())
    if how == "mean":
        return float(finite.mean())
    return float(finite[-1])


def best_index(per_candidate: Sequence[np.ndarray], how: str) -> int:
    """The candidate with the highest aggregate; ties (and all -inf) go to the earliest."""
    values = [aggregate(s, how) for s in per_candidate]
    return int(np.argmax(values)) if values else 0


def member_weight(aggregate_score: float) -> float:
    """A candidate's vote in PRM-weighted voting: sigmoid of its aggregate (0 for -inf; module docstring)."""
    x = float(aggregate_score)
    if np.isnan(x) or x == float("-inf"):
        return 0.0
    return float(0.5 * (1.0 + np.tanh(0.5 * x)))   # = 1 / (1 + e^-x), without overflow


def result_classes(results: Sequence[Any], semantics: str) -> list[int | None]:
    """Execution-result class of each candidate (None for a failed execution), numbered in order of first
    appearance; two results share a class when majority vote would count them as one answer."""
    representatives: list[Any] = []
    out: list[int | None] = []
    for result in results:
        if not result.ok:
            out.append(None)
            continue
        for c, rep in enumerate(representatives):
            if results_equal(rep, result, semantics=comparison(semantics), ordered=False):
                out.append(c)
                break
        else:
            representatives.append(result)
            out.append(len(representatives) - 1)
    return out


def weighted_vote(per_candidate: Sequence[np.ndarray], classes: Sequence[int | None], how: str) -> int:
    """The PRM-weighted vote's choice (module docstring); ties between groups go to the earliest group."""
    if len(per_candidate) != len(classes):
        raise ScoringError(f"{len(per_candidate)} candidates but {len(classes)} result classes")
    values = [aggregate(s, how) for s in per_candidate]
    totals: dict[int, float] = {}
    for value, c in zip(values, classes):
        if c is not None:
            totals[c] = totals.get(c, 0.0) + member_weight(value)
    if not totals:
        return best_index(per_candidate, how)
    best_class = max(sorted(totals), key=lambda c: totals[c])    # sorted: the earliest group wins ties
    members = [i for i, c in enumerate(classes) if c == best_class]
    return max(members, key=lambda i: (values[i], -i))


def select(per_candidate: Sequence[np.ndarray], how: str, classes: Sequence[int | None] | None = None) -> int:
    """The candidate a selector of ``SELECTORS`` picks: best-of-k by an aggregate, or the weighted vote."""
    if how.startswith(VOTE_PREFIX):
        if classes is None:
            raise ScoringError(f"{how} needs the candidates' execution-result classes")
        return weighted_vote(per_candidate, classes, how[len(VOTE_PREFIX):])
    return best_index(per_candidate, how)


def clause_names(sql: str) -> list[str]:
    """Names of the clause units the scores refer to ([] for SQL that does not parse)."""
    try:
        return [unit.name for unit in split_clauses(sql.rstrip())]
    except SqlParseError:
        return []


# -- batched scoring (caper_jax.prm.heldout scores its held-out failures with it too)


def _check_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    for i, row in enumerate(rows):
        bad = [k for k in ("question", "schema", "sql") if not isinstance(row.get(k), str)]
        if bad:
            raise ScoringError(f"row {i}: {bad} must be strings")


def scores_in_batches(rows: Sequence[Mapping[str, Any]], tokenizer, scores_fn, *, batch_size: int,
                      max_len: int, bucket_lengths: Sequence[int] | None, mesh, rules) -> list[np.ndarray]:
    """Per row (input order), the score of each clause of ``row['sql']`` (module docstring).

    ``scores_fn(input_ids, mask, clause_pos) -> [B, K]`` runs the PRM on global arrays.
    """
    _check_rows(rows)
    if batch_size < 1:
        raise ScoringError(f"batch_size must be >= 1, got {batch_size}")
    multiple = multihost.batch_multiple(mesh, rules)
    batch_size = -(-batch_size // multiple) * multiple
    order = sorted(range(len(rows)), key=lambda i: sum(len(rows[i][k]) for k in ("question", "schema", "sql")))
    out: list[np.ndarray | None] = [None] * len(rows)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = score_batch([rows[i] for i in chunk], tokenizer, max_len=max_len,
                                     bucket_lengths=bucket_lengths)
        arrays = {k: batch[k] for k in ("input_ids", "mask", "clause_pos")}
        if len(chunk) < batch_size:  # a fixed row count: one compiled program per bucket length
            arrays = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - len(chunk), axis=0)])
                      for k, v in arrays.items()}
        arrays, _ = multihost.replicated_batch(arrays, mesh, rules, multiple)
        scores = multihost.fetch(scores_fn(arrays["input_ids"], arrays["mask"], arrays["clause_pos"]))
        for b, i in enumerate(chunk):
            k = len(clause_names(rows[i]["sql"]))
            s = scores[b, :k].astype(np.float64)
            s[batch["clause_pos"][b, :k] < 0] = np.nan
            out[i] = s
    return out  # type: ignore[return-value]


class ClausePrmScorer:
    """A loaded Clause-PRM with its tokenizer; ``score_queries`` scores whole queries in batches."""

    def __init__(self, model: ClausePRM, tokenizer, *, mesh, rules, max_len: int = DEFAULT_MAX_LEN,
                 bucket_lengths: Sequence[int] | None = None, batch_size: int = 16):
        self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
        self.rules = tuple(tuple(r) for r in rules)
        self.max_len, self.batch_size = max_len, batch_size
        self.bucket_lengths = tuple(bucket_lengths) if bucket_lengths else None
        graphdef, self.params = nnx.split(model)
        self._scores = jax.jit(functools.partial(step_lib.clause_scores, graphdef=graphdef))

    def score_queries(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        if not rows:
            return []
        with jax.set_mesh(self.mesh):
            return scores_in_batches(
                rows, self.tokenizer, functools.partial(self._scores, self.params), batch_size=self.batch_size,
                max_len=self.max_len, bucket_lengths=self.bucket_lengths, mesh=self.mesh, rules=self.rules)


# -- loading


def _is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors*"))


def load_scorer(path: str | pathlib.Path, *, mesh=None, rules=None, batch_size: int = 16,
                max_len: int | None = None, bucket_lengths: Sequence[int] | None = None,
                dtype: str | None = None) -> ClausePrmScorer:
    """A scorer from a PRM trainer workdir / checkpoints dir, or from an HF export (module docstring).

    ``max_len``/``bucket_lengths`` default to the training config's (HF export: 1024, default ladder);
    ``mesh`` defaults to every device on ``fsdp``, ``rules`` to ``caper_jax.parallel.rules.DEFAULT_RULES``.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no PRM at {path}")
    mesh = mesh if mesh is not None else mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    rules = tuple(tuple(r) for r in (rules if rules is not None else rules_lib.DEFAULT_RULES))
    if _is_hf_dir(path):
        model = load_hf_prm(path, mesh, rules, dtype=dtype or "float32")
        from transformers import AutoTokenizer  # transformers: only an HF-directory PRM reads its tokenizer here

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return ClausePrmScorer(model, tokenizer, mesh=mesh, rules=rules, batch_size=batch_size,
                               max_len=max_len or DEFAULT_MAX_LEN, bucket_lengths=bucket_lengths)
    run = runs.load_run(path, module=ClausePRM, mesh=mesh, rules=rules, trainers=("prm",), dtype=dtype)
    data = run.config.get("data", {})
    return ClausePrmScorer(run.model, run.tokenizer(), mesh=mesh, rules=rules,
                           batch_size=batch_size, max_len=max_len or data.get("max_len", DEFAULT_MAX_LEN),
                           bucket_lengths=bucket_lengths or (None if max_len else data.get("bucket_lengths")))


def load_hf_prm(hf_dir: str | pathlib.Path, mesh, rules, *, dtype: str = "float32") -> ClausePRM:
    """A ClausePRM from an ``export_prm_to_hf`` directory (backbone tensors + ``score.weight``)."""
    try:
        return load_prm_from_hf(hf_dir, mesh, rules, dtype=dtype)
    except CheckpointError as e:
        raise ScoringError(str(e)) from e
