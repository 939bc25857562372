"""The preference pairs the annotator emits, checked pair by pair, on real failures and on fault injection.

    python bench/real_failure_tuples.py [--data ../shared/data/spider]
                                        [--predictions ../shared/data/spider_predictions]
                                        [--train_limit 0] [--workers 2] [--no-train]

Two workloads, each through ``Annotator`` with its default settings (the pairs a build writes):

* every real failure of the six published systems on Spider dev (``published_failures``: a
  prediction that does not execute to gold's result; about 1,100): counterfactual and
  within-trajectory pairs;
* fault injection over Spider's training golds (``train_no_db/train_gold.sql``, ``SQL<TAB>db_id``,
  their databases in ``database/``; ``--train_limit N`` takes the first N).

For each: trajectories, pairs emitted, pairs dropped by reason (``caper_jax.sql.invariants``: the
annotator drops a pair that breaks one, so every emitted pair satisfies them -- re-checked here
from the emitted pair and the query it was cut from), failures flagged ``suspect`` by reason, and
the root clauses found. Workers are processes, the records split round-robin. The load average is
printed with every timing: the machine may be shared.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from caper_jax.eval.ex import published_failures  # noqa: E402
from caper_jax.sql import invariants  # noqa: E402
from caper_jax.sql.tuples import AnnotationSettings, Annotator  # noqa: E402


def load_train(data: pathlib.Path, limit: int) -> list[dict]:
    records = []
    for line in (data / "train_no_db" / "train_gold.sql").read_text().splitlines():
        if not line.strip():
            continue
        sql, _, db_id = line.rpartition("\t")
        records.append({"db_id": db_id.strip(), "gold": sql.strip(), "question": ""})
    return records[:limit] if limit else records


def shard(args) -> dict:
    database_dir, records = args
    annotator = Annotator(database_dir, AnnotationSettings())
    counts = collections.Counter()
    dropped, suspects, roots, errors = (collections.Counter() for _ in range(4))
    recheck = collections.Counter()
    start = time.perf_counter()
    for record in records:
        annotation = annotator(record)
        counts["trajectories"] += 1
        counts[f"source:{annotation.source}"] += 1
        if annotation.error:
            errors[annotation.error] += 1
        counts["tuples"] += len(annotation.tuples)
        counts["negatives"] += sum(annotation.negatives_by_kind.values())
        dropped.update(p.dropped for p in annotation.dropped)
        suspects.update(k.split(":", 1)[1] for k in annotation.negatives_by_kind if k.startswith("suspect:"))
        for t, positive in zip(annotation.tuples, annotation.positive_sql):
            reason = invariants.violation(t, positive_sql=positive, alpha=annotator.settings.alpha,
                                          within=t.provenance.startswith("within"))
            recheck[reason or "ok"] += 1
        if "pred" in record and annotation.source == "counterfactual":
            counterfactual = [t for t in annotation.tuples if t.provenance == "counterfactual"]
            roots[counterfactual[0].clause if counterfactual else "(no pair)"] += 1
    annotator.close()
    return {"counts": counts, "dropped": dropped, "suspects": suspects, "roots": roots, "errors": errors,
            "recheck": recheck, "wall_s": time.perf_counter() - start}


def run(name: str, database_dir: pathlib.Path, records: list[dict], workers: int) -> None:
    shards = [(database_dir, records[i::workers]) for i in range(workers)]
    load = os.getloadavg()
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(shard, shards)
    wall = time.perf_counter() - start
    total = {key: sum((r[key] for r in results), collections.Counter())
             for key in ("counts", "dropped", "suspects", "roots", "errors", "recheck")}
    c = total["counts"]
    emitted = c["tuples"]
    ok = total["recheck"]["ok"]
    print(f"\n== {name}: {c['trajectories']} trajectories, {workers} workers, {wall:.1f} s "
          f"(slowest worker {max(r['wall_s'] for r in results):.1f} s), load {load[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    print(f"sources: {dict(sorted((k.split(':', 1)[1], v) for k, v in c.items() if k.startswith('source:')))}"
          f"; errors: {dict(total['errors'])}")
    print(f"negatives: {c['negatives']}; pairs emitted: {emitted}; satisfying every invariant on re-check: "
          f"{ok} ({100.0 * ok / max(emitted, 1):.1f} %)")
    print(f"pairs dropped by reason: {dict(sorted(total['dropped'].items()))} "
          f"(total {sum(total['dropped'].values())})")
    if total["suspects"]:
        failures = c["source:counterfactual"]
        print(f"suspect failures: {sum(total['suspects'].values())} of {failures} "
              f"({100.0 * sum(total['suspects'].values()) / max(failures, 1):.1f} %), by reason "
              f"{dict(total['suspects'])}")
    if total["roots"]:
        print(f"clause of the first counterfactual pair (root): {dict(total['roots'].most_common())}")
    print(f"pairs/s: {emitted / wall:.0f} (wall, {workers} workers)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=REPO.parent / "shared" / "data" / "spider")
    parser.add_argument("--predictions", type=pathlib.Path,
                        default=REPO.parent / "shared" / "data" / "spider_predictions")
    parser.add_argument("--train_limit", type=int, default=0, help="first N training golds (0: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-train", dest="train", action="store_false")
    parser.add_argument("--no-real", dest="real", action="store_false")
    args = parser.parse_args()
    database_dir = args.data / "database"
    if args.real:
        failures = published_failures(args.data, args.predictions)
        run(f"real failures of {len({f['system'] for f in failures})} systems", database_dir, failures,
            args.workers)
    if args.train:
        run("fault injection over Spider's training golds", database_dir, load_train(args.data, args.train_limit),
            args.workers)


if __name__ == "__main__":
    main()
