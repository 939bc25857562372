"""``python -m caper_jax.annotate {localize,tuples,inject,build}``: the annotation command line.

    localize --db PATH.sqlite --input IN.jsonl --output OUT.jsonl
        Input lines: {"gold", "pred", ["question"]}. Output lines repeat them and add "correct"
        (by execution), "root_clause" (null when correct), "clause_rewards" (clause -> reward <= 0),
        "root_node" (SQL text of v*), "edit_script", plus "corrected_sql", "reason" and "root_key".
    tuples --db PATH.sqlite --input IN.jsonl --output OUT.jsonl
        Input lines: {"gold", "pred", ["question"]}. One output line per preference pair the line
        yields (counterfactual and within-trajectory): ``PreferenceTuple.as_dict()`` plus "line"
        (the input line number), "positive_sql" (the whole query the chosen state is cut from: the
        repaired query, or for a within-trajectory pair the prediction itself) and "dropped" (null,
        or the invariant the pair breaks, ``caper_jax.sql.invariants``: such a pair is shown, never
        trained on). A correct prediction or a suspect failure yields none (noted on stderr); the
        dropped pairs are counted by reason at the end.
    inject --db PATH.sqlite --input IN.jsonl --output OUT.jsonl [--per_query K]
        Input lines: {"gold", ...}. One output line per verified negative: "gold", "negative",
        "clause", "mutation", "margin" (delta at the mutated clause), "root_node".
    build --config=configs/annotate.py[:arg] [--config.field=value ...] [--beam [--beam_options=...]]
        The TFDS ArrayRecord dataset, with a progress bar and a final summary. ``--beam`` annotates
        in an Apache Beam pipeline (local DirectRunner by default; docs/scale.md).

A malformed input line (not UTF-8, not JSON, a lone surrogate such as ``"\\ud800"``, not an object, a
required field missing or not a string, a gold query that does not run) is reported on stderr with
its line number and skipped; so is a line on which annotation itself fails (reported as an internal
error, with the exception). The other lines are still written. Annotation settings (alpha, sigma,
margin floor, ...) come from ``--config``, by default configs/annotate.py's defaults (the same values
as ``AnnotationSettings``).

Before any work, one line on stderr and exit status 2 for: a ``--db`` that is missing or not a
SQLite database, a missing ``--input``, an ``--output`` that is (or resolves to) the input or the
database, or whose directory is missing or read-only, a negative ``limit``, ``--beam`` without
apache-beam. The output is written to a temporary file next to it and renamed into place at the
end (caper_jax/utils/atomic.py), so it never holds a partial result. Ctrl-C stops the run (SQLite
queries included) with exit status 130 and leaves the output as it was. Otherwise the exit status
is 0.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pathlib
import random
import sys
from collections.abc import Callable, Iterator

from absl import app, flags
from ml_collections import config_flags

from caper_jax.demo.world import build_demo_world
from caper_jax.settings import Settings, from_config
from caper_jax.sql.execution import Executor
from caper_jax.sql.localize import GoldError, localize
from caper_jax.utils import atomic, cli
from caper_jax.utils.jsonl import LineError, read_json_lines
from caper_jax.sql.mutations import inject_faults
from caper_jax.sql.schema import Schema
from caper_jax.sql.contract import serialize_schema
from caper_jax.sql.tuples import AnnotationSettings, Context, annotate_prediction, mutation_rewards, tables_entry

COMMANDS = ("localize", "inject", "tuples", "build")

frozen = dataclasses.dataclass(frozen=True, kw_only=True)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags; defined only when it runs, so importing this module defines none."""
    flags.DEFINE_string("db", None, "SQLite database (localize, tuples, inject).")
    flags.DEFINE_string("input", None, "Input JSON lines (localize, tuples, inject).")
    flags.DEFINE_string("output", None, "Output JSON lines (localize, tuples, inject).")
    flags.DEFINE_integer("per_query", None, "Negatives per gold query (inject); default: the config's.")
    config_flags.DEFINE_config_file("config", None, "configs/annotate.py[:arg] (build; optional otherwise).")
    flags.DEFINE_bool("beam", False, "build: annotate in an Apache Beam pipeline (pip install apache-beam).")
    flags.DEFINE_string("beam_options", "--runner=DirectRunner --direct_num_workers=0 "
                        "--direct_running_mode=multi_processing",
                        "build --beam: Beam pipeline options (default: local DirectRunner, one worker per core).")


