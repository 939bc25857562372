"""``python -m caper_jax.evaluate <command>``: evaluation entry points.

    ex --data DIR --split dev --predictions P.jsonl [--semantics spider|spider_official|bird] [--output OUT.jsonl]
       [--timeout_s 30] [--max_rows 1000000]
        Execution accuracy (caper_jax/evaluate_ex.py; docs/sql.md). Reports (malformed lines,
        excluded examples) go to stderr; the last stdout line is the JSON summary
        {"ex", "n", ["mv"], "excluded", "malformed"}. Exit status 2 with one line for an input or
        output that cannot be used (checked before any work), 130 on Ctrl-C (no summary).

    --config=configs/eval.py[:arg] --workdir=OUT [--config.a.b=value ...]
        Policy evaluation (caper_jax/eval/policy.py; docs/evaluation.md): greedy EX, MV@k and
        Clause-PRM best-of-k (min / mean / last) of an SFT/GRPO checkpoint or HF directory;
        writes results.json, results.md and predictions.jsonl to OUT and prints the metrics as the
        last stdout line. Config values are checked before anything is loaded.

Each command is a subparser with its own ``run_<command>(args)``; an argument list
containing ``--config`` is the ml_collections mode, parsed by absl on a private ``FlagValues`` (so it
never collides with other entry points' flags in one process).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from caper_jax import evaluate_ex
from caper_jax.utils import summary as summary_lib
from caper_jax.data.spider import DataError
from caper_jax.sql.semantics import SEMANTICS, check_semantics


def _add_ex(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("ex", help="execution accuracy of predictions (JSON lines)")
    parser.add_argument("--data", required=True, help="dataset folder (Spider or BIRD layout)")
    parser.add_argument("--split", default="dev", help="split name: <data>/<split>.json")
    parser.add_argument("--predictions", required=True,
                        help="JSON lines (index + pred | candidates), or a .sql/.txt/.csv file of one "
                             "prediction per example in split order (published systems' format)")
    parser.add_argument("--semantics", choices=SEMANTICS, default="spider",
                        help="spider_official: the official evaluator's default, DISTINCT removed (docs/evaluation.md)")
    parser.add_argument("--output", default=None, help="per-line results (JSON lines)")
    parser.add_argument("--timeout_s", type=float, default=evaluate_ex.DEFAULT_TIMEOUT_S)
    parser.add_argument("--max_rows", type=int, default=evaluate_ex.DEFAULT_MAX_ROWS)
    parser.set_defaults(run=run_ex)


def run_ex(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        summary = evaluate_ex.evaluate_ex(
            args.data, args.split, args.predictions, semantics=args.semantics, output=args.output,
            timeout_s=args.timeout_s, max_rows=args.max_rows)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    summary_lib.evaluate_ex_run(summary, args.predictions, args.semantics, time.perf_counter() - started,
                                output=args.output)   # on stderr: the last stdout line stays the JSON
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m caper_jax.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_ex(commands)
    return parser


def validate_eval_config(config) -> None:
    """Every value of configs/eval.py checked before any model or data is loaded."""
    import pathlib

    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.parallel import rules as rules_lib
    from caper_jax.prm.aggregates import AGGREGATES

    if bool(config.policy.workdir) == bool(config.policy.hf_dir):
        raise ValueError("set exactly one of policy.workdir and policy.hf_dir")
    for key, path in (("policy.workdir", config.policy.workdir), ("policy.hf_dir", config.policy.hf_dir),
                      ("prm.path", config.prm.path), ("data.dir", config.data.dir)):
        if path and not pathlib.Path(path).exists():
            raise ValueError(f"{key}={path!r} does not exist")
    check_semantics(config.data.semantics, what="data.semantics")
    unknown = [a for a in config.prm.aggregates if a not in AGGREGATES]
    if unknown or not config.prm.aggregates:
        raise ValueError(f"prm.aggregates={tuple(config.prm.aggregates)}; expected a non-empty subset of {AGGREGATES}")
    s = config.sampling
    if s.k < 0 or s.batch_size < 1 or s.max_new_tokens < 1 or s.max_prompt_len < 1 or config.prm.batch_size < 1:
        raise ValueError("sampling.k must be >= 0; sampling.batch_size, max_new_tokens, max_prompt_len and "
                         "prm.batch_size >= 1")
    if s.temperature <= 0 and s.k > 0:
        raise ValueError("sampling.temperature must be > 0 for k samples (greedy decoding is always evaluated)")
    if not 0 < s.top_p <= 1 or s.top_k < 0:
        raise ValueError(f"sampling.top_p={s.top_p} must be in (0, 1] and sampling.top_k={s.top_k} >= 0")
    if config.data.num_examples < 0 or config.prm.max_len < 0 or config.timeout_s <= 0:
        raise ValueError("data.num_examples and prm.max_len must be >= 0, timeout_s > 0")
    mesh_lib.resolve_mesh_shape(tuple(config.mesh_shape.values()), jax_device_count())
    rules_lib.rules_dict(config.sharding_rules)


def jax_device_count() -> int:
    import jax

    return jax.device_count()


def run_config(argv: list[str]) -> int:
    """The ``--config`` mode: absl/ml_collections flags on a private FlagValues."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    # sys_argv: config_flags defines the --config.<key> override flags from the argv it is given.
    config_flag = config_flags.DEFINE_config_file("config", None, "configs/eval.py[:arg]",
                                                  flag_values=flag_values, lock_config=True,
                                                  sys_argv=["caper_jax.evaluate", *argv])
    workdir_flag = flags.DEFINE_string("workdir", None, "where results.json/results.md go", flag_values=flag_values)
    try:
        flag_values(["caper_jax.evaluate", *argv])
        config = config_flag.value
        if not workdir_flag.value:
            raise ValueError("--workdir is required (results.json, results.md and predictions.jsonl go there)")
        validate_eval_config(config)
    except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as error:
        print(f"error: invalid eval config: {error}", file=sys.stderr)
        return 2
    from caper_jax.eval import policy

    started = time.perf_counter()
    try:
        results = policy.run(config, workdir_flag.value)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"n": results["n"], "k": results["k"], **results["metrics"]}), flush=True)
    summary_lib.policy_eval_run(results, workdir_flag.value, time.perf_counter() - started)   # stderr
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if any(a == "--config" or a.startswith("--config=") for a in argv):
            return run_config(argv)
        args = build_parser().parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt as error:  # Ctrl-C, inside a SQLite query too: no summary, outputs as they were
        where = f" ({error})" if str(error) else ""
        print(f"interrupted{where}: evaluation stopped; no summary, outputs left as they were", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
