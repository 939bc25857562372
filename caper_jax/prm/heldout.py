"""Held-out evaluation of a Clause-PRM: pairwise accuracy and root-cause localisation.

* **Pairwise**: on held-out preference tuples, the share with r(u+) > r(u-), overall and per clause.
* **Localisation**: on held-out FAILED trajectories, the PRM scores every clause of the prediction in
  one forward pass; clauses ranked lowest-first give top-1 and MRR against the true root clause,
  next to the baselines of ``caper_jax.prm.localization``: heuristic (sees gold: a reference row),
  execution-only and random always; the SFT policy's confidence when the prediction lines carry
  ``clause_logprob`` (per-clause mean token log-prob, ``caper_jax.eval.confidence``) and sample
  disagreement when they carry ``samples`` (the question's k samples), each only when every
  failure has it (a baseline on a subset would not be comparable).
  The true root is the construction label where the data has one (``true_root_clause`` in the demo
  world's predictions: known independently of the annotator), else the annotator's counterfactual
  localisation (``caper_jax.sql.localize``), which is what the paper evaluates against.
"""
from __future__ import annotations

import json
import pathlib
import random

import numpy as np

from caper_jax.data.prm_training_batches import prm_pipeline
from caper_jax.data.spider import ShownQuestions, load_schemas
from caper_jax.parallel import multihost
from caper_jax.prm import localization as loc
from caper_jax.prm.scoring import scores_in_batches
from caper_jax.sql import canonical as canon
from caper_jax.sql.clauses import SqlParseError, split_clauses
from caper_jax.sql.contract import CLAUSE_ORDER, serialize_schema
from caper_jax.sql.localize import GoldError, localize
from caper_jax.sql.tuples import Annotator
from caper_jax.utils.monitoring import plot_bars


class PrmEvaluator:
    def __init__(self, world, tokenizer, eval_tuples: pathlib.Path, config, mesh, rules):
        self.tokenizer, self.config, self.mesh, self.rules = tokenizer, config, mesh, rules
        self.multiple = multihost.batch_multiple(mesh, rules)
        records = [json.loads(line) for line in pathlib.Path(eval_tuples).read_text().splitlines() if line]
        random.Random(config.seed).shuffle(records)
        self.tuples = records[: config.data.max_eval_tuples]
        self.failures = self._failures(world, config.data.eval_split)

    # -- data

    @staticmethod
    def _failures(world, split: str) -> list[dict]:
        """Failed predictions with a known root clause, as rows for ``score_batch``."""
        path = world.dir / f"predictions_{split}.jsonl"
        if not path.exists():
            return []
        schemas = {db: serialize_schema(entry) for db, entry in load_schemas(world.dir).items()}
        shown = ShownQuestions.of_split(world.dir, split)   # BIRD's evidence, as the prompts show it
        annotator = Annotator(world.database_dir)
        rows = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("db_id") not in schemas or "pred" not in r or "gold" not in r:
                continue
            if r.get("kind") == "suspect":      # the demo's failures without an error: no root to find
                continue
            root = r.get("true_root_clause")
            if root is None:
                root = annotated_root(annotator, r["db_id"], r["gold"], r["pred"])
            if root is None:
                continue
            try:
                pred_units = [(u.name, u.text) for u in split_clauses(r["pred"])]
                gold_units = [(u.name, u.text) for u in split_clauses(r["gold"])]
            except SqlParseError:
                continue
            row = {"question": shown(r), "schema": schemas[r["db_id"]], "sql": r["pred"],
                   "root": root, "pred_units": pred_units, "gold_units": gold_units}
            rows.append(with_baseline_inputs(row, r, annotator.schema(r["db_id"])))
        annotator.close()
        return rows

    # -- metrics

    def pairwise(self, params, eval_scores) -> dict[str, float]:
        per_clause: dict[str, list[float]] = {}
        correct, gaps = [], []
        bs = self.config.data.eval_batch_size
        for start in range(0, len(self.tuples), bs):
            chunk = self.tuples[start:start + bs]
            batch = next(iter(prm_pipeline(
                chunk, self.tokenizer, global_batch_size=len(chunk), max_len=self.config.data.max_len,
                bucket_lengths=self.config.data.bucket_lengths, num_epochs=1).dataset))
            arrays, n = multihost.replicated_batch({k: v for k, v in batch.items() if k != "record_index"},
                                                   self.mesh, self.rules, self.multiple)
            r_pos, r_neg = (multihost.fetch(x)[:n] for x in eval_scores(params, arrays))
            order = batch["record_index"]
            for i in range(n):
                ok = float(r_pos[i] > r_neg[i])
                correct.append(ok)
                gaps.append(float(r_pos[i] - r_neg[i]))
                per_clause.setdefault(chunk[order[i]]["clause"], []).append(ok)
        out = {"eval/pair_accuracy": float(np.mean(correct)), "eval/score_gap": float(np.mean(gaps))}
        out.update({f"eval/pair_accuracy/{k}": float(np.mean(v)) for k, v in sorted(per_clause.items())})
        return out

    def clause_scores(self, params, clause_scores_fn, rows: list[dict]) -> list[np.ndarray]:
        """Per row, the PRM score of each clause unit of ``row['sql']`` (NaN where it fell off)."""
        return scores_in_batches(
            rows, self.tokenizer, lambda *arrays: clause_scores_fn(params, *arrays),
            batch_size=self.config.data.eval_batch_size, max_len=self.config.data.max_len,
            bucket_lengths=self.config.data.bucket_lengths, mesh=self.mesh, rules=self.rules)

    def localization(self, params, clause_scores_fn) -> dict[str, dict]:
        if not self.failures:
            return {}
        return localization_summaries(self.failures, self.clause_scores(params, clause_scores_fn, self.failures))

    def full(self, params, eval_scores, clause_scores_fn) -> dict:
        pairwise = self.pairwise(params, eval_scores)
        localization = self.localization(params, clause_scores_fn)
        metrics = dict(pairwise)
        for name, summary in localization.items():
            metrics[f"localization/{name}/top1"] = summary["top1"]
            metrics[f"localization/{name}/mrr"] = summary["mrr"]
        return {"metrics": metrics, "localization": localization, "n_eval_tuples": len(self.tuples),
                "n_failures": len(self.failures)}