def parse_flags(argv: list[str]) -> list[str]:
    """absl parsing; a bad flag or config override is one line and exit status 2, no traceback."""
    return cli.parse_flags(argv, FLAGS, config="annotate config")


class InputError(ValueError):
    """One input line cannot be processed; the run reports it and goes on."""


@frozen
class BuildData:
    manual_dir: str                  # Spider/BIRD layout; demo: built here when empty
    splits: tuple[str, ...]
    limit: int                       # per split: N questions + N prediction lines (0 = all)
    predictions: bool                # also read predictions_<split>.jsonl if present
    demo_seed: int
    database_dir: str                # "" = the layout's database folders; else a folder under manual_dir

    def __post_init__(self):
        if self.limit < 0:
            raise ValueError(f"data.limit={self.limit!r}: must be an integer >= 0 (per split, at most N questions "
                             "and N prediction lines; 0 = all)")


@frozen
class AnnotateSettings(Settings):
    """configs/annotate.py: the build's source and output, and every field of ``AnnotationSettings``."""
    name: str                        # TFDS config name prefix: demo | spider | bird
    data_dir: str                    # TFDS data_dir; empty: ~/tensorflow_datasets
    data: BuildData
    alpha: float
    sigma: float
    margin_floor: float
    reference_edges: bool
    within_trajectory: bool
    per_query: int
    compound: int
    site_balance: str
    max_attempts: int                # mutants executed per gold; 0: 8 * per_query
    semantics: str
    suspect_tuples: bool
    max_vm_steps: int
    timeout_s: float
    max_rows: int
    seed: int

    def __post_init__(self):
        self.annotation   # alpha, sigma, floor, per_query, compound, site_balance, semantics

    @property
    def annotation(self) -> AnnotationSettings:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(AnnotationSettings)}
        return AnnotationSettings(**{**values, "max_attempts": self.max_attempts or None})


def read_lines(path: str | pathlib.Path,
               required: tuple[str, ...]) -> Iterator[tuple[int, dict | InputError]]:
    """(line number, record or the error that line has), for every non-blank line.

    Each line is decoded as UTF-8 on its own: a line with invalid bytes (or a lone surrogate) is an
    error of that line, never replaced by U+FFFD and written back as if it were the input.
    """
    for number, record in read_json_lines(path):
        if isinstance(record, LineError):
            yield number, InputError(str(record))
            continue
        if not isinstance(record, dict):
            yield number, InputError(f"not a JSON object: {type(record).__name__}")
            continue
        missing = [k for k in required if not isinstance(record.get(k), str)]
        if missing:
            yield number, InputError(f"field(s) {', '.join(missing)} missing or not a string")
            continue
        yield number, record


def process_file(input_path: str, output_path: str, required: tuple[str, ...],
                 handle: Callable[[dict, int], list[dict]], log=sys.stderr) -> dict[str, int]:
    """Runs ``handle(record, line number)`` on every good line; writes its outputs; reports and
    skips bad lines.

    The output appears (renamed from a temporary file) only when every line was processed.
    """
    counts = {"lines": 0, "written": 0, "skipped": 0}
    with atomic.AtomicWriter(output_path) as out:
        for number, record in read_lines(input_path, required):
            counts["lines"] += 1
            if isinstance(record, InputError):
                counts["skipped"] += 1
                print(f"{input_path}:{number}: skipped: {record}", file=log)
                continue
            try:
                results = handle(record, number)
            except (InputError, GoldError) as e:
                counts["skipped"] += 1
                print(f"{input_path}:{number}: skipped: {e}", file=log)
                continue
            except Exception as e:  # noqa: BLE001 -- one line must never end the run
                counts["skipped"] += 1
                print(f"{input_path}:{number}: skipped: internal error {type(e).__name__}: {e}", file=log)
                continue
            for result in results:
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                counts["written"] += 1
    print(f"{counts['lines']} lines, {counts['written']} written, {counts['skipped']} skipped",
          file=log)
    return counts


def run_localize(db: str, input_path: str, output_path: str, settings: AnnotationSettings) -> dict[str, int]:
    schema = Schema.from_sqlite(db)
    with Executor(db, timeout_s=settings.timeout_s, max_rows=settings.max_rows,
                  max_vm_steps=settings.max_vm_steps) as executor:
        def handle(record: dict, _number: int) -> list[dict]:
            result = localize(record["gold"], record["pred"], executor, schema, alpha=settings.alpha,
                              sigma=settings.sigma, reference_edges=settings.reference_edges,
                              semantics=settings.semantics)
            return [{**record, **result.as_dict()}]
        return process_file(input_path, output_path, ("gold", "pred"), handle)


