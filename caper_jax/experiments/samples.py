"""The SFT policy's samples of training questions, and the PRM's data built from them (both pipelines).

    samples_stage      k samples per training question -> samples/train.jsonl (+ the whole groups of k
                       in train_groups.jsonl, the pool the reranker is picked on)
    confidence_stage   prm_data/: a Spider-layout view whose predictions are those samples
                       (``build_prm_data``), its dev lines with the policy's clause confidences
                       (``add_policy_confidence``): the inputs of the gold-free localisation baselines
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import AbstractSet, Any, Callable

import jax

from caper_jax import loop
from caper_jax.eval import policy as policy_lib
from caper_jax.eval.confidence import clause_logprobs
from caper_jax.experiments.stages import AnyOf, Stage, completion
from caper_jax.parallel import multihost
from caper_jax.policy import sampling
from caper_jax.sql.contract import policy_prompt
from caper_jax.sql.execution import Executors
from caper_jax.utils.subset import seeded_subset


def train_samples_path(out: pathlib.Path) -> pathlib.Path:
    return out / "samples" / "train.jsonl"


def groups_path(train_samples: pathlib.Path) -> pathlib.Path:
    return train_samples.with_name("train_groups.jsonl")


def samples_stage(settings, data_dir: pathlib.Path, out: pathlib.Path) -> Stage:
    """The SFT policy's k samples per training question (``sample_train_questions``), once."""
    train_samples = train_samples_path(out)

    def sample() -> None:
        n = sample_train_questions(settings, data_dir, out / "sft", train_samples)
        multihost.log_main("%d distinct samples of %d training questions", n, settings.samples.train_questions)

    return Stage("samples", train_samples, sample)


def confidence_stage(out: pathlib.Path, write_prm_data: Callable[[], None]) -> Stage:
    """``write_prm_data()`` (prm_data/ with the SFT policy's clause confidences) before the PRM trains;
    a marker file records that it ran to the end, so an interrupted run writes it again. Once the PRM
    has finished, prm_data/ is not needed again."""
    marker = out / "prm_data" / "CONFIDENCE_DONE"

    def write() -> None:
        write_prm_data()
        marker.touch()

    return Stage("confidence", AnyOf((marker, completion(out / "prm"))), write)


def sample_train_questions(settings, data_dir: pathlib.Path, policy_dir: pathlib.Path,
                           out_path: pathlib.Path) -> int:
    """k samples per training question of the SFT policy (no greedy decode) -> prediction records."""
    e = settings.eval
    mesh, rules = loop.mesh_and_rules(e)
    policy = policy_lib.load_policy(policy_dir, mesh, rules)
    schema_values = policy.schema_values
    with Executors(policy_lib.database_dir(data_dir), timeout_s=e.timeout_s) as executors:
        examples, _ = policy_lib.usable_examples(data_dir, settings.sft.data.train_split, schema_values, executors,
                                                 settings.samples.train_questions, settings.seed)
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    s = e.sampling
    with jax.set_mesh(mesh):
        _, samples = sampling.decode(policy.model, policy.tokenizer, prompts, stop_tokens=(policy.stop_token,),
                                     k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_prompt_len=s.max_prompt_len, max_new_tokens=s.max_new_tokens,
                                     batch_size=s.batch_size, seed=settings.seed, greedy=False)
    records = [{"db_id": ex.db_id, "question": ex.question, "gold": ex.sql, "pred": sql}
               for ex, group in zip(examples, samples) for sql in unique(group)]
    # The whole groups of k (repeats included) are the pool the reranker is picked on: a vote needs them.
    write_jsonl(groups_path(out_path), [{"db_id": ex.db_id, "question": ex.question, "gold": ex.sql,
                                         "samples": list(group)} for ex, group in zip(examples, samples)])
    write_jsonl(out_path, records)
    return len(records)


def pick_groups(settings, train_samples: pathlib.Path) -> list[dict]:
    """The sampled training questions (whole groups of k) the reranker is picked on: a seeded subset of
    ``report.pick_questions``; with ``report.pick_held_back`` the PRM never trains on them."""
    groups = [json.loads(line) for line in groups_path(train_samples).read_text().splitlines() if line.strip()]
    return seeded_subset(groups, settings.report.pick_questions, settings.seed)