def annotated_root(annotator: Annotator, db_id: str, gold: str, pred: str) -> str | None:
    """The annotator's root clause of a failed prediction (the paper's label); None when the
    prediction is right, its database is missing, or its gold does not run."""
    if not annotator.db_path(db_id).is_file():
        return None
    try:
        found = localize(gold, pred, annotator.executor(db_id), annotator.schema(db_id))
    except GoldError:
        return None
    return None if found.correct else found.root_clause


def clause_forms(sql: str, schema=None) -> dict[str, object]:
    """Position key -> canonical form of each clause of ``sql`` ({} when it does not parse).

    The canonical form is ``caper_jax.sql.canonical``'s clause key (aliases, quoting, operand order
    and qualification normalised); where canonicalisation fails or its clauses do not line up with
    ``split_clauses``' units, the whitespace/case-normalised clause text stands in.
    """
    try:
        units = split_clauses(sql)
    except SqlParseError:
        return {}
    keys = [p.key for p in canon.positions([u.name for u in units])]
    try:
        slots = canon.clause_slots(canon.canonicalize(sql, schema).tree)
        if [s.name for s in slots] == [u.name for u in units]:
            return {key: canon.canonical_key(slot) for key, slot in zip(keys, slots)}
    except Exception:  # noqa: BLE001 -- any sqlglot failure: the text is the fallback form
        pass
    return {key: " ".join(u.text.lower().split()) for key, u in zip(keys, units)}


def with_baseline_inputs(row: dict, record: dict, schema=None) -> dict:
    """``row`` plus what the gold-free baselines read, when the prediction line carries it:
    ``clause_logprob`` (one per clause) and the question's ``samples`` as canonical clause forms."""
    logprob = record.get("clause_logprob")
    if logprob is not None and len(logprob) == len(row["pred_units"]):
        row["clause_logprob"] = [float("-inf") if x is None else float(x) for x in logprob]
    if record.get("samples"):
        forms = clause_forms(row["sql"], schema)
        keys = [p.key for p in canon.positions([n for n, _ in row["pred_units"]])]
        row["pred_forms"] = [(key, forms.get(key, object())) for key in keys]
        row["sample_forms"] = [clause_forms(sql, schema) for sql in record["samples"]]
    return row


