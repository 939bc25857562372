"""Annotation throughput: verified fault-injection tuples per second on Spider dev, and
localisation of the real failures of six published systems.

    python bench/annotate.py [--data ../shared/data/spider] [--per_query 4] [--workers 1 2]
                             [--repeats 3] [--predictions ../shared/data/spider_predictions]
                             [--no-real]

Workload: every dev gold query whose database is present gets ``inject_faults(per_query=4)``; each
negative is verified by execution (parses, runs, result differs from gold under Spider rules).
A "tuple" here is one verified (gold, negative) pair; the timed work also builds the preference
pairs of each negative (``mutation_pairs``, default settings: same-position and within-trajectory)
and checks every one against the invariants (``caper_jax.sql.invariants``): columns pairs (kept),
pairs/s and dropped. Workers are processes, each with its own
cold executors (no cache carried over between runs), the queries split round-robin.

Measured in the same run:
* floor: parse (sqlglot) + execute (SQLite, fresh connections) each gold query once, 1 process;
* share of each annotation run's time spent inside SQLite (execute + fetch, from the executors).
Columns: tuples/s = tuples / wall time of the slowest worker; e2e/s also counts process start-up
and schema loading; per CPU-s = tuples per second of CPU summed over workers (what neighbours on a
shared machine disturb least); x floor = CPU per gold query (or per tuple) over the floor's CPU per
gold query; sqlite = share of worker wall time spent inside SQLite. Best of ``--repeats`` runs.

Real failures (``caper_jax.eval.ex.published_failures``: every Spider-dev example with a
database where one of the six systems' predictions does not execute to gold's result, about 1,100):
``localize`` on each, workers as above (processes, cold executors, failures split round-robin).
failures/s = failures / wall time of the slowest worker; extra exec/failure = queries executed
beyond gold and prediction (hybrids, the corrected query, suspect checks: ``Localization.executions``),
with the same figure for the canonical comparison alone (``verify=False``) next to it. Also the
reasons (verified / canonical fallback) and suspects found. The load average is printed at start
and end: on a shared machine every figure depends on it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import random
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import start_load_check  # noqa: E402

import sqlglot  # noqa: E402

from caper_jax.eval.ex import published_failures  # noqa: E402
from caper_jax.sql.clauses import parse_sql  # noqa: E402
from caper_jax.sql.execution import Executors  # noqa: E402
from caper_jax.sql.mutations import inject_faults  # noqa: E402
from caper_jax.sql.schema import Schema  # noqa: E402
from caper_jax.sql.tuples import AnnotationSettings, Context, mutation_pairs  # noqa: E402


def load_work(data: pathlib.Path) -> list[tuple[int, str, str]]:
    examples = json.loads((data / "dev.json").read_text())
    present = {p.name for p in (data / "database").iterdir() if p.is_dir()}
    return [(i, e["db_id"], e["query"]) for i, e in enumerate(examples) if e["db_id"] in present]


def sqlglot_compiled() -> dict:
    import sqlglot.expressions.core as core
    import sqlglot.generator as generator
    import sqlglot.parser as parser
    import sqlglot.tokenizer_core as tokenizer
    modules = {"parser": parser, "generator": generator, "tokenizer_core": tokenizer,
               "expressions.core": core}
    return {name: module.__file__.endswith(".so") for name, module in modules.items()}


def floor(data: pathlib.Path, work) -> dict:
    """Parse + execute every gold query once (fresh connections, no cache hits)."""
    parse_s = 0.0
    executors = Executors(data / "database")
    for _, db_id, _ in work:
        executors[db_id]  # open connections outside the timed region
    start, cpu_start = time.perf_counter(), time.process_time()
    for _, db_id, sql in work:
        t = time.perf_counter()
        parse_sql(sql)
        parse_s += time.perf_counter() - t
        executors.execute(db_id, sql)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    sqlite_s = sum(e.sqlite_seconds for e in executors._executors.values())
    executors.close()
    return {"queries": len(work), "wall_s": wall, "cpu_s": cpu, "parse_s": parse_s, "sqlite_s": sqlite_s}


def annotate_shard(args) -> dict:
    data, shard, per_query, seed = args
    executors = Executors(data / "database")
    schemas = {}
    for _, db_id, _ in shard:
        if db_id not in schemas:
            schemas[db_id] = Schema.from_sqlite(executors.db_path(db_id))
            executors[db_id]
    settings = AnnotationSettings()
    start, cpu_start = time.perf_counter(), time.process_time()
    tuples = pairs = dropped = 0
    for index, db_id, sql in shard:
        negatives = inject_faults(sql, executors[db_id], schemas[db_id], per_query,
                                  random.Random(seed * 1_000_003 + index))
        tuples += len(negatives)
        context = Context("", db_id, "", sql)
        for negative in negatives:      # the preference pairs, each checked (caper_jax.sql.invariants)
            for pair in mutation_pairs(context, negative, alpha=settings.alpha, sigma=settings.sigma,
                                       margin_floor=settings.margin_floor, reference_edges=settings.reference_edges,
                                       schema=schemas[db_id], within_trajectory=settings.within_trajectory):
                pairs += pair.dropped is None
                dropped += pair.dropped is not None
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    sqlite_s = sum(e.sqlite_seconds for e in executors._executors.values())
    executors.close()
    return {"tuples": tuples, "pairs": pairs, "dropped": dropped, "wall_s": wall, "cpu_s": cpu, "sqlite_s": sqlite_s}


def phases(data: pathlib.Path, work, per_query: int, seed: int) -> dict:
    """CPU ms per gold query inside each step of inject_faults (1 process, timing wrappers)."""
    from caper_jax.sql import execution, mutations
    spent: dict[str, float] = {}

    def timed(owner, name: str, label: str):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - start
        setattr(owner, name, wrapper)
        return original

    patches = [(mutations, "parse_sql", "parse"), (mutations, "render_sql", "render"),
               (mutations, "clone_tree", "clone (negatives, replacement nodes)"),
               (mutations, "results_equal", "compare results"),
               (execution.Executor, "_query", "sqlite (execute + fetch)"),
               (mutations._Sites, "__init__", "collect edit sites")]
    originals = [timed(owner, name, label) for owner, name, label in patches]
    try:
        total = annotate_shard((data, work, per_query, seed))["cpu_s"]  # excludes schema loading
    finally:
        for (owner, name, _), original in zip(patches, originals):
            setattr(owner, name, original)
    n = len(work)
    out = {label: 1e3 * seconds / n for label, seconds in spent.items()}
    out["other (edits, executor cache, bookkeeping)"] = 1e3 * total / n - sum(out.values())
    out["total"] = 1e3 * total / n
    return out


def annotate(data: pathlib.Path, work, workers: int, per_query: int, seed: int) -> dict:
    shards = [(data, work[w::workers], per_query, seed) for w in range(workers)]
    start = time.perf_counter()
    if workers == 1:
        parts = [annotate_shard(shards[0])]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.map(annotate_shard, shards)
    elapsed = time.perf_counter() - start  # includes process start-up and schema loading
    tuples = sum(p["tuples"] for p in parts)
    busy = max(p["wall_s"] for p in parts)  # the slowest worker bounds the annotation itself
    return {"workers": workers, "tuples": tuples, "elapsed_s": elapsed, "busy_s": busy,
            "pairs": sum(p["pairs"] for p in parts), "dropped": sum(p["dropped"] for p in parts),
            "pairs_per_s": sum(p["pairs"] for p in parts) / busy,
            "tuples_per_s": tuples / busy, "tuples_per_s_end_to_end": tuples / elapsed,
            "cpu_s": sum(p["cpu_s"] for p in parts),
            "sqlite_share": sum(p["sqlite_s"] for p in parts) / sum(p["wall_s"] for p in parts)}


def localize_shard(args) -> dict:
    import collections

    from caper_jax.sql.localize import localize
    data, shard, verify = args
    executors = Executors(data / "database")
    schemas = {}
    for record in shard:
        if record["db_id"] not in schemas:
            schemas[record["db_id"]] = Schema.from_sqlite(executors.db_path(record["db_id"]))
            executors[record["db_id"]]
    reasons, suspects = collections.Counter(), collections.Counter()
    executions = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for record in shard:
        found = localize(record["gold"], record["pred"], executors[record["db_id"]], schemas[record["db_id"]],
                         verify=verify, suspects=verify)
        executions += found.executions
        reasons[found.reason.split(":")[0]] += 1
        suspects[found.suspect] += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    executors.close()
    return {"failures": len(shard), "wall_s": wall, "cpu_s": cpu, "executions": executions,
            "reasons": dict(reasons), "suspects": {str(k): v for k, v in suspects.items()}}


def localize_run(data: pathlib.Path, records: list[dict], workers: int, verify: bool) -> dict:
    shards = [(data, records[w::workers], verify) for w in range(workers)]
    if workers == 1:
        parts = [localize_shard(shards[0])]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.map(localize_shard, shards)
    busy = max(p["wall_s"] for p in parts)
    n = sum(p["failures"] for p in parts)
    merged: dict[str, dict] = {"reasons": {}, "suspects": {}}
    for p in parts:
        for key in merged:
            for k, v in p[key].items():
                merged[key][k] = merged[key].get(k, 0) + v
    return {"workers": workers, "verify": verify, "failures": n, "busy_s": busy, "failures_per_s": n / busy,
            "cpu_ms_per_failure": 1e3 * sum(p["cpu_s"] for p in parts) / n,
            "extra_executions_per_failure": sum(p["executions"] for p in parts) / n, **merged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=REPO.parent / "shared" / "data" / "spider")
    parser.add_argument("--per_query", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", action="store_true", help="also print CPU per step (1 process)")
    parser.add_argument("--predictions", type=pathlib.Path,
                        default=REPO.parent / "shared" / "data" / "spider_predictions")
    parser.add_argument("--no-real", dest="real", action="store_false",
                        help="skip localisation of the published systems' real failures")
    args = parser.parse_args()
    load = start_load_check(own=max(args.workers))   # one busy core per worker process

    work = load_work(args.data)
    compiled = sqlglot_compiled()
    print(f"sqlglot {sqlglot.__version__} ({sqlglot.__file__}); compiled (sqlglotc): {compiled}")
    print(f"{len(work)} gold queries, per_query={args.per_query}, cpus={os.cpu_count()}, "
          f"load average at start={os.getloadavg()[0]:.2f}")

    floors = [floor(args.data, work) for _ in range(args.repeats)]
    best_floor = min(floors, key=lambda f: f["cpu_s"])
    n = len(work)
    floor_ms = 1e3 * best_floor["cpu_s"] / n
    runs = {w: min((annotate(args.data, work, w, args.per_query, args.seed) for _ in range(args.repeats)),
                   key=lambda r: r["busy_s"]) for w in args.workers}

    print(f"\nfloor (parse + execute each gold once, 1 process): {floor_ms:.3f} ms CPU/query "
          f"({1e3 * best_floor['wall_s'] / n:.3f} ms wall; parse {1e3 * best_floor['parse_s'] / n:.3f}, "
          f"sqlite {1e3 * best_floor['sqlite_s'] / n:.3f} ms wall/query)")
    print(f"\n{'workers':>7} {'tuples':>7} {'busy s':>7} {'tuples/s':>9} {'e2e/s':>7} {'per CPU-s':>10} "
          f"{'CPU ms/query':>13} {'x floor':>8} {'CPU ms/tuple':>13} {'x floor':>8} {'sqlite':>7} "
          f"{'pairs':>7} {'pairs/s':>8} {'dropped':>8}")
    for w, r in runs.items():
        r["cpu_ms_per_query"] = 1e3 * r["cpu_s"] / n
        r["x_floor_per_query"] = r["cpu_ms_per_query"] / floor_ms
        r["cpu_ms_per_tuple"] = 1e3 * r["cpu_s"] / r["tuples"]
        r["x_floor_per_tuple"] = r["cpu_ms_per_tuple"] / floor_ms
        print(f"{w:>7} {r['tuples']:>7} {r['busy_s']:>7.2f} {r['tuples_per_s']:>9.0f} "
              f"{r['tuples_per_s_end_to_end']:>7.0f} {r['tuples'] / r['cpu_s']:>10.0f} "
              f"{r['cpu_ms_per_query']:>13.3f} {r['x_floor_per_query']:>8.2f} "
              f"{r['cpu_ms_per_tuple']:>13.3f} {r['x_floor_per_tuple']:>8.2f} "
              f"{100 * r['sqlite_share']:>6.1f}% {r['pairs']:>7} {r['pairs_per_s']:>8.0f} {r['dropped']:>8}")
    if args.phases:
        print("\nCPU ms per gold query by step (1 process):")
        for label, ms in phases(args.data, work, args.per_query, args.seed).items():
            print(f"  {label:<40} {ms:8.3f}")
    real = {}
    if args.real and args.predictions.is_dir():
        records = published_failures(args.data, args.predictions)
        print(f"\nreal failures of {len(set(r['system'] for r in records))} published systems: {len(records)} "
              f"(load average {os.getloadavg()[0]:.2f})")
        print(f"{'workers':>7} {'mode':>10} {'failures/s':>11} {'CPU ms/failure':>15} {'extra exec/failure':>19}")
        for verify in (True, False):
            for w in args.workers:
                r = min((localize_run(args.data, records, w, verify) for _ in range(args.repeats)),
                        key=lambda r: r["busy_s"])
                real[f"{'verified' if verify else 'canonical'}_{w}"] = r
                print(f"{w:>7} {'verified' if verify else 'canonical':>10} {r['failures_per_s']:>11.1f} "
                      f"{r['cpu_ms_per_failure']:>15.2f} {r['extra_executions_per_failure']:>19.2f}")
        verified = real.get(f"verified_{args.workers[0]}")
        if verified:
            print(f"reasons {verified['reasons']}; suspects {verified['suspects']}")
    load.finish()
    for w, r in runs.items():   # the same-run ratios, marked when the machine was not quiet
        print(f"annotation / floor, {w} worker(s): per tuple {load.mark(format(r['x_floor_per_tuple'], '.2f') + 'x')}, "
              f"per gold query {load.mark(format(r['x_floor_per_query'], '.2f') + 'x')}")
    print(json.dumps({"floor": best_floor, "runs": runs, "real": real, "compiled": compiled,
                      "repeats": args.repeats, "load": load.as_dict()}))


if __name__ == "__main__":
    main()
