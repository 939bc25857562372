"""TFDS builder of clause preference tuples, written as ArrayRecord, read back without TensorFlow.

``manual_dir`` holds a Spider/BIRD layout::

    dev.json | train_spider.json | train.json     questions: {"db_id", "question", "query" | "SQL"}
    tables.json | <split>_tables.json             optional: the schema text of the PRM prompt
    database/<db_id>/<db_id>.sqlite               (BIRD: <split>_databases/<db_id>/<db_id>.sqlite)
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

import collections
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator

import numpy as np
from etils import epath
import tensorflow_datasets as tfds
from tqdm import tqdm

from caper_jax.sql.tuples import AnnotationSettings, Annotator, PreferenceTuple

_SPLIT_FILES = {"train": ("train_spider.json", "train.json"), "dev": ("dev.json",),
                "test": ("test.json",)}
_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(PreferenceTuple) if f.name != "margin")


class LayoutError(FileNotFoundError):
    """The manual directory is not in Spider/BIRD layout."""


def split_file(manual_dir: str | os.PathLike, split: str) -> pathlib.Path:
    root = pathlib.Path(manual_dir)
    for name in _SPLIT_FILES.get(split, (f"{split}.json",)):
        if (root / name).is_file():
            return root / name
    raise LayoutError(f"no questions file for split {split!r} in {root} "
                      f"(looked for {', '.join(_SPLIT_FILES.get(split, (f'{split}.json',)))})")


def read_trajectories(manual_dir: str | os.PathLike, split: str, *, predictions: bool = True,
                      limit: int = 0) -> list[dict]:
    """Trajectories of one split: gold questions first, then predictions (each capped at ``limit``).

    A question record becomes ``{"question", "db_id", "gold"}``; a predictions line is kept as
    written (``pred`` included). Spider calls the gold ``query``, BIRD ``SQL``.
    """
    path = split_file(manual_dir, split)
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LayoutError(f"{path} is not JSON: {e}") from e
    out = []
    for entry in entries[:limit or None]:
        gold = entry.get("query", entry.get("SQL"))
        out.append({"question": entry.get("question", ""), "db_id": entry["db_id"], "gold": gold})
    pred_path = pathlib.Path(manual_dir) / f"predictions_{split}.jsonl"
    if predictions and pred_path.is_file():
        with pred_path.open() as f:
            lines = [json.loads(line) for line in f if line.strip()]
        out.extend(lines[:limit or None])
    return out


def read_tables(manual_dir: str | os.PathLike, split: str | None = None) -> dict[str, dict]:
    """``tables.json`` (BIRD: ``<split>_tables.json``) records by db_id; {} when there is none.

    Schemas for mutations and canonicalisation are read from the SQLite files (what the data
    obeys); tables.json only gives the prompt's schema text, so that it matches what the PRM and
    policy pipelines serialise from the same file.
    """
    root = pathlib.Path(manual_dir)
    for name in ([f"{split}_tables.json"] if split else []) + ["tables.json"]:
        if (root / name).is_file():
            return {entry["db_id"]: entry for entry in json.loads((root / name).read_text())}
    return {}


@dataclasses.dataclass(eq=False)
class CaperConfig(tfds.core.BuilderConfig):
    settings: AnnotationSettings = AnnotationSettings()
    splits: tuple[str, ...] = ("dev",)
    limit: int = 0
    predictions: bool = True
    database_dir: str = "database"   # under manual_dir; "{split}" is replaced (BIRD: "{split}_databases")


class CaperTuples(tfds.core.GeneratorBasedBuilder):
    """Clause-level preference tuples of CAPER (see module docstring)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Fault-injection and counterfactual tuples."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Point manual_dir at a Spider/BIRD layout: <split>.json, "
                                    "database/<db_id>/<db_id>.sqlite, optional predictions_<split>.jsonl.")
    BUILDER_CONFIGS = [CaperConfig(name="spider"), CaperConfig(name="demo", splits=("train", "dev")),
                       CaperConfig(name="bird", database_dir="{split}_databases")]

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
        database_dir = pathlib.Path(manual_dir) / config.database_dir.format(split=split)
        tables = read_tables(manual_dir, split)
        if self.use_beam:
            from caper_jax.data.beam_annotate import annotate_trajectories

            summary_path = str(pathlib.Path(self.data_dir) / f"summary_{split}.json")
            return annotate_trajectories(trajectories, str(database_dir), config.settings, tables, summary_path)
        return self._annotate_here(trajectories, database_dir, tables, split)

    def _annotate_here(self, trajectories: list[dict], database_dir: pathlib.Path, tables: dict[str, dict],
                       split: str) -> Iterator[tuple[str, dict]]:
        config: CaperConfig = self.builder_config
        annotator = Annotator(database_dir, config.settings, tables)
        summary = _Summary()
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


class _Summary:
    def __init__(self):
        self.trajectories = 0
        self.tuples = 0
        self.sources: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.negatives_by_kind: collections.Counter = collections.Counter()
        self.tuples_by_kind: collections.Counter = collections.Counter()

    def add(self, annotation) -> None:
        self.trajectories += 1
        self.tuples += len(annotation.tuples)
        self.sources[annotation.source] += 1
        if annotation.error:
            self.errors[annotation.error] += 1
        self.negatives_by_kind.update(annotation.negatives_by_kind)
        self.tuples_by_kind.update(annotation.tuples_by_kind)

    def as_dict(self) -> dict:
        kinds = sorted(set(self.negatives_by_kind) | set(self.tuples_by_kind))
        return {"trajectories": self.trajectories, "tuples": self.tuples,
                "sources": dict(self.sources), "errors": dict(self.errors),
                "yield_by_kind": {k: {"negatives": self.negatives_by_kind.get(k, 0),
                                      "tuples": self.tuples_by_kind.get(k, 0)} for k in kinds}}


def decode(record: dict) -> PreferenceTuple:
    """A record from ``builder.as_data_source()`` (bytes text) back to a PreferenceTuple."""
    values = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in record.items()}
    values["margin"] = float(values["margin"])
    return PreferenceTuple(**values)