def localization_summaries(rows: list[dict], prm_scores: list[np.ndarray]) -> dict[str, dict]:
    """Top-1 / MRR / confusion of the PRM and each baseline on failed predictions.

    ``rows`` carry ``root`` (true root clause), ``pred_units`` and ``gold_units`` ((name, text) per
    clause) and, for the confidence and disagreement baselines, ``clause_logprob`` /
    ``pred_forms`` + ``sample_forms`` (``with_baseline_inputs``); ``prm_scores`` one score per pred
    clause (NaN: truncated away). Each summary carries ``sees_gold``.
    """
    cases: dict[str, list[loc.Case]] = {"prm": [], "heuristic": [], "random": [], "execution": []}
    if rows and all("clause_logprob" in row for row in rows):
        cases["confidence"] = []
    if rows and all("sample_forms" in row for row in rows):
        cases["disagreement"] = []
    for row, scores in zip(rows, prm_scores, strict=True):
        names = tuple(n for n, _ in row["pred_units"])
        true_index = loc.true_index_for(names, row["root"], CLAUSE_ORDER)
        # A clause truncated away (NaN) cannot be blamed: it ranks last.
        scores = np.where(np.isnan(scores), np.inf, scores)
        cases["prm"].append(loc.Case(names, tuple(scores), true_index))
        cases["heuristic"].append(loc.Case(names, loc.heuristic_scores(row["pred_units"], row["gold_units"]),
                                           true_index))
        cases["random"].append(loc.Case(names, loc.random_scores(len(names)), true_index))
        cases["execution"].append(loc.Case(names, loc.execution_scores(len(names)), true_index))
        if "confidence" in cases:
            cases["confidence"].append(loc.Case(names, loc.confidence_scores(row["clause_logprob"]), true_index))
        if "disagreement" in cases:
            cases["disagreement"].append(loc.Case(
                names, loc.disagreement_scores(row["pred_forms"], row["sample_forms"]), true_index))
    return {name: {**loc.summarize(c), "sees_gold": loc.SEES_GOLD.get(name, False)} for name, c in cases.items()}


def localization_table(localization: dict[str, dict]) -> str:
    """Markdown: overall and per-clause top-1 / MRR for the PRM and each baseline."""
    if not localization:
        return "_no held-out failures with a known root clause_\n"
    methods = list(localization)
    clauses = sorted({c for s in localization.values() for c in s["per_clause"]},
                     key=lambda c: CLAUSE_ORDER.index(c) if c in CLAUSE_ORDER else 99)
    head = "| true clause | n | " + " | ".join(f"{m} top-1 | {m} MRR" for m in methods) + " |"
    rule = "|---|---|" + "---|---|" * len(methods)
    lines = [head, rule]
    for clause in ["all", *clauses]:
        n = localization[methods[0]]["n"] if clause == "all" else localization[methods[0]]["per_clause"][clause]["n"]
        cells = []
        for m in methods:
            s = localization[m] if clause == "all" else localization[m]["per_clause"][clause]
            cells.append(f"{100 * s['top1']:.1f} | {100 * s['mrr']:.1f}")
        lines.append(f"| {clause} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def confusion_table(summary: dict) -> str:
    conf = summary.get("confusion", {})
    blamed = sorted({b for row in conf.values() for b in row},
                    key=lambda c: CLAUSE_ORDER.index(c) if c in CLAUSE_ORDER else 99)
    lines = ["| true \\ blamed | " + " | ".join(blamed) + " |", "|---|" + "---|" * len(blamed)]
    for true in sorted(conf, key=lambda c: CLAUSE_ORDER.index(c) if c in CLAUSE_ORDER else 99):
        lines.append(f"| {true} | " + " | ".join(str(conf[true].get(b, 0)) for b in blamed) + " |")
    return "\n".join(lines) + "\n"


def write_report(results: dict, workdir: pathlib.Path) -> None:
    """localization.md, the per-clause localisation plot, then results.json (last: it marks the run
    done, ``caper_jax.experiments.stages.completion``)."""
    workdir = pathlib.Path(workdir)
    localization = results.get("localization", {})
    metrics = results["metrics"]
    text = ["# Clause-PRM evaluation\n",
            f"Held-out tuples: {results['n_eval_tuples']}, pairwise accuracy "
            f"{100 * metrics['eval/pair_accuracy']:.1f} %.\n",
            f"Held-out failed predictions: {results['n_failures']}.\n",
            "## Root-cause localisation (%, clauses ranked by score, lowest first)\n",
            localization_table(localization)]
    if "prm" in localization:
        text += ["\n## Clause-PRM: true vs blamed clause\n", confusion_table(localization["prm"])]
        groups = {m: {"all": s["top1"], **{c: v["top1"] for c, v in s["per_clause"].items()}}
                  for m, s in localization.items()}
        plot_bars(groups, workdir / "localization_per_clause.png",
                  title="Root-cause localisation top-1 by true clause", ylabel="top-1")
    (workdir / "localization.md").write_text("\n".join(text))
    (workdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