def held_back_questions(settings, train_samples: pathlib.Path) -> set[tuple[str, str, str]]:
    """(db_id, question, gold) of the pick questions when ``report.pick_held_back``, else nothing."""
    if not settings.report.pick_held_back:
        return set()
    return {(g["db_id"], g["question"], g["gold"]) for g in pick_groups(settings, train_samples)}


def build_prm_data(data_dir: pathlib.Path, train_samples: pathlib.Path, eval_predictions: pathlib.Path,
                   out: pathlib.Path, train_split: str, eval_split: str,
                   held_back: AbstractSet[tuple[str, str, str]] = frozenset()) -> None:
    """A Spider-layout view of the world whose predictions are the SFT policy's samples.

    The world's files are linked, not copied; its own ``predictions_*.jsonl`` (the demo world's
    simulated failures) are left out, so the PRM learns from the policy's trajectories only.
    ``held_back`` (db_id, question, gold) training questions are left out of both the samples and the
    training split's golds (no fault injection of them either): the PRM never sees them, so a choice
    made on them is out of sample.
    """
    out.mkdir(parents=True, exist_ok=True)
    split_file = out / f"{train_split}.json"
    for entry in data_dir.iterdir():
        if entry.name.startswith("predictions_") or entry.name == "manifest.json":
            continue
        link = out / entry.name
        if held_back and link == split_file:
            continue
        if not link.exists():
            link.symlink_to(entry.resolve())
    if not held_back:
        (out / f"predictions_{train_split}.jsonl").write_text(train_samples.read_text())
    else:
        questions = json.loads((data_dir / split_file.name).read_text())
        kept = [q for q in questions if (q["db_id"], q["question"], q["query"]) not in held_back]
        if split_file.is_symlink():   # a view built before without held_back: writing through it would edit the world
            split_file.unlink()
        split_file.write_text(json.dumps(kept, indent=1) + "\n")
        samples = [json.loads(line) for line in train_samples.read_text().splitlines() if line.strip()]
        write_jsonl(out / f"predictions_{train_split}.jsonl",
                    [r for r in samples if (r["db_id"], r["question"], r["gold"]) not in held_back])
    records = []
    for line in eval_predictions.read_text().splitlines():
        row = json.loads(line)
        # "samples": the question's k samples, read by the sample-disagreement baseline.
        records += [{"db_id": row["db_id"], "question": row["question"], "gold": row["gold"], "pred": sql,
                     "samples": list(row.get("samples", []))}
                    for sql in unique(row.get("samples", []))]
    write_jsonl(out / f"predictions_{eval_split}.jsonl", records)


def add_policy_confidence(settings, examples: list, policy_dir: pathlib.Path,
                          predictions: pathlib.Path) -> None:
    """Adds ``clause_logprob`` (the policy's mean token log-prob per clause, ``caper_jax.eval.confidence``)
    to every line of a predictions file: the confidence baseline's input. ``examples`` give each line's
    prompt as the policy reads it (its schema text); a line whose question is not among them is an error."""
    e = settings.eval
    mesh, rules = loop.mesh_and_rules(e)
    policy = policy_lib.load_policy(policy_dir, mesh, rules)
    by_question = {(ex.db_id, ex.question, ex.sql): ex for ex in examples}
    records = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    rows = []
    for r in records:
        ex = by_question.get((r["db_id"], r["question"], r["gold"]))
        if ex is None:
            raise RuntimeError(f"{predictions}: the question {r['question']!r} is not among the examples it was "
                               "sampled for")
        rows.append({"question": ex.question, "schema": ex.schema, "evidence": ex.evidence, "sql": r["pred"]})
    with jax.set_mesh(mesh):
        values = clause_logprobs(policy, rows, max_len=e.sampling.max_prompt_len + e.sampling.max_new_tokens + 1,
                                 batch_size=e.sampling.batch_size)
    for r, v in zip(records, values):
        r["clause_logprob"] = v
    write_jsonl(predictions, records)


def unique(items: list[str]) -> list[str]:
    """Distinct non-empty strings, first occurrence order: repeated samples would weigh a question twice."""
    return list(dict.fromkeys(s for s in items if s.strip()))


def write_jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)