def run_inject(db: str, input_path: str, output_path: str, settings: AnnotationSettings) -> dict[str, int]:
    schema = Schema.from_sqlite(db)
    with Executor(db, timeout_s=settings.timeout_s, max_rows=settings.max_rows,
                  max_vm_steps=settings.max_vm_steps) as executor:
        def handle(record: dict, _number: int) -> list[dict]:
            gold = record["gold"]
            if not executor.execute(gold).ok:
                raise GoldError(f"gold query does not run: {executor.execute(gold).error}")
            rng = random.Random(f"{settings.seed}\x00{gold}")
            try:
                negatives = inject_faults(gold, executor, schema, settings.per_query, rng,
                                          max_attempts=settings.max_attempts, compound=settings.compound,
                                          balance=settings.site_balance, semantics=settings.semantics)
            except ValueError as e:     # SqlParseError
                raise InputError(f"gold query does not parse: {e}") from e
            out = []
            for negative in negatives:
                rewards = mutation_rewards(negative, alpha=settings.alpha, sigma=settings.sigma,
                                           reference_edges=settings.reference_edges, schema=schema)
                out.append({"gold": gold, "negative": negative.sql, "clause": negative.clause,
                            "mutation": negative.mutation, "margin": -rewards.get(negative.clause, 0.0),
                            "root_node": negative.root_node_sql})
            return out
        return process_file(input_path, output_path, ("gold",), handle)


def run_tuples(db: str, input_path: str, output_path: str, settings: AnnotationSettings,
               log=sys.stderr) -> dict[str, int]:
    """The pairs each (gold, pred) line yields: kept ones, then dropped ones with their reason."""
    schema = Schema.from_sqlite(db)
    schema_text = serialize_schema(tables_entry(schema))
    dropped: collections.Counter = collections.Counter()
    with Executor(db, timeout_s=settings.timeout_s, max_rows=settings.max_rows,
                  max_vm_steps=settings.max_vm_steps) as executor:
        def handle(record: dict, number: int) -> list[dict]:
            context = Context(str(record.get("question", "")), schema.db_id, schema_text, record["gold"])
            annotation = annotate_prediction(context, record["pred"], executor, schema, settings)
            if annotation.error == "gold_fails":
                raise GoldError("gold query does not parse or does not run")
            if not annotation.tuples and not annotation.dropped:
                why = "correct" if annotation.source == "correct" else next(iter(annotation.negatives_by_kind))
                print(f"{input_path}:{number}: no pairs ({why})", file=log)
            dropped.update(p.dropped for p in annotation.dropped)
            return [{**p.tuple.as_dict(), "line": number, "positive_sql": p.positive_sql, "dropped": p.dropped}
                    for p in annotation.pairs()]
        counts = process_file(input_path, output_path, ("gold", "pred"), handle, log=log)
    print(f"dropped pairs by reason: {dict(sorted(dropped.items()))}", file=log)
    return {**counts, "dropped": sum(dropped.values())}


def run_build(build: AnnotateSettings, beam_options: str | None = None) -> dict[str, dict]:
    """Builds the TFDS dataset; returns the summary per split.

    ``beam_options`` (a string of Beam pipeline flags) runs the annotation on Apache Beam.
    """
    from caper_jax.data import tfds_caper      # tensorflow_datasets only for this command
    import tensorflow_datasets as tfds  # TFDS only for this command

    settings = build.annotation
    check_build(build, beam=beam_options is not None)
    manual_dir = build.data.manual_dir
    if build.name == "demo" and not manual_dir:
        manual_dir = str(pathlib.Path(build.data_dir or tfds.core.constants.DATA_DIR).expanduser()
                         / "caper_demo_world")
    if build.name == "demo":   # reuses a finished build with the same settings
        build_demo_world(manual_dir, seed=build.data.demo_seed)
    if not manual_dir:
        cli.usage_error("set --build.data.manual_dir to a Spider/BIRD layout directory")
    splits = build.data.splits
    options = dict(splits=splits, limit=build.data.limit, predictions=build.data.predictions,
                   database_dir=build.data.database_dir)
    download_config = tfds.download.DownloadConfig(manual_dir=manual_dir)
    if beam_options is not None:
        from apache_beam.options.pipeline_options import PipelineOptions  # apache_beam: --beam_options only

        download_config = tfds.download.DownloadConfig(
            manual_dir=manual_dir, beam_options=PipelineOptions(flags=beam_options.split()))
    builder = tfds_caper.CaperTuples(
        data_dir=build.data_dir or None, use_beam=beam_options is not None,
        config=tfds_caper.CaperConfig(
            name=config_name(build.name, settings, {**options, "source": str(pathlib.Path(manual_dir).resolve())}),
            settings=settings, **options))
    builder.download_and_prepare(download_config=download_config)
    summary = {}
    for split in splits:
        path = pathlib.Path(builder.data_dir) / f"summary_{split}.json"
        summary[split] = json.loads(path.read_text()) if path.is_file() else {}
    print(f"dataset: {builder.data_dir}")
    for split, s in summary.items():
        print(f"[{split}] {s.get('trajectories', '?')} trajectories -> {s.get('tuples', '?')} tuples; "
              f"sources {s.get('sources', {})}; errors {s.get('errors', {})}; "
              f"dropped by invariant {s.get('dropped_by_reason', {})}")
        for kind, y in s.get("yield_by_kind", {}).items():
            print(f"    {kind:16s} negatives {y['negatives']:6d}  tuples {y['tuples']:6d}")
        suspects = {k.split(":", 1)[1]: y["negatives"] for k, y in s.get("yield_by_kind", {}).items()
                    if k.startswith("suspect:")}
        if suspects:    # failures that may answer the question (docs/annotation.md section 2a)
            print(f"    suspect failures by reason {suspects}"
                  f"{'' if settings.suspect_tuples else ' (no tuples: suspect_tuples=False)'}")
    return summary


