"""Clause-PRM input pipeline: preference tuples -> length-bucketed, host-sliced batches (Grain).

Design (docs/pipeline.md has the full story):

* **One global plan, many hosts.** In SPMD training every host must feed the same sequence length
  at every step, or the host slices cannot be stitched into one global array. So the batch plan
  (which records form global batch ``s`` and at which bucket length) is a pure function of
  ``(seed, epoch, per-record lengths)`` that every host computes identically; a host then reads and
  tokenises only its own contiguous rows of each global batch. Per-host shuffling followed by
  per-host bucketing (the obvious Grain chain) would let hosts disagree on the length.
* **Plan = one stable sort.** Per epoch: permute the records, stable-sort the permutation by
  bucket, cut it into chunks of ``global_batch_size`` and shuffle the chunk order. A chunk that
  straddles two buckets takes the longer one, so leftovers of a bucket are carried up into the next
  and only the very last chunk of an epoch is partial (padded with ``weight == 0`` rows). Hence
  ``steps_per_epoch == ceil(num_records / global_batch_size)`` in every epoch.
* **Everything is a Grain MapDataset.** ``range(steps_per_epoch).repeat(num_epochs)
  .map_with_index(load)``: random access by step index, so the iterator state is one integer and
  ``get_state``/``set_state`` resume exactly, in any epoch, with Grain's threaded prefetch.
* **Lengths are measured once**, at construction: every record is tokenised (prompts are cached
  per (question, schema)) to find its bucket. Bad records fail here, with their index, before any
  accelerator time is spent.
* **Sequence** = ``prompt_ids(question, schema) ++ sql_ids(prefix + clause)``, tokenised as two
  pieces without special tokens, so the prompt is tokenised once per question and the training
  sequence is exactly the first tokens of the evaluation sequence that ``score_batch`` builds for
  the whole query. Too long: tokens are dropped from the LEFT (prompt first, then the SQL prefix);
  the clause itself is never cut (``ClauseTooLongError``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grain
import numpy as np

REQUIRED_KEYS = (
    "question", "schema", "clause", "prefix_chosen", "chosen", "prefix_rejected", "rejected", "margin",
)
BATCH_KEYS = (
    "chosen_ids", "chosen_mask", "chosen_pos", "rejected_ids", "rejected_mask", "rejected_pos",
    "margin", "clause_id", "weight", "record_index",
)
# clause_id: index into caper_jax.sql.clauses.CLAUSE_NAMES (0..6); every compound operator unit
# (UNION, UNION ALL, INTERSECT, EXCEPT) shares COMPOUND_CLAUSE_ID; a WITH unit gets WITH_CLAUSE_ID.
COMPOUND_CLAUSE_ID = 7
WITH_CLAUSE_ID = 8
NUM_CLAUSE_IDS = 9

PromptFn = Callable[[str, str], str]


class PipelineError(ValueError):
    """Base class of the pipeline's input errors."""


class RecordError(PipelineError):
    """A preference record is malformed (missing key, wrong type, bad margin, unknown clause)."""


class ClauseTooLongError(PipelineError):
    """The clause alone has more tokens than max_len, so no truncation can keep it whole."""


class Tokenizer(Protocol):
    """What the pipeline needs of a tokenizer: HF-style batch __call__ (fast tokenizers add offsets)."""

    def __call__(self, text: list[str], **kwargs: Any) -> Mapping[str, Any]: ...


# ---------------------------------------------------------------------------------------------
# Records


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

    def __del__(self) -> None:
        if hasattr(self, "_fd"):
            os.close(self._fd)


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


@functools.cache
def _clause_ids() -> dict[str, int]:
    from caper_jax.sql.clauses import CLAUSE_NAMES, COMPOUND_NAMES, WITH_NAME  # sql/ never imports jax

    ids = {name: i for i, name in enumerate(CLAUSE_NAMES)}
    ids.update({name: COMPOUND_CLAUSE_ID for name in COMPOUND_NAMES})
    ids[WITH_NAME] = WITH_CLAUSE_ID
    return ids


