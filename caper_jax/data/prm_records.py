"""Clause-PRM preference records: validated dicts by index, from a JSONL file or any random-access source.

A record is one preference tuple as the annotator writes it (``caper_jax.sql.tuples.PreferenceTuple``):
``REQUIRED_KEYS``, plus optional fields such as ``provenance`` and ``negative_sql``. Every record is
decoded and validated on read; a bad one fails with its index (``RecordError``), so the training
input (``caper_jax.data.prm_training_batches``) rejects it when it is built, before any accelerator
time is spent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import grain
import numpy as np

from caper_jax.sql.contract import CLAUSE_IDS

REQUIRED_KEYS = (
    "question", "schema", "clause", "prefix_chosen", "chosen", "prefix_rejected", "rejected", "margin",
)
WITHIN_PROVENANCE = "within:"


class PipelineError(ValueError):
    """Base class of the pipeline's input errors."""


class RecordError(PipelineError):
    """A preference record is malformed (missing key, wrong type, bad margin, unknown clause)."""


class JsonlSource(grain.sources.RandomAccessDataSource):
    """Random access to the lines of a JSON-lines file (byte offsets indexed once; pread per read)."""

    def __init__(self, path: str | os.PathLike):
        self._path = os.fspath(path)
        offsets = []
        position = 0
        with open(self._path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append((position, len(line)))
                position += len(line)
        self._spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        self._fd = os.open(self._path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, index: int) -> bytes:
        start, size = self._spans[index]
        return os.pread(self._fd, int(size), int(start))

    def __repr__(self) -> str:
        return f"JsonlSource({self._path!r}, {len(self)} records)"

    def __del__(self, _close=os.close) -> None:
        # os.close bound at definition: at interpreter exit the module global may already be gone.
        if hasattr(self, "_fd"):
            _close(self._fd)


def _plain(value: Any) -> Any:
    """TFDS/ArrayRecord features come back as bytes and numpy scalars; the pipeline wants str/float."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic):
        return _plain(value.item())
    return value


def decode_record(raw: Any, index: int = -1) -> dict[str, Any]:
    """One record (JSON bytes/str, a mapping of features, or a PreferenceTuple) -> validated dict."""
    try:
        if isinstance(raw, (bytes, str)):
            record = json.loads(raw)
        elif dataclasses.is_dataclass(raw) and not isinstance(raw, type):
            record = dataclasses.asdict(raw)
        elif isinstance(raw, Mapping):
            record = {key: _plain(value) for key, value in raw.items()}
        else:
            raise RecordError(f"record {index}: unsupported type {type(raw).__name__}")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecordError(f"record {index}: not valid JSON/UTF-8: {error}") from error
    if not isinstance(record, dict):
        raise RecordError(f"record {index}: expected a JSON object, got {type(record).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in record]
    if missing:
        raise RecordError(f"record {index}: missing keys {missing}")
    for key in REQUIRED_KEYS[:-1]:
        if not isinstance(record[key], str):
            raise RecordError(f"record {index}: {key!r} must be a string, got {type(record[key]).__name__}")
    margin = record["margin"]
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin <= 0:
        raise RecordError(f"record {index}: margin must be a finite number > 0, got {margin!r}")
    if not record["chosen"].strip() or not record["rejected"].strip():
        raise RecordError(f"record {index}: empty chosen/rejected clause")
    clause_id(record["clause"], index)  # fail early on an unknown clause name
    return record


class Records:
    """Validated record dicts by index, from a JSONL path, a random-access source or an iterable.

    Accepted: a ``.jsonl`` path; any object with ``__len__``/``__getitem__`` (grain
    RandomAccessDataSource such as ArrayRecordDataSource or a TFDS ``as_data_source()``, a list)
    whose items are JSON bytes/str, feature mappings or PreferenceTuples; any other iterable (a
    stream) is read into memory first, because the global length-bucketed plan needs random access.
    Plain indexing rather than a Grain MapDataset: records are read 64 at a time inside one batch
    element, where Grain's per-element bookkeeping cost as much as the decoding (measured).
    """

    def __init__(self, source: Any):
        if isinstance(source, (str, os.PathLike)):
            source = JsonlSource(source)
        elif not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            if not isinstance(source, Iterable):
                raise TypeError(f"unsupported record source: {type(source).__name__}")
            source = list(source)
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return decode_record(self.source[index], index)


def clause_id(name: str, index: int = -1) -> int:
    """``CLAUSE_IDS`` of a clause unit name (case and inner whitespace ignored); RecordError if unknown."""
    key = " ".join(name.upper().split())
    try:
        return CLAUSE_IDS[key]
    except KeyError:
        raise RecordError(f"record {index}: unknown clause name {name!r}; known: {sorted(CLAUSE_IDS)}") from None


def is_within(record: Mapping[str, Any]) -> bool:
    """A within-trajectory tuple: both states are clauses of one wrong query (``within:*`` provenance)."""
    return str(record.get("provenance", "")).startswith(WITHIN_PROVENANCE)


def is_counterfactual(record: Mapping[str, Any]) -> bool:
    return str(record.get("provenance", "")).removeprefix(WITHIN_PROVENANCE) == "counterfactual"

