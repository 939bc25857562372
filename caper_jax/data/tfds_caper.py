"""TFDS builder of clause preference tuples, written as ArrayRecord, read back without TensorFlow.

``manual_dir`` holds a Spider or BIRD layout, read by ``caper_jax.data.spider`` (the one reader)::

    questions per split     Spider dev.json, train_spider.json + train_others.json; BIRD dev.json |
                            dev/dev.json, train.json | train/train.json ("query" | "SQL")
    tables.json | <split>_tables.json             optional: the schema text of the PRM prompt
    database/<db_id>/<db_id>.sqlite               (BIRD: <split>_databases/, <split>/<split>_databases/)
    predictions_<split>.jsonl                     optional: {"db_id", "question", "gold", "pred"}

Every question yields fault-injection tuples on its gold query; every line of a predictions file
yields counterfactual tuples when its prediction is wrong (a correct prediction adds nothing: its
gold is already mutated through the questions file). One split of the dataset per split name.

ArrayRecord (``file_format='array_record'``) gives random access, so ``builder.as_data_source()``
feeds ``grain.MapDataset.source`` directly; text features come back as bytes. The annotation
settings are part of the builder config, so two settings never share a directory by accident:
the config name is chosen by the caller (``configs/annotate.py`` uses the data source's name) and
the settings are recorded in the dataset description.

The build keeps counts in ``builder.summary`` (tuples, tuples and negatives per mutation kind,
errors by kind) and writes them to ``summary_<split>.json`` next to the data.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Iterator

import numpy as np
from etils import epath
import tensorflow_datasets as tfds
from tqdm import tqdm

from caper_jax.data import spider as readers
from caper_jax.utils.jsonl import LineError, read_json_lines
from caper_jax.sql.contract import prompt_question
from caper_jax.sql.tuples import AnnotationSettings, AnnotationSummary, Annotator, PreferenceTuple

log = logging.getLogger("caper_jax")

_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(PreferenceTuple) if f.name != "margin")


class LayoutError(readers.DataError, FileNotFoundError):
    """The manual directory is not in Spider/BIRD layout (a ``DataError`` of the reader)."""


def read_trajectories(manual_dir: str | os.PathLike, split: str, *, predictions: bool = True,
                      limit: int = 0) -> list[dict]:
    """Trajectories of one split: gold questions first, then predictions (each capped at ``limit``).

    A question record (``caper_jax.data.spider.load_split``: Spider's train is train_spider.json +
    train_others.json) becomes ``{"question", "db_id", "gold"}``; a predictions line is kept as
    written (``pred`` included). Spider calls the gold ``query``, BIRD ``SQL``. Where a question has
    BIRD evidence (its record's, or for a predictions line its own ``evidence`` else its question's),
    ``question`` is ``contract.prompt_question(question, evidence)``: the text the prompts show.
    """
    try:
        examples = readers.load_split(manual_dir, split)
    except readers.DataError as e:
        raise LayoutError(str(e)) from e
    # The question as the prompts show it: BIRD's evidence as its Hint line (contract.prompt_question), so
    # that the PRM trains on the prompt GRPO's PRM reads. A predictions line without evidence of its own
    # takes its question's.
    shown = readers.ShownQuestions(examples)
    out = [{"question": prompt_question(ex.question, ex.evidence), "db_id": ex.db_id, "gold": ex.query}
           for ex in examples[:limit or None]]
    pred_path = pathlib.Path(manual_dir) / f"predictions_{split}.jsonl"
    if predictions and pred_path.is_file():
        lines = []
        # One bad line is only that line (as in every command that reads JSON lines): skipped with
        # its number, never ending the build nor read back with U+FFFD in place of its bytes.
        for number, value in read_json_lines(pred_path):
            if isinstance(value, LineError) or not isinstance(value, dict):
                why = value if isinstance(value, LineError) else f"a JSON {type(value).__name__}, not an object"
                log.warning("%s line %d skipped: %s", pred_path, number, why)
                continue
            if isinstance(value.get("question"), str):
                value = {**value, "question": shown(value)}
            lines.append(value)
        out.extend(lines[:limit or None])
    return out


def read_tables(manual_dir: str | os.PathLike, split: str | None = None) -> dict[str, dict]:
    """Schema records by db_id (``caper_jax.data.spider.load_schemas``: ``tables.json``, BIRD's
    ``<split>_tables.json``, ``split``'s own first); {} when the layout has no schema file.

    Schemas for mutations and canonicalisation are read from the SQLite files (what the data
    obeys); tables.json only gives the prompt's schema text, so that it matches what the PRM and
    policy pipelines serialise from the same file.
    """
    if not readers.schema_files(manual_dir, split):
        return {}
    try:
        return readers.load_schemas(manual_dir, split)
    except readers.DataError as e:
        raise LayoutError(str(e)) from e


def database_dirs(manual_dir: str | os.PathLike, split: str, database_dir: str = "") -> tuple[pathlib.Path, ...]:
    """Where a split's databases are: ``database_dir`` under ``manual_dir`` ("{split}" replaced) when
    set, else the layout's folders (``caper_jax.data.spider.database_dirs``, the split's own first)."""
    if database_dir:
        return (pathlib.Path(manual_dir) / database_dir.format(split=split),)
    found = readers.database_dirs(manual_dir, split)
    if not found:
        raise LayoutError(f"{manual_dir} has no database folder (database/, {split}_databases/, "
                          f"{split}/{split}_databases/)")
    return found


@dataclasses.dataclass(eq=False)
class CaperConfig(tfds.core.BuilderConfig):
    settings: AnnotationSettings = AnnotationSettings()
    splits: tuple[str, ...] = ("dev",)
    limit: int = 0
    predictions: bool = True
    database_dir: str = ""   # "" = the layout's (spider.database_dirs); else under manual_dir, "{split}" replaced


class CaperTuples(tfds.core.GeneratorBasedBuilder):
    """Clause-level preference tuples of CAPER (see module docstring)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Fault-injection and counterfactual tuples."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Point manual_dir at a Spider/BIRD layout (caper_jax/data/spider.py): "
                                    "questions per split, database/ or <split>_databases/, "
                                    "optional predictions_<split>.jsonl.")
    BUILDER_CONFIGS = [CaperConfig(name="spider"), CaperConfig(name="demo", splits=("train", "dev")),
                       CaperConfig(name="bird")]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS 4.9.10 derives this through importlib_resources, which it does not install; the
        # answer for a builder defined in a regular module is simply that module's file.
        return epath.Path(__file__)

    def __init__(self, *, show_progress: bool = True, use_beam: bool = False, **kwargs):
        """``use_beam``: annotate in an Apache Beam pipeline (``caper_jax.data.beam_annotate``); pass
        the runner through ``DownloadConfig(beam_options=...)``. Same records, same keys."""
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)
        self.show_progress = show_progress
        self.use_beam = use_beam
        self.summary: dict[str, dict] = {}

    def _info(self) -> tfds.core.DatasetInfo:
        features = {name: tfds.features.Text() for name in _TEXT_FIELDS}
        features["margin"] = tfds.features.Scalar(dtype=np.float32)
        return self.dataset_info_from_configs(
            description=f"CAPER clause preference tuples; settings: {self.builder_config.settings}",
            features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        manual_dir = dl_manager.manual_dir
        return {split: self._generate_examples(manual_dir, split) for split in self.builder_config.splits}

    def _generate_examples(self, manual_dir, split: str):
        config: CaperConfig = self.builder_config
        trajectories = read_trajectories(manual_dir, split, predictions=config.predictions,
                                         limit=config.limit)
        # Every gold is mutated through its question record; a correct prediction adds nothing.
        database_dir = database_dirs(manual_dir, split, config.database_dir)
        tables = read_tables(manual_dir, split)
        if self.use_beam:
            from caper_jax.data.beam_annotate import annotate_trajectories  # apache_beam: only a Beam build loads it

            summary_path = str(pathlib.Path(self.data_dir) / f"summary_{split}.json")
            return annotate_trajectories(trajectories, [str(d) for d in database_dir], config.settings, tables,
                                         summary_path)
        return self._annotate_here(trajectories, database_dir, tables, split)

    def _annotate_here(self, trajectories: list[dict], database_dir: tuple[pathlib.Path, ...], tables: dict[str, dict],
                       split: str) -> Iterator[tuple[str, dict]]:
        config: CaperConfig = self.builder_config
        annotator = Annotator(database_dir, config.settings, tables)
        summary = AnnotationSummary()
        try:
            for i, record in enumerate(tqdm(trajectories, desc=f"annotate {split}", unit="traj",
                                            disable=not self.show_progress)):
                annotation = annotator(record)
                summary.add(annotation)
                for j, t in enumerate(annotation.tuples):
                    yield f"{i}-{j}", t.as_dict()
        finally:
            annotator.close()
        self.summary[split] = summary.as_dict()
        out_dir = pathlib.Path(self.data_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"summary_{split}.json").write_text(json.dumps(self.summary[split], indent=2))


def decode(record: dict) -> PreferenceTuple:
    """A record from ``builder.as_data_source()`` (bytes text) back to a PreferenceTuple."""
    values = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in record.items()}
    values["margin"] = float(values["margin"])
    return PreferenceTuple(**values)
