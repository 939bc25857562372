"""``python -m caper_jax.evaluate <command>``: evaluation entry points.

    ex --data DIR --split dev --predictions P.jsonl [--semantics spider|bird] [--output OUT.jsonl]
       [--timeout_s 30] [--max_rows 1000000]
        Execution accuracy (caper_jax/evaluate_ex.py; docs/sql.md). Reports (malformed lines,
        excluded examples) go to stderr; the last stdout line is the JSON summary
        {"ex", "n", ["mv"], "excluded", "malformed"}.

Each command is a subparser with its own ``run_<command>(args)``, so further commands (and a
``--config`` mode) slot in without touching the others.
"""
from __future__ import annotations

import argparse
import json
import sys

from caper_jax import evaluate_ex
from caper_jax.data.spider import DataError


def _add_ex(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("ex", help="execution accuracy of predictions (JSON lines)")
    parser.add_argument("--data", required=True, help="dataset folder (Spider or BIRD layout)")
    parser.add_argument("--split", default="dev", help="split name: <data>/<split>.json")
    parser.add_argument("--predictions", required=True, help="JSON lines: index + pred | candidates")
    parser.add_argument("--semantics", choices=("spider", "bird"), default="spider")
    parser.add_argument("--output", default=None, help="per-line results (JSON lines)")
    parser.add_argument("--timeout_s", type=float, default=evaluate_ex.DEFAULT_TIMEOUT_S)
    parser.add_argument("--max_rows", type=int, default=evaluate_ex.DEFAULT_MAX_ROWS)
    parser.set_defaults(run=run_ex)


def run_ex(args: argparse.Namespace) -> int:
    try:
        summary = evaluate_ex.evaluate_ex(
            args.data, args.split, args.predictions, semantics=args.semantics, output=args.output,
            timeout_s=args.timeout_s, max_rows=args.max_rows)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m caper_jax.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_ex(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
