"""``python -m caper_jax.evaluate <command>``: evaluation entry points (absl flags, as caper_jax.train).

    ex --data DIR --split dev --predictions P.jsonl [--semantics spider|spider_official|bird] [--output OUT.jsonl]
       [--timeout_s 30] [--max_rows 1000000]
        Execution accuracy (caper_jax/eval/ex.py; docs/sql.md). Reports (malformed lines,
        excluded examples) go to stderr; the last stdout line is the JSON summary
        {"ex", "n", ["mv"], "excluded", "malformed"}. Exit status 2 with one line for an input or
        output that cannot be used (checked before any work), 130 on Ctrl-C (no summary).

    --config=configs/eval.py[:arg] --workdir=OUT [--config.a.b=value ...]
        Policy evaluation (caper_jax/eval/policy.py; docs/evaluation.md): greedy EX, MV@k and
        Clause-PRM best-of-k (min / mean / last) of an SFT/GRPO checkpoint or HF directory;
        writes results.json, results.md and predictions.jsonl to OUT and prints the metrics as the
        last stdout line. The config is built into typed settings and checked before anything is
        loaded (caper_jax/eval/settings.py, caper_jax/eval/validate.py).

A flag that is unknown, mistyped, of the wrong type, or not read by the command given is one error
line and exit status 2, before any work.
"""
from __future__ import annotations

if __name__ == "__main__":   # first, before any import allocates: XLA:CPU's per-call temporaries
    from caper_jax.utils.host_memory import reexec_with_huge_pages   # in huge pages (its docstring)

    reexec_with_huge_pages()

import json
import sys
import time
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from caper_jax.data.spider import DataError
from caper_jax.eval import ex as ex_lib
from caper_jax.sql.semantics import SEMANTICS
from caper_jax.utils import cli
from caper_jax.utils import summary as summary_lib

FLAGS = flags.FLAGS

EX_FLAGS = ("data", "split", "predictions", "semantics", "output", "timeout_s", "max_rows")
POLICY_FLAGS = ("config", "workdir")


def define_flags(flag_values: flags.FlagValues = FLAGS, argv: Sequence[str] | None = None) -> None:
    """The command's flags; defined only when it runs, so importing this module defines none.

    ``argv`` (default: sys.argv) names the ``--config.<key>`` overrides config_flags defines.
    """
    flags.DEFINE_string("data", None, "ex: dataset folder (Spider or BIRD layout).", flag_values=flag_values)
    flags.DEFINE_string("split", "dev", "ex: split name: <data>/<split>.json.", flag_values=flag_values)
    flags.DEFINE_string("predictions", None, "ex: JSON lines (index + pred | candidates), or a .sql/.txt/.csv "
                        "file of one prediction per example in split order (published systems' format).",
                        flag_values=flag_values)
    flags.DEFINE_enum("semantics", "spider", SEMANTICS, "ex: spider_official: the official evaluator's default, "
                      "DISTINCT removed (docs/evaluation.md).", flag_values=flag_values)
    flags.DEFINE_string("output", None, "ex: per-line results (JSON lines).", flag_values=flag_values)
    flags.DEFINE_float("timeout_s", ex_lib.DEFAULT_TIMEOUT_S, "ex: seconds per query.", flag_values=flag_values)
    flags.DEFINE_integer("max_rows", ex_lib.DEFAULT_MAX_ROWS, "ex: rows per result.", flag_values=flag_values)
    config_flags.DEFINE_config_file("config", None, "Policy evaluation: configs/eval.py[:arg].",
                                    flag_values=flag_values, lock_config=True,
                                    sys_argv=None if argv is None else list(argv))
    flags.DEFINE_string("workdir", None, "Policy evaluation: where results.json/results.md go.",
                        flag_values=flag_values)


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """absl parsing; a bad flag or config override is one line and exit status 2, no traceback."""
    return cli.parse_flags(argv, flag_values, config="eval config")


def run_ex(flag_values: flags.FlagValues) -> int:
    started = time.perf_counter()
    try:
        summary = ex_lib.evaluate_ex(
            flag_values.data, flag_values.split, flag_values.predictions, semantics=flag_values.semantics,
            output=flag_values.output, timeout_s=flag_values.timeout_s, max_rows=flag_values.max_rows)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    summary_lib.evaluate_ex_run(summary, flag_values.predictions, flag_values.semantics,
                                time.perf_counter() - started,
                                output=flag_values.output)   # on stderr: the last stdout line stays the JSON
    return 0


def run_policy(flag_values: flags.FlagValues) -> int:
    from caper_jax.eval.validate import validate  # JAX: `evaluate policy` only; `ex` loads none

    config = flag_values.config
    if (problem := cli.config_load_error(config)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if not flag_values.workdir:
            raise ValueError("--workdir is required (results.json, results.md and predictions.jsonl go there)")
        settings = validate(config)
    except (AttributeError, KeyError, ValueError, TypeError) as error:
        print(f"error: invalid eval config: {error}", file=sys.stderr)
        return 2
    from caper_jax.eval import policy  # the policy stack loads once the config is checked

    started = time.perf_counter()
    try:
        results = policy.run(settings, flag_values.workdir)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"n": results["n"], "k": results["k"], **results["metrics"]}), flush=True)
    summary_lib.policy_eval_run(results, flag_values.workdir, time.perf_counter() - started)   # stderr
    return 0


def main(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> int:
    """``argv``: what absl left after the flags, the program and the command."""
    command = list(argv[1:])
    if command == ["ex"]:
        cli.check_command(flag_values, "evaluate ex", defined=EX_FLAGS + POLICY_FLAGS, reads=EX_FLAGS,
                          required=("data", "predictions"))
        run = run_ex
    elif not command and flag_values["config"].present:
        cli.check_command(flag_values, "evaluate --config", defined=EX_FLAGS + POLICY_FLAGS, reads=POLICY_FLAGS)
        run = run_policy
    else:
        cli.usage_error("usage: python -m caper_jax.evaluate ex [flags] | "
                        "python -m caper_jax.evaluate --config=configs/eval.py[:arg] --workdir=OUT")
    try:
        return run(flag_values)
    except KeyboardInterrupt as error:  # Ctrl-C, inside a SQLite query too: no summary, outputs as they were
        where = f" ({error})" if str(error) else ""
        print(f"interrupted{where}: evaluation stopped; no summary, outputs left as they were", file=sys.stderr)
        return 130


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
