"""Policy evaluation: greedy EX, majority vote over k samples, and PRM-reranked best-of-k.

    python -m caper_jax.evaluate --config=configs/eval.py --workdir=OUT   (configs/eval.py: commands)

For every example of a split (database present, gold executes):

* **greedy**: one greedy decode (``caper_jax.policy.sampling.decode``, the trainers' own eval path);
* **k samples**: the same ``decode`` at ``sampling.temperature`` / ``top_p`` / ``top_k``,
  each prompt repeated k times in the batch (the sampler's per-row keys make the samples of a row
  independent of the rest of the batch);
* **MV@k**: majority vote by execution result (``caper_jax.eval.ex.majority_vote``: equal results
  share a vote, failures cast none, ties to the earliest);
* **PRM best-of-k**: every sample is scored by the Clause-PRM in one forward
  (``caper_jax.prm.scoring``) and the sample with the best aggregate of its clause scores wins —
  for each of ``min``, ``mean`` and ``last``, so the three aggregations are compared on the SAME
  samples; unparseable samples score -inf;
* **PRM-weighted voting** (``vote_<aggregate>``, ``caper_jax.prm.scoring.weighted_vote``): the
  execution-result class whose members' ``sigmoid(aggregate)`` sum is largest — the vote of MV@k,
  weighted by what the PRM thinks of each member;
* **first sample** (sample@1) and **oracle@k** (some sample right) bracket the selectors.

EX follows ``evaluate ex``: Spider semantics (ordered iff the gold has ORDER BY), the official
evaluator's default (``spider_official``: DISTINCT removed first) or BIRD's; errors and timeouts are wrong. The scoring step (``score_examples``) is pure host code over strings, so
it is tested with hand-written predictions; decoding (``caper_jax.policy.sampling.decode``) is the
only device work besides the PRM forward.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from caper_jax import loop, runs
from caper_jax.data.spider import MissingDatabaseError, database_dirs, db_path, load_split
from caper_jax.eval import report
from caper_jax.eval.settings import EvalSettings
from caper_jax.eval.ex import majority_vote
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.policy import sampling as sampling_lib
from caper_jax.policy.prompts import stop_token_id
from caper_jax.prm import scoring
from caper_jax.sft.data import examples_from_split
from caper_jax.sql.contract import policy_prompt, prompt_question
from caper_jax.sql.execution import Executors, order_matters, results_equal
from caper_jax.sql.semantics import comparison, executed_sql
from caper_jax.settings import as_dict
from caper_jax.utils.subset import seeded_subset

log = logging.getLogger("caper_jax")


@dataclasses.dataclass
class Policy:
    model: Any                  # Qwen35ForCausalLM
    tokenizer: Any
    stop_token: int             # END_OF_SQL
    train_config: dict | None   # the trainer config stored with the checkpoint (None for an HF dir)
    source: str

    @property
    def schema_values(self) -> int:
        """The schema text's values per column the policy was trained with: its saved config's (SFT and GRPO
        configs set data.schema_values); an HF directory was not trained here and reads schemas as the
        annotator writes them, without values."""
        return 0 if self.train_config is None else self.train_config["data"]["schema_values"]


# -- loading


def load_policy(path: str | pathlib.Path, mesh, rules, *, dtype: str | None = None) -> Policy:
    """A policy from an HF dir, or an SFT/GRPO workdir or converted HF model (``caper_jax.runs.load_run``:
    params only, newest whole checkpoint)."""
    from caper_jax.models import from_hf  # hf_io (safetensors) loads on first use: models.__getattr__

    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no policy at {path}")
    if (path / "config.json").is_file():
        from transformers import AutoTokenizer  # transformers: an HF-directory policy only

        model, _ = from_hf(path, dtype=dtype or "float32", mesh=mesh, rules=rules)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return Policy(model, tokenizer, stop_token_id(tokenizer), None, str(path))
    run = runs.load_run(path, module=Qwen35ForCausalLM, mesh=mesh, rules=rules, trainers=runs.POLICY_TRAINERS,
                        dtype=dtype)
    tokenizer = run.tokenizer()
    return Policy(run.model, tokenizer, stop_token_id(tokenizer), run.config, str(run.step_dir))


# -- scoring (host side)


def score_examples(examples: Sequence[Any], greedy: Sequence[str], samples: Sequence[Sequence[str]],
                   executors: Executors, *, semantics: str = "spider",
                   prm_scores: Callable[[list[dict]], list[np.ndarray]] | None = None,
                   aggregates: Sequence[str] = ("min", "mean", "last")) -> tuple[dict, list[dict]]:
    """EX of every selection method over ``examples`` (``SftExample``-like: question, schema, sql, db_id).

    ``prm_scores(rows) -> per-row clause scores`` (``ClausePrmScorer.score_queries``); None skips the
    PRM rows. Returns (metrics, one row per example).
    """
    if not (len(examples) == len(greedy) == len(samples)):
        raise ValueError(f"{len(examples)} examples, {len(greedy)} greedy predictions, {len(samples)} sample lists")
    ks = {len(s) for s in samples}
    if len(ks) > 1:
        raise ValueError(f"every example needs the same number of samples, got {sorted(ks)}")
    k = ks.pop() if ks else 0
    scores: list[np.ndarray] = []
    if prm_scores is not None and k:
        scores = prm_scores([{"question": prompt_question(ex.question, ex.evidence), "schema": ex.schema,
                              "sql": sql}
                             for ex, group in zip(examples, samples) for sql in group])
    counts: collections.Counter[str] = collections.Counter()
    rows = []
    for i, (ex, pred, group) in enumerate(zip(examples, greedy, samples)):
        gold = executors.execute(ex.db_id, executed_sql(ex.sql, semantics))
        ordered = order_matters(ex.sql)
        right = lambda result: results_equal(gold, result, semantics=comparison(semantics), ordered=ordered)  # noqa: E731
        greedy_result = executors.execute(ex.db_id, executed_sql(pred, semantics))
        row = {"db_id": ex.db_id, "question": ex.question, "gold": ex.sql, "greedy": pred,
               "greedy_correct": right(greedy_result)}
        counts["greedy"] += row["greedy_correct"]
        counts["greedy_executable"] += greedy_result.ok
        if k:
            results = [executors.execute(ex.db_id, executed_sql(sql, semantics)) for sql in group]
            correct = [right(r) for r in results]
            vote = majority_vote(results, semantics)
            row.update(samples=list(group), samples_correct=correct, vote=vote)
            counts["first_sample"] += correct[0]
            counts["majority_vote"] += correct[vote]
            counts["oracle"] += any(correct)
            if scores:
                mine = scores[i * k:(i + 1) * k]
                row["prm"] = {}
                classes = scoring.result_classes(results, semantics)
                for how in aggregates:
                    best = scoring.best_index(mine, how)
                    counts[f"prm_{how}"] += correct[best]
                    row["prm"][how] = {"chosen": best, "scores": [_plain(scoring.aggregate(s, how)) for s in mine]}
                for how in aggregates:  # PRM-weighted voting: the result class with the most sigmoid(score)
                    chosen = scoring.weighted_vote(mine, classes, how)
                    counts[f"prm_vote_{how}"] += correct[chosen]
                    row["prm"][scoring.VOTE_PREFIX + how] = {
                        "chosen": chosen, "classes": classes,
                        "scores": [scoring.member_weight(scoring.aggregate(s, how)) for s in mine]}
        rows.append(row)
    n = len(rows)
    rate = lambda key: counts[key] / n if n else 0.0  # noqa: E731
    metrics: dict[str, Any] = {"greedy": rate("greedy"), "greedy_executable": rate("greedy_executable")}
    if k:
        metrics.update(first_sample=rate("first_sample"), majority_vote=rate("majority_vote"), oracle=rate("oracle"))
        if scores:
            metrics["prm"] = {how: rate(f"prm_{how}") for how in aggregates}
            metrics["prm"].update({scoring.VOTE_PREFIX + how: rate(f"prm_vote_{how}") for how in aggregates})
    return metrics, rows


def _plain(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)  # JSON: -inf (unparseable) and NaN become null


# -- the whole run


def usable_examples(data_dir: pathlib.Path, split: str, schema_values: int, executors: Executors,
                    num_examples: int, seed: int) -> tuple[list, dict]:
    """Examples whose database exists and whose gold runs (a seeded subset when num_examples > 0)."""
    present, excluded = {}, collections.Counter()
    for ex in load_split(data_dir, split):
        if ex.db_id not in present:
            try:
                db_path(data_dir, ex.db_id, split)
                present[ex.db_id] = True
            except MissingDatabaseError:
                present[ex.db_id] = False
                log.warning("database %s is missing; its examples are excluded", ex.db_id)
    if not any(present.values()):
        raise FileNotFoundError(f"no database of split {split!r} is present under {data_dir}")
    # The schema text the policy was trained on; values only from the databases that are present.
    examples = examples_from_split(data_dir, split, schema_values=schema_values, values_for=present.__getitem__)
    examples = seeded_subset(examples, num_examples, seed)
    usable = []
    for ex in examples:
        if not present.get(ex.db_id, False):
            excluded["missing_db"] += 1
            continue
        gold = executors.execute(ex.db_id, ex.sql)
        if not gold.ok:
            excluded[f"gold_{gold.error_kind}"] += 1
            continue
        usable.append(ex)
    return usable, dict(excluded)


def run(settings: EvalSettings, workdir: str | pathlib.Path) -> dict:
    """Loads policy (and PRM), decodes, scores, writes results.json, results.md, predictions.jsonl."""
    workdir = pathlib.Path(workdir)
    mesh, rules = loop.mesh_and_rules(settings)
    policy_path = settings.policy.workdir or settings.policy.hf_dir
    policy = load_policy(policy_path, mesh, rules, dtype=settings.policy.dtype or None)
    train = policy.train_config or {}
    data_dir = pathlib.Path(settings.data.dir or _policy_data_dir(train, policy_path))
    schema_values = settings.data.schema_values if settings.data.schema_values >= 0 else policy.schema_values
    s = settings.sampling
    with Executors(database_dir(data_dir), timeout_s=settings.timeout_s) as executors:
        examples, excluded = usable_examples(data_dir, settings.data.split, schema_values, executors,
                                             settings.data.num_examples, settings.seed)
        if not examples:
            raise ValueError(f"no usable example in {data_dir} split {settings.data.split!r} (excluded: {excluded})")
        prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
        log.info("policy %s: decoding %d prompts (greedy + %d samples each)", policy.source, len(prompts), s.k)
        with jax.set_mesh(mesh):
            greedy, samples = sampling_lib.decode(
                policy.model, policy.tokenizer, prompts, stop_tokens=(policy.stop_token,), k=s.k,
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_prompt_len=s.max_prompt_len,
                max_new_tokens=s.max_new_tokens, batch_size=s.batch_size, seed=settings.seed)
        scorer = None
        if settings.prm.path:
            scorer = scoring.load_scorer(settings.prm.path, mesh=mesh, rules=rules, batch_size=settings.prm.batch_size,
                                 max_len=settings.prm.max_len or None)
        metrics, rows = score_examples(examples, greedy, samples, executors, semantics=settings.data.semantics,
                                       prm_scores=scorer.score_queries if scorer else None,
                                       aggregates=settings.prm.aggregates)
    results = {"policy": policy.source, "prm": settings.prm.path or None, "data": str(data_dir),
               "split": settings.data.split, "n": len(examples), "k": s.k, "excluded": excluded,
               "semantics": settings.data.semantics, "schema_values": schema_values, "metrics": metrics,
               "config": as_dict(settings)}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with (workdir / "predictions.jsonl").open("w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    header = (f"# Policy evaluation\n\nPolicy `{policy.source}` on `{data_dir}` split `{settings.data.split}`: "
              f"{len(examples)} examples (excluded: {excluded or 'none'}), k = {s.k} samples at temperature "
              f"{s.temperature}, PRM `{settings.prm.path or 'none'}`.\n\n")
    (workdir / "results.md").write_text(header + report.policy_table(results))
    return results


def _policy_data_dir(train: dict, policy_path: str) -> pathlib.Path:
    data = train.get("data", {})
    if data.get("dir"):
        return pathlib.Path(data["dir"])
    if data.get("kind") == "demo":
        return runs.checkpoints_dir(policy_path).parent / "demo_world"
    raise ValueError("set data.dir: the policy's training config names no dataset directory")


def database_dir(data_dir: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """Every database folder of the layout (``caper_jax.data.spider.database_dirs``), for ``Executors``."""
    found = database_dirs(data_dir)
    if not found:
        raise FileNotFoundError(f"{data_dir} has no database folder (database/, dev_databases/, train_databases/)")
    return found