def clause_id(name: str, index: int = -1) -> int:
    """Index of a clause unit name (case and inner whitespace ignored); RecordError if unknown."""
    key = " ".join(name.upper().split())
    try:
        return _clause_ids()[key]
    except KeyError:
        raise RecordError(f"record {index}: unknown clause name {name!r}; known: {sorted(_clause_ids())}") from None


# ---------------------------------------------------------------------------------------------
# Tokenisation


def join_sql(prefix: str, clause: str) -> str:
    """prefix + clause, with one space between them if neither side brings whitespace.

    Prefixes are ``sql[:unit.start]`` (trailing gap included); the space only guards producers that
    strip it. Trailing whitespace of the clause is dropped so the last token is a clause token.
    """
    clause = clause.rstrip()
    if prefix and not prefix[-1].isspace() and clause and not clause[0].isspace():
        return prefix + " " + clause
    return prefix + clause


def default_prompt_fn() -> PromptFn:
    try:
        from caper_jax.data.prompts import prm_prompt
    except ImportError as error:
        raise ImportError("caper_jax.data.prompts.prm_prompt is unavailable; pass prompt_fn=") from error
    return prm_prompt


def _token_ids(tokenizer: Tokenizer, texts: list[str], offsets: bool = False) -> Any:
    if not texts:  # HF tokenizers fail on an empty batch (a host slice of padding rows only)
        return {"input_ids": [], "offset_mapping": []}
    kwargs = {"add_special_tokens": False}
    if offsets:
        kwargs["return_offsets_mapping"] = True
    try:
        return tokenizer(texts, **kwargs)
    except NotImplementedError as error:  # slow (Python) tokenizers have no offsets
        raise TypeError("character offsets need a fast tokenizer (return_offsets_mapping=True)") from error


