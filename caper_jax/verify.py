"""``python -m caper_jax.verify [rerank|localize]``: a trained Clause-PRM as a plug-and-play verifier
for any system (absl flags, as caper_jax.train; the work is caper_jax/eval/verifier.py's).

    python -m caper_jax.verify [rerank] --prm CKPT --data DIR --candidates FILE.jsonl [--split dev]
        [--aggregate min|mean|last] [--semantics spider|spider_official|bird] [--output OUT.jsonl] [--batch_size 16]
    python -m caper_jax.verify localize --prm CKPT --data DIR --predictions P.jsonl [--split dev]
        [--output_dir DIR]

**Rerank** (the command when none is named): every candidate of every line scored by the PRM and
executed; the last stdout line is the JSON summary (first, vote, prm by aggregate, any).
**Localize**: root-cause localisation of failed predictions, PRM against the baselines, written to
``--output_dir`` as localization.json, localization.md and plots; the last stdout line is the summary.

Both check the data and the outputs before the PRM is loaded; a bad input or output is one line and
exit status 2, as is a flag that is unknown, mistyped or not read by the command; Ctrl-C exits 130
with no summary and outputs as they were.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from caper_jax.data.spider import load_split
from caper_jax.eval import verifier
from caper_jax.eval.ex import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, data_inputs
from caper_jax.prm.aggregates import AGGREGATES
from caper_jax.sql.semantics import SEMANTICS
from caper_jax.utils import atomic, cli
from caper_jax.utils import summary as summary_lib

FLAGS = flags.FLAGS

COMMANDS = ("rerank", "localize")
COMMON_FLAGS = ("prm", "data", "split", "batch_size", "max_len", "timeout_s")
COMMAND_FLAGS = {"rerank": COMMON_FLAGS + ("candidates", "aggregate", "semantics", "output", "max_rows"),
                 "localize": COMMON_FLAGS + ("predictions", "output_dir")}
REQUIRED = {"rerank": ("prm", "data", "candidates"), "localize": ("prm", "data", "predictions")}


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """The command's flags; defined only when it runs, so importing this module defines none."""
    flags.DEFINE_string("prm", None, "PRM trainer workdir, its checkpoints/, or an HF export dir.",
                        flag_values=flag_values)
    flags.DEFINE_string("data", None, "Dataset folder (Spider or BIRD layout).", flag_values=flag_values)
    flags.DEFINE_string("split", "dev", "Split name: <data>/<split>.json.", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 16, "Queries per PRM forward.", flag_values=flag_values)
    flags.DEFINE_integer("max_len", None, "PRM context (default: the training config's).", flag_values=flag_values)
    flags.DEFINE_float("timeout_s", DEFAULT_TIMEOUT_S, "Seconds per query.", flag_values=flag_values)
    flags.DEFINE_string("candidates", None, "rerank: JSON lines: index + candidates (or pred).",
                        flag_values=flag_values)
    flags.DEFINE_enum("aggregate", "min", AGGREGATES, "rerank: clause scores -> one query score.",
                      flag_values=flag_values)
    flags.DEFINE_enum("semantics", "spider", SEMANTICS, "rerank: result comparison.", flag_values=flag_values)
    flags.DEFINE_string("output", None, "rerank: per-line choice with clause scores (JSON lines).",
                        flag_values=flag_values)
    flags.DEFINE_integer("max_rows", DEFAULT_MAX_ROWS, "rerank: rows per result.", flag_values=flag_values)
    flags.DEFINE_string("predictions", None, "localize: JSON lines of failed predictions.", flag_values=flag_values)
    flags.DEFINE_string("output_dir", "localization_report", "localize: where the report goes.",
                        flag_values=flag_values)


def main(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> int:
    """``argv``: what absl left after the flags, the program and the command (rerank when none)."""
    command = list(argv[1:]) or ["rerank"]
    if len(command) != 1 or command[0] not in COMMANDS:
        cli.usage_error(f"usage: python -m caper_jax.verify [{'|'.join(COMMANDS)}] [flags]")
    command = command[0]
    cli.check_command(flag_values, f"verify {command}", defined=COMMAND_FLAGS["rerank"] + COMMAND_FLAGS["localize"],
                      reads=COMMAND_FLAGS[command], required=REQUIRED[command])
    from caper_jax.prm import scoring  # JAX and the PRM load once the flags are checked

    f = flag_values
    started = time.perf_counter()
    try:
        load_split(f.data, f.split)  # bad data and bad outputs fail before the model is loaded
        if command == "localize":
            atomic.check_output_dir(f.output_dir, inputs=data_inputs(f.data, f.predictions, f.prm))
        elif f.output is not None:
            atomic.check_output(f.output, inputs=data_inputs(f.data, f.candidates))
        scorer = scoring.load_scorer(f.prm, batch_size=f.batch_size, max_len=f.max_len)
        if command == "localize":
            rows, skipped = verifier.read_failures(f.data, f.split, f.predictions, timeout_s=f.timeout_s)
            results = verifier.localization_report(scorer, rows, f.output_dir, skipped)
            summary = {"n": results["n"], "skipped": skipped, "output_dir": str(f.output_dir),
                       **{f"{m}_top1": s["top1"] for m, s in results["localization"].items()},
                       **{f"{m}_mrr": s["mrr"] for m, s in results["localization"].items()}}
        else:
            summary = verifier.rerank(scorer, f.data, f.split, f.candidates, aggregate=f.aggregate,
                                        semantics=f.semantics, output=f.output, timeout_s=f.timeout_s,
                                        max_rows=f.max_rows)
    except (FileNotFoundError, ValueError) as error:   # DataError, CheckpointError, ScoringError, OutputError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:  # Ctrl-C, inside a SQLite query too: no summary, outputs as they were
        where = f" ({error})" if str(error) else ""
        print(f"interrupted{where}: verify stopped; no summary, outputs left as they were", file=sys.stderr)
        return 130
    print(json.dumps(summary), flush=True)
    seconds = time.perf_counter() - started
    if command == "localize":   # on stderr: the last stdout line stays the JSON
        summary_lib.verify_localize_run(results, skipped, f.output_dir, seconds)
    else:
        summary_lib.verify_rerank_run(summary, f.candidates, f.semantics, seconds, output=f.output)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