def check_build(build: AnnotateSettings, *, beam: bool) -> None:
    """What ``build`` can refuse before any work, beyond the settings' own values: raises ValueError, one line."""
    if build.data.manual_dir and not pathlib.Path(build.data.manual_dir).is_dir():
        raise ValueError(f"data.manual_dir={build.data.manual_dir!r} is not a directory")
    if build.data_dir:
        atomic.check_output_dir(build.data_dir, flag="data_dir")
    if beam:
        try:
            import apache_beam  # noqa: F401
        except ImportError:
            raise ValueError("--beam needs apache-beam, which is not installed (pip install apache-beam)") from None


def config_name(source: str, settings: AnnotationSettings, options: dict) -> str:
    """``<source>_<hash of everything that changes the data>``: new settings, new directory."""
    key = json.dumps([dataclasses.asdict(settings), options], sort_keys=True)
    return f"{source}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def check_files(db: str, input_path: str, output_path: str) -> None:
    """localize / tuples / inject: every file problem, before any work; raises ValueError with one line."""
    atomic.check_sqlite_database(db, "--db")
    if not pathlib.Path(input_path).is_file():
        raise ValueError(f"--input {input_path}: no such file")
    atomic.check_output(output_path, inputs=(input_path, db), flag="--output")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        cli.usage_error(f"usage: python -m caper_jax.annotate {{{','.join(COMMANDS)}}} [flags]")
    command = argv[1]
    if (problem := cli.config_load_error(FLAGS.config)) is not None:
        cli.usage_error(problem)
    if command == "build" and FLAGS.config is None:
        cli.usage_error("build needs --config=configs/annotate.py[:arg]")
    for name in ("db", "input", "output") if command != "build" else ():
        if not getattr(FLAGS, name):
            cli.usage_error(f"{command} needs --{name}")
    try:    # everything that can be refused, before any work: one line, no traceback
        build = None if FLAGS.config is None else from_config(AnnotateSettings, FLAGS.config)
        settings = AnnotationSettings() if build is None else build.annotation
        if command == "inject" and FLAGS.per_query is not None:
            settings = dataclasses.replace(settings, per_query=FLAGS.per_query)   # checked here, not mid-run
        if command == "build":
            check_build(build, beam=FLAGS.beam)
        else:
            check_files(FLAGS.db, FLAGS.input, FLAGS.output)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    try:
        if command == "build":
            run_build(build, beam_options=FLAGS.beam_options if FLAGS.beam else None)
        elif command == "localize":
            run_localize(FLAGS.db, FLAGS.input, FLAGS.output, settings)
        elif command == "tuples":
            run_tuples(FLAGS.db, FLAGS.input, FLAGS.output, settings)
        else:
            run_inject(FLAGS.db, FLAGS.input, FLAGS.output, settings)
    except KeyboardInterrupt as error:  # Ctrl-C, inside a SQLite query too
        where = f" ({error})" if str(error) else ""
        left = "the dataset was not completed" if command == "build" else f"{FLAGS.output} left as it was"
        print(f"interrupted{where}: {command} stopped; {left}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