class ClauseEncoder:
    """Tokenises ``prompt(question, schema) + prefix + clause`` and truncates from the left."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, prompt_fn: PromptFn | None = None,
                 prompt_cache_size: int = 8192):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.prompt_fn = prompt_fn if prompt_fn is not None else default_prompt_fn()
        # Many tuples share a question: tokenise each prompt once (bounded, oldest out first).
        self._prompts: dict[tuple[str, str], np.ndarray] = {}
        self._cache_size = prompt_cache_size
        self._lock = threading.Lock()

    def prompt_ids(self, pairs: Sequence[tuple[str, str]]) -> list[np.ndarray]:
        """Token ids of prompt(question, schema) per pair; new prompts are tokenised in one call."""
        with self._lock:  # loader threads share the cache
            known = {pair: self._prompts[pair] for pair in set(pairs) if pair in self._prompts}
        missing = [pair for pair in dict.fromkeys(pairs) if pair not in known]
        if missing:
            texts = [self.prompt_fn(question, schema) for question, schema in missing]
            fresh = [np.asarray(ids, np.int32) for ids in _token_ids(self.tokenizer, texts)["input_ids"]]
            known.update(zip(missing, fresh))
            with self._lock:
                self._prompts.update(zip(missing, fresh))
                while len(self._prompts) > self._cache_size:
                    self._prompts.pop(next(iter(self._prompts)))
        return [known[pair] for pair in pairs]

    def encode(self, sides: Sequence[tuple[str, str, str, str]], indices: Sequence[int] | None = None
               ) -> list[np.ndarray]:
        """(question, schema, prefix, clause) per side -> input ids ending at the clause's last token.

        ``indices`` (record index per side) only name the culprit in errors.
        """
        texts = [join_sql(prefix, clause) for _, _, prefix, clause in sides]
        sql_ids = _token_ids(self.tokenizer, texts)["input_ids"]
        prompts = self.prompt_ids([(question, schema) for question, schema, _, _ in sides])
        indices = indices if indices is not None else [-1] * len(sides)
        out = []
        for (_, _, _, clause), text, ids, prompt, index in zip(sides, texts, sql_ids, prompts, indices):
            ids = np.asarray(ids, dtype=np.int32)
            if len(ids) > self.max_len:
                self._check_clause_fits(text, clause, index)
            out.append(np.concatenate([prompt, ids])[-self.max_len:])
        return out

    def _check_clause_fits(self, text: str, clause: str, index: int) -> None:
        clause_start = len(text) - len(clause.rstrip())
        try:
            offsets = _token_ids(self.tokenizer, [text], offsets=True)["offset_mapping"][0]
            n_clause = sum(1 for _, end in offsets if end > clause_start)
        except TypeError:  # slow tokenizer: count the clause on its own
            n_clause = len(_token_ids(self.tokenizer, [text[clause_start:]])["input_ids"][0])
        if n_clause > self.max_len:
            raise ClauseTooLongError(f"record {index}: clause has {n_clause} tokens > max_len={self.max_len}")


# ---------------------------------------------------------------------------------------------
# Buckets and the global plan


def default_bucket_lengths(max_len: int, multiple: int = 64) -> tuple[int, ...]:
    """Multiples of 64 on a x1.5 / x1.33 ladder: 64, 128, 192, 256, 384, 512, 768, 1024, ..., max_len.

    Padding stays under a third of a batch while jit sees about two shapes per doubling.
    """
    lengths, base = [], multiple
    while base < max_len:
        lengths += [n for n in (base, base * 3 // 2) if n < max_len and n % multiple == 0 and n not in lengths]
        base *= 2
    return tuple(lengths) + (max_len,)


def bucket_index(lengths: np.ndarray, bucket_lengths: Sequence[int]) -> np.ndarray:
    """Index of the shortest bucket that holds each length."""
    ladder = np.asarray(bucket_lengths)
    if np.any(np.diff(ladder) <= 0):
        raise ValueError(f"bucket_lengths must be strictly increasing, got {tuple(bucket_lengths)}")
    index = np.searchsorted(ladder, lengths, side="left")
    if np.any(index >= len(ladder)):
        raise ValueError(f"length {int(np.max(lengths))} exceeds the longest bucket {ladder[-1]}")
    return index.astype(np.int32)


def epoch_plan(buckets: np.ndarray, global_batch_size: int, seed: int, epoch: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Global batches of one epoch: (record indices [S, G], -1 = padding row; bucket per batch [S]).

    Shuffle, stable-sort by bucket, cut into chunks of G, shuffle the chunks. A chunk that straddles
    two buckets uses the longer, so only the last chunk is partial and S == ceil(N / G).
    """
    num = len(buckets)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num)
    order = order[np.argsort(buckets[order], kind="stable")]
    steps = -(-num // global_batch_size)
    rows = np.full(steps * global_batch_size, -1, dtype=np.int64)
    rows[:num] = order
    rows = rows.reshape(steps, global_batch_size)
    batch_bucket = np.max(np.where(rows >= 0, buckets[np.maximum(rows, 0)], -1), axis=1)
    chunk_order = rng.permutation(steps)
    return rows[chunk_order], batch_bucket[chunk_order].astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Batches


class _HostBatchLoader:
    """step index -> this host's rows of that global batch, tokenised and padded to the bucket."""

    def __init__(self, records: Records, encoder: ClauseEncoder, buckets: np.ndarray,
                 bucket_lengths: tuple[int, ...], global_batch_size: int, seed: int,
                 rows: slice, steps_per_epoch: int, pad_id: int):
        self.records, self.encoder, self.buckets = records, encoder, buckets
        self.bucket_lengths, self.global_batch_size, self.seed = bucket_lengths, global_batch_size, seed
        self.rows, self.steps_per_epoch, self.pad_id = rows, steps_per_epoch, pad_id
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:  # Grain reads steps from several threads
            if epoch not in self._plans:
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[epoch] = epoch_plan(self.buckets, self.global_batch_size, self.seed, epoch)
            return self._plans[epoch]

    def __call__(self, index: int, step: int) -> dict[str, np.ndarray]:
        rows, batch_bucket = self.plan(index // self.steps_per_epoch)
        length = self.bucket_lengths[batch_bucket[step]]
        return self.load(rows[step, self.rows], length)

    def load(self, record_indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
        size = len(record_indices)
        batch = {
            "margin": np.zeros(size, np.float32), "clause_id": np.zeros(size, np.int32),
            "weight": np.zeros(size, np.float32), "record_index": np.full(size, -1, np.int32),
        }
        for side in ("chosen", "rejected"):
            batch[f"{side}_ids"] = np.full((size, length), self.pad_id, np.int32)
            # Padding rows keep one visible token so no attention row is fully masked (NaN-free).
            batch[f"{side}_mask"] = np.zeros((size, length), np.int32)
            batch[f"{side}_mask"][:, 0] = 1
            batch[f"{side}_pos"] = np.zeros(size, np.int32)
        real = [(row, int(r)) for row, r in enumerate(record_indices) if r >= 0]
        records = [self.records[r] for _, r in real]
        sides = [_side(rec, side) for rec in records for side in ("chosen", "rejected")]
        encoded = self.encoder.encode(sides, [r for _, r in real for _ in range(2)])
        for k, ((row, r), rec) in enumerate(zip(real, records)):
            for j, side in enumerate(("chosen", "rejected")):
                ids = encoded[2 * k + j]
                batch[f"{side}_ids"][row, : len(ids)] = ids
                batch[f"{side}_mask"][row, : len(ids)] = 1
                batch[f"{side}_pos"][row] = len(ids) - 1
            batch["margin"][row] = rec["margin"]
            batch["clause_id"][row] = clause_id(rec["clause"], r)
            batch["weight"][row] = 1.0
            batch["record_index"][row] = r
        return batch


def pair_lengths(records: Records, encoder: ClauseEncoder, chunk: int = 1024) -> np.ndarray:
    """max(len(chosen sequence), len(rejected sequence)) per record, after truncation."""
    lengths = np.zeros(len(records), np.int32)
    for start in range(0, len(records), chunk):
        indices = range(start, min(start + chunk, len(records)))
        sides = [_side(rec, side) for rec in map(records.__getitem__, indices) for side in ("chosen", "rejected")]
        encoded = encoder.encode(sides, [i for i in indices for _ in range(2)])
        lengths[start: start + len(indices)] = [max(len(a), len(b)) for a, b in zip(encoded[::2], encoded[1::2])]
    return lengths


def _side(record: Mapping[str, Any], side: str) -> tuple[str, str, str, str]:
    return record["question"], record["schema"], record[f"prefix_{side}"], record[side]


def resolve_pad_id(tokenizer: Tokenizer, pad_id: int | None) -> int:
    if pad_id is not None:
        return pad_id
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


@dataclasses.dataclass(frozen=True)
class PrmPipeline:
    """The host's stream of PRM batches plus the facts a training loop needs about it."""

    dataset: grain.MapDataset  # step -> host batch dict (BATCH_KEYS), len = steps * epochs
    steps_per_epoch: int
    num_records: int
    bucket_lengths: tuple[int, ...]
    host_batch_size: int

    def iterator(self, num_threads: int = 2, prefetch: int = 4) -> grain.DatasetIterator:
        """Prefetching iterator with get_state()/set_state() (state = next step index)."""
        options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        return iter(self.dataset.to_iter_dataset(options))


def prm_pipeline(
    source: Any,
    tokenizer: Tokenizer,
    *,
    global_batch_size: int,
    max_len: int = 1024,
    bucket_lengths: Sequence[int] | None = None,
    seed: int = 0,
    num_epochs: int | None = 1,
    process_index: int = 0,
    process_count: int = 1,
    prompt_fn: PromptFn | None = None,
    pad_id: int | None = None,
) -> PrmPipeline:
    """Builds the host's PRM batch dataset. ``num_epochs=None`` repeats forever (new order per epoch).

    ``process_index``/``process_count`` are passed in (normally ``jax.process_index()`` and
    ``jax.process_count()``): host ``p`` gets rows ``[p * B, (p + 1) * B)`` of every global batch,
    ``B = global_batch_size // process_count``, the layout ``caper_jax.parallel.multihost.host_local_to_global`` expects.
    """
    if global_batch_size < 1 or process_count < 1 or global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"process_count={process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    ladder = tuple(int(n) for n in (bucket_lengths or default_bucket_lengths(max_len)))
    if ladder[-1] > max_len:
        raise ValueError(f"longest bucket {ladder[-1]} > max_len {max_len}")
    records = Records(source)
    if len(records) == 0:
        raise PipelineError("no preference records")
    encoder = ClauseEncoder(tokenizer, max_len, prompt_fn)
    buckets = bucket_index(pair_lengths(records, encoder), ladder)
    steps_per_epoch = -(-len(records) // global_batch_size)
    host_batch = global_batch_size // process_count
    loader = _HostBatchLoader(
        records, encoder, buckets, ladder, global_batch_size, seed,
        slice(process_index * host_batch, (process_index + 1) * host_batch), steps_per_epoch,
        resolve_pad_id(tokenizer, pad_id))
    dataset = grain.MapDataset.range(steps_per_epoch).repeat(num_epochs).map_with_index(loader)
    return PrmPipeline(dataset, steps_per_epoch, len(records), ladder, host_batch)


# ---------------------------------------------------------------------------------------------
# Evaluation: every clause of a query in one sequence


def score_batch(
    sql_rows: Sequence[Mapping[str, str]],
    tokenizer: Tokenizer,
    *,
    max_len: int = 1024,
    bucket_lengths: Sequence[int] | None = None,
    prompt_fn: PromptFn | None = None,
    pad_id: int | None = None,
    clause_multiple: int = 8,
) -> dict[str, np.ndarray]:
    """One sequence per query (``question``, ``schema``, ``sql``) with the last token of every clause.

    Returns ``input_ids``/``mask`` [B, L] (L = shortest bucket that fits), ``clause_pos`` and
    ``clause_id`` [B, K] (-1 padded; K rounded up to ``clause_multiple`` so jit sees few shapes).
    Too long: the leftmost tokens go (prompt first); a clause whose last token falls off gets -1.
    SQL that does not parse gets no clause positions (all -1); the model still sees its tokens.
    """
    from caper_jax.sql.clauses import SqlParseError, split_clauses

    if not sql_rows:
        raise ValueError("score_batch needs at least one row")
    ladder = tuple(bucket_lengths or default_bucket_lengths(max_len))
    encoder = ClauseEncoder(tokenizer, max_len, prompt_fn)
    sqls = [row["sql"].rstrip() for row in sql_rows]
    tokens = _token_ids(tokenizer, sqls, offsets=True)
    sequences, positions, names = [], [], []
    prompts = encoder.prompt_ids([(row["question"], row["schema"]) for row in sql_rows])
    for sql, ids, offsets, prompt in zip(sqls, tokens["input_ids"], tokens["offset_mapping"], prompts):
        full = np.concatenate([prompt, np.asarray(ids, np.int32)])
        shift = max(0, len(full) - max_len)
        try:
            units = split_clauses(sql)
        except SqlParseError:
            units = []
        starts = [start for start, _ in offsets]
        pos = [len(prompt) + bisect.bisect_left(starts, unit.end) - 1 - shift for unit in units]
        sequences.append(full[shift:])
        positions.append([p if p >= 0 else -1 for p in pos])
        names.append([clause_id(unit.name) for unit in units])
    longest = max(len(s) for s in sequences)
    length = ladder[bucket_index(np.asarray([longest]), ladder)[0]]
    width = max(clause_multiple, -(-max(len(p) for p in positions) // clause_multiple) * clause_multiple)
    out = {
        "input_ids": np.full((len(sql_rows), length), resolve_pad_id(tokenizer, pad_id), np.int32),
        "mask": np.zeros((len(sql_rows), length), np.int32),
        "clause_pos": np.full((len(sql_rows), width), -1, np.int32),
        "clause_id": np.full((len(sql_rows), width), -1, np.int32),
    }
    for b, (seq, pos, ids) in enumerate(zip(sequences, positions, names)):
        out["input_ids"][b, : len(seq)] = seq
        out["mask"][b, : len(seq)] = 1
        out["clause_pos"][b, : len(pos)] = pos
        out["clause_id"][b, : len(ids)] = [i if p >= 0 else -1 for i, p in zip(ids, pos)]
    return out
