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
  the clause itself is never cut (``ClauseTooLongError``). A query's last clause arrives from the
  annotator as ``clause + END_OF_SQL`` (the end of the query is part of its state), so its score is
  read after the end-of-SQL token, where ``score_batch`` reads it in a whole query.
* **Within-trajectory groups** (``within_batch_size > 0``). Both sides of a within-trajectory tuple
  (``provenance`` ``within:*``) are prefixes of the same negative query, and the PRM is causal, so
  one forward pass of ``prompt ++ negative_sql`` scores all of them at once (the evaluation's
  ``score_batch`` encoding). The within tuples of one negative (same root state) form a *group*:
  a row ``group_ids`` [G, L] with ``group_pos`` [G, K] (slot 0 = the root state, slot k = the
  chosen state of the group's k-th tuple) and ``group_margin`` [G, K] (slot 0 and padding: 0). The
  loss over a group's slots is the same pair loss as over its tuples; only the forward passes are
  shared (2 per tuple become 1 per negative). Groups have their own global plan (same ``epoch_plan``
  over group lengths, ``within_batch_size`` per step) that cycles independently of the pair plan;
  a step's length is the longer of the two buckets. A within tuple that is not a prefix pair of its
  ``negative_sql``, or whose group does not fit the longest bucket, stays an ordinary pair.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grain
import numpy as np

from caper_jax.sql.contract import CLAUSE_IDS, END_OF_SQL, prm_prompt

REQUIRED_KEYS = (
    "question", "schema", "clause", "prefix_chosen", "chosen", "prefix_rejected", "rejected", "margin",
)
BATCH_KEYS = (
    "chosen_ids", "chosen_mask", "chosen_pos", "rejected_ids", "rejected_mask", "rejected_pos",
    "margin", "clause_id", "weight", "lm_weight", "record_index",
)
GROUP_KEYS = ("group_ids", "group_mask", "group_pos", "group_margin", "group_weight")
WITHIN_PROVENANCE = "within:"
GROUP_SLOT_MULTIPLE = 8   # group_pos/group_margin widths are rounded up to this (few shapes for jit)

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
        self.prompt_fn = prompt_fn if prompt_fn is not None else prm_prompt
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
                 rows: slice, steps_per_epoch: int, pad_id: int, pair_indices: np.ndarray,
                 groups: Sequence[WithinGroup] = (), group_buckets: np.ndarray | None = None,
                 group_batch_size: int = 0, group_rows: slice = slice(0, 0), group_slots: int = 0):
        self.records, self.encoder, self.buckets = records, encoder, buckets
        self.bucket_lengths, self.global_batch_size, self.seed = bucket_lengths, global_batch_size, seed
        self.rows, self.steps_per_epoch, self.pad_id = rows, steps_per_epoch, pad_id
        self.pair_indices = pair_indices     # plan row -> record index (all records without groups)
        self.groups, self.group_buckets, self.group_batch_size = groups, group_buckets, group_batch_size
        self.group_rows, self.group_slots = group_rows, group_slots
        self.group_encoder = GroupEncoder(encoder)
        self._plans: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def plan(self, epoch: int, kind: str = "pairs") -> tuple[np.ndarray, np.ndarray]:
        with self._lock:  # Grain reads steps from several threads
            key = (kind, epoch)
            if key not in self._plans:
                if len(self._plans) >= 4:
                    self._plans.pop(min(self._plans, key=lambda k: k[1]))
                buckets, size = ((self.buckets, self.global_batch_size) if kind == "pairs"
                                 else (self.group_buckets, self.group_batch_size))
                self._plans[key] = epoch_plan(buckets, size, self.seed, epoch)
            return self._plans[key]

    def __call__(self, index: int, step: int) -> dict[str, np.ndarray]:
        if len(self.buckets):
            rows, batch_bucket = self.plan(index // self.steps_per_epoch)
            plan_rows, bucket = rows[step, self.rows], int(batch_bucket[step])
        else:  # every record is in a group: the pair half of each batch is padding
            plan_rows, bucket = np.full(self.rows.stop - self.rows.start, -1), 0
        record_indices = (np.where(plan_rows >= 0, self.pair_indices[np.maximum(plan_rows, 0)], -1)
                          if len(self.pair_indices) else plan_rows)
        if not self.group_batch_size:
            return self.load(record_indices, self.bucket_lengths[bucket])
        # Groups cycle through their own plan, indexed by the global step (one integer of state).
        group_steps = -(-len(self.group_buckets) // self.group_batch_size)
        group_plan, group_bucket = self.plan(index // group_steps, "groups")
        length = self.bucket_lengths[max(bucket, int(group_bucket[index % group_steps]))]
        batch = self.load(record_indices, length)
        batch.update(self.load_groups(group_plan[index % group_steps, self.group_rows], length))
        return batch

    def load_groups(self, group_indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
        size, slots = len(group_indices), self.group_slots
        batch = {"group_ids": np.full((size, length), self.pad_id, np.int32),
                 "group_mask": np.zeros((size, length), np.int32),
                 "group_pos": np.full((size, slots), -1, np.int32),
                 "group_margin": np.zeros((size, slots), np.float32),
                 "group_weight": np.zeros(size, np.float32)}
        batch["group_mask"][:, 0] = 1  # padding rows keep one visible token (NaN-free attention)
        real = [(row, int(g)) for row, g in enumerate(group_indices) if g >= 0]
        encoded = self.group_encoder.encode([self.groups[g] for _, g in real])
        for (row, g), (ids, pos) in zip(real, encoded):
            batch["group_ids"][row, : len(ids)] = ids
            batch["group_mask"][row, : len(ids)] = 1
            batch["group_pos"][row, : len(pos)] = pos
            batch["group_margin"][row, 1 : len(pos)] = self.groups[g].margins
            batch["group_weight"][row] = 1.0
        return batch

    def load(self, record_indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
        size = len(record_indices)
        batch = {
            "margin": np.zeros(size, np.float32), "clause_id": np.zeros(size, np.int32),
            "weight": np.zeros(size, np.float32), "record_index": np.full(size, -1, np.int32),
            # 1 where the chosen side is SQL worth learning token by token (the PRM's auxiliary LM term):
            # gold, a repaired or a right prediction. A within-trajectory tuple's chosen side is a state
            # of the wrong query itself, after its wrong root clause when it comes later: 0.
            "lm_weight": np.zeros(size, np.float32),
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
            batch["lm_weight"][row] = 0.0 if is_within(rec) else 1.0
            batch["record_index"][row] = r
        return batch


@dataclasses.dataclass(frozen=True)
class WithinGroup:
    """The within-trajectory tuples of one negative query with one root state (module docstring)."""

    question: str
    schema: str
    sql: str                         # the negative query as scored whole (scored_text); every state is a prefix
    root_end: int                    # character end of the root (rejected) state in ``sql``
    chosen_ends: tuple[int, ...]     # character end of each tuple's chosen state
    margins: tuple[float, ...]
    records: tuple[int, ...]         # record index of each tuple


def _state_end(sql: str, prefix: str, clause: str) -> int | None:
    """End of ``join_sql(prefix, clause)`` in ``sql`` if that state is a prefix of ``sql``, else None."""
    text = join_sql(prefix, clause)
    return len(text) if text.strip() and sql.startswith(text) else None


def scored_text(sql: str) -> tuple[str, list]:
    """(the text the PRM reads for a whole query, its clause units).

    The clauses as written (a trailing ``;`` or comment dropped) followed by ``END_OF_SQL``: the end
    of the query is part of the last clause's state, as in the tuples (``caper_jax.sql.tuples``).
    SQL that does not split into clauses comes back stripped, with no units.
    """
    from caper_jax.sql.clauses import SqlParseError, split_clauses

    try:
        units = split_clauses(sql)
    except SqlParseError:
        units = []
    if not units:
        return sql.rstrip(), []
    return sql[:units[-1].end] + END_OF_SQL, units


def within_groups(records: Records) -> tuple[list[WithinGroup], list[int]]:
    """(groups of within-trajectory tuples, indices of the records that stay pairs).

    A record joins a group iff its provenance is ``within:*``, it carries ``negative_sql``, and both
    of its states are prefixes of that query as the PRM reads it whole (``scored_text``); the group
    key is (question, schema, negative query, root end). Groups and their tuples keep first-seen
    record order.
    """
    groups: dict[tuple[str, str, str, int], list[tuple[int, float, int]]] = {}  # (chosen end, margin, index)
    pairs = []
    texts: dict[str, str] = {}     # many tuples share one negative query
    for index in range(len(records)):
        rec = records[index]
        sql = rec.get("negative_sql")
        if not (is_within(rec) and isinstance(sql, str)):
            pairs.append(index)
            continue
        if sql not in texts:
            texts[sql] = scored_text(sql)[0]
        sql = texts[sql]
        root = _state_end(sql, rec["prefix_rejected"], rec["rejected"])
        chosen = _state_end(sql, rec["prefix_chosen"], rec["chosen"])
        if root is None or chosen is None:
            pairs.append(index)
            continue
        groups.setdefault((rec["question"], rec["schema"], sql, root), []).append(
            (chosen, float(rec["margin"]), index))
    out = [WithinGroup(question, schema, sql, root, tuple(c for c, _, _ in members),
                       tuple(m for _, m, _ in members), tuple(i for _, _, i in members))
           for (question, schema, sql, root), members in groups.items()]
    return out, pairs


class GroupEncoder:
    """``prompt ++ sql`` of each group, tokenised as ``score_batch`` does, with every state's last token."""

    def __init__(self, encoder: ClauseEncoder):
        self.encoder = encoder

    def encode(self, groups: Sequence[WithinGroup]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, positions) per group; positions[0] is the root state's, then one per tuple. Not truncated."""
        if not groups:
            return []
        tokens = _token_ids(self.encoder.tokenizer, [g.sql for g in groups], offsets=True)
        prompts = self.encoder.prompt_ids([(g.question, g.schema) for g in groups])
        out = []
        for group, ids, offsets, prompt in zip(groups, tokens["input_ids"], tokens["offset_mapping"], prompts):
            starts = [start for start, _ in offsets]
            ends = (group.root_end,) + group.chosen_ends
            pos = [len(prompt) + bisect.bisect_left(starts, end) - 1 for end in ends]
            out.append((np.concatenate([prompt, np.asarray(ids, np.int32)]), np.asarray(pos, np.int32)))
        return out


def pair_lengths(records: Records, encoder: ClauseEncoder, chunk: int = 1024) -> np.ndarray:
    """max(len(chosen sequence), len(rejected sequence)) per record, after truncation."""
    lengths = np.zeros(len(records), np.int32)
    names = getattr(records, "indices", None)  # a _Subset names its rows by their record index
    for start in range(0, len(records), chunk):
        indices = range(start, min(start + chunk, len(records)))
        sides = [_side(rec, side) for rec in map(records.__getitem__, indices) for side in ("chosen", "rejected")]
        encoded = encoder.encode(sides, [i if names is None else int(names[i]) for i in indices for _ in range(2)])
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
    num_groups: int = 0               # group rows per cycle of the group plan (repeats included)
    host_group_batch_size: int = 0    # this host's group rows per batch (0: no GROUP_KEYS)

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
    within_batch_size: int = 0,
    counterfactual_repeat: int = 1,
) -> PrmPipeline:
    """Builds the host's PRM batch dataset. ``num_epochs=None`` repeats forever (new order per epoch).

    ``process_index``/``process_count`` are passed in (normally ``jax.process_index()`` and
    ``jax.process_count()``): host ``p`` gets rows ``[p * B, (p + 1) * B)`` of every global batch,
    ``B = global_batch_size // process_count``, the layout ``caper_jax.parallel.multihost.host_local_to_global`` expects.
    ``within_batch_size > 0``: within-trajectory tuples are batched as groups, that many per global
    batch (``GROUP_KEYS``, module docstring); the pair rows then hold the other tuples. An epoch is
    one pass over the pair rows (over the groups if there are no others).
    ``counterfactual_repeat = n``: tuples from counterfactual repair of real predictions (provenance
    ``counterfactual`` / ``within:counterfactual``) appear n times per epoch, fault-injection ones once.
    """
    if counterfactual_repeat < 1:
        raise ValueError(f"counterfactual_repeat={counterfactual_repeat} must be >= 1")
    if global_batch_size < 1 or process_count < 1 or global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"process_count={process_count}")
    if within_batch_size < 0 or within_batch_size % process_count:
        raise ValueError(f"within_batch_size={within_batch_size} must be 0 or a positive multiple of "
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
    groups, pair_indices = within_groups(records) if within_batch_size else ([], list(range(len(records))))
    group_lengths, slots = np.zeros(0, np.int32), 0
    if groups:
        encoded = GroupEncoder(encoder).encode(groups)
        fits = [len(ids) <= ladder[-1] for ids, _ in encoded]
        # A group longer than the longest bucket would need truncation: its tuples stay pairs.
        pair_indices = sorted(pair_indices + [i for g, ok in zip(groups, fits) if not ok for i in g.records])
        kept = [(g, len(ids)) for g, (ids, _), ok in zip(groups, encoded, fits) if ok]
        kept += [(g, n) for g, n in kept if _is_counterfactual(records[g.records[0]])] * (counterfactual_repeat - 1)
        groups = [g for g, _ in kept]
        group_lengths = np.asarray([n for _, n in kept], np.int32)
        slots = max((1 + len(g.records) for g in groups), default=0)
        slots = -(-slots // GROUP_SLOT_MULTIPLE) * GROUP_SLOT_MULTIPLE
    if counterfactual_repeat > 1:
        pair_indices = list(pair_indices) + [i for i in pair_indices if _is_counterfactual(records[i])] * (
            counterfactual_repeat - 1)
    pair_indices = np.asarray(pair_indices, np.int64)
    distinct, copies = np.unique(pair_indices, return_inverse=True)   # repeated tuples are measured once
    buckets = bucket_index(pair_lengths(_Subset(records, distinct), encoder)[copies], ladder)
    group_buckets = bucket_index(group_lengths, ladder)
    within = within_batch_size if groups else 0
    steps_per_epoch = -(-len(pair_indices) // global_batch_size) or -(-len(groups) // max(within, 1))
    host_batch = global_batch_size // process_count
    host_groups = within // process_count
    loader = _HostBatchLoader(
        records, encoder, buckets, ladder, global_batch_size, seed,
        slice(process_index * host_batch, (process_index + 1) * host_batch), steps_per_epoch,
        resolve_pad_id(tokenizer, pad_id), pair_indices, groups, group_buckets, within,
        slice(process_index * host_groups, (process_index + 1) * host_groups), slots)
    dataset = grain.MapDataset.range(steps_per_epoch).repeat(num_epochs).map_with_index(loader)
    return PrmPipeline(dataset, steps_per_epoch, len(records), ladder, host_batch, len(groups), host_groups)


def is_within(record: Mapping[str, Any]) -> bool:
    """A within-trajectory tuple: both states are clauses of one wrong query (``within:*`` provenance)."""
    return str(record.get("provenance", "")).startswith(WITHIN_PROVENANCE)


def _is_counterfactual(record: Mapping[str, Any]) -> bool:
    return str(record.get("provenance", "")).removeprefix(WITHIN_PROVENANCE) == "counterfactual"


class _Subset:
    """``records[indices[i]]`` by ``i`` (the records a plan covers)."""

    def __init__(self, records: Records, indices: np.ndarray):
        self.records, self.indices = records, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[int(self.indices[i])]


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

    The query is read as ``scored_text`` gives it (its clauses, then ``END_OF_SQL``), and its last
    clause at ``END_OF_SQL``: training reads a query's last clause there too.

    Returns ``input_ids``/``mask`` [B, L] (L = shortest bucket that fits), ``clause_pos`` and
    ``clause_id`` [B, K] (-1 padded; K rounded up to ``clause_multiple`` so jit sees few shapes).
    Too long: the leftmost tokens go (prompt first); a clause whose last token falls off gets -1.
    SQL that does not parse gets no clause positions (all -1); the model still sees its tokens.
    """
    if not sql_rows:
        raise ValueError("score_batch needs at least one row")
    ladder = tuple(bucket_lengths or default_bucket_lengths(max_len))
    encoder = ClauseEncoder(tokenizer, max_len, prompt_fn)
    scored = [scored_text(row["sql"]) for row in sql_rows]
    tokens = _token_ids(tokenizer, [text for text, _ in scored], offsets=True)
    sequences, positions, names = [], [], []
    prompts = encoder.prompt_ids([(row["question"], row["schema"]) for row in sql_rows])
    for (text, units), ids, offsets, prompt in zip(scored, tokens["input_ids"], tokens["offset_mapping"], prompts):
        full = np.concatenate([prompt, np.asarray(ids, np.int32)])
        shift = max(0, len(full) - max_len)
        starts = [start for start, _ in offsets]
        # A clause is read at its last token; the last clause at END_OF_SQL, the sequence's last token.
        pos = [len(prompt) + bisect.bisect_left(starts, unit.end) - 1 - shift for unit in units[:-1]]
        pos += [len(full) - 1 - shift] if units else []
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


# ---------------------------------------------------------------------------------------------
# Candidate-level contrasts: a right and a wrong sample of one question, at the wrong one's root

CANDIDATE_PROVENANCE = "candidate"


def candidate_contrasts(records: Iterable[Mapping[str, Any]], annotator: Any, tables: Mapping[str, dict] | None = None
                        ) -> list[dict[str, Any]]:
    """Tuples (provenance ``candidate``) pairing a correct and a wrong prediction of the same question.

    Counterfactual tuples compare a wrong query with its own minimal repair; at reranking time the PRM
    must instead prefer a *different* right candidate of the same question. So for each question
    (db_id, question, gold) with at least one right and one wrong distinct prediction, every wrong
    one is paired with a right one (round-robin over the right ones, in file order) at the wrong
    one's root position (``caper_jax.sql.localize``): chosen = the right candidate's state there,
    rejected = the wrong one's, margin = the propagated reward gap there (``tuples.aligned_tuples``
    with the right candidate as the positive side). A pair whose states at the root coincide,
    whose gap is below the margin floor, or that breaks an invariant of ``caper_jax.sql.invariants``
    gives nothing. ``annotator``: a ``caper_jax.sql.tuples.Annotator``
    (its settings, executors and schemas).
    """
    from caper_jax.sql import invariants
    from caper_jax.sql.clauses import SqlParseError
    from caper_jax.sql.localize import GoldError, localize
    from caper_jax.sql.tuples import Context, aligned_tuples, tables_entry
    from caper_jax.sql.contract import serialize_schema

    s = annotator.settings
    tables = dict(tables or {})
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in records:
        if "pred" not in r or not str(r["pred"]).strip():
            continue
        preds = groups.setdefault((str(r["db_id"]), str(r.get("question", "")), str(r["gold"])), [])
        if r["pred"] not in preds:
            preds.append(str(r["pred"]))
    out: list[dict[str, Any]] = []
    for (db_id, question, gold), preds in groups.items():
        if len(preds) < 2 or not annotator.db_path(db_id).is_file():
            continue
        schema = annotator.schema(db_id)
        right, wrong = [], []
        for pred in preds:
            try:
                loc = localize(gold, pred, annotator.executor(db_id), schema, alpha=s.alpha, sigma=s.sigma,
                               reference_edges=s.reference_edges, semantics=s.semantics)
            except GoldError:
                break
            if loc.correct:
                right.append(pred)
            elif loc.root_clause is not None:
                wrong.append((pred, loc))
        if not right or not wrong:
            continue
        context = Context(question, db_id, serialize_schema(tables.get(db_id) or tables_entry(schema)), gold)
        for j, (pred, loc) in enumerate(wrong):
            try:
                pairs = aligned_tuples(context, positive_sql=right[j % len(right)], positive_rewards={},
                                       negative_sql=pred, negative_rewards=loc.clause_rewards,
                                       margin_floor=s.margin_floor, provenance=CANDIDATE_PROVENANCE)
            except SqlParseError:  # a side does not split into clauses
                continue
            # The same invariants as every annotated tuple (caper_jax.sql.invariants); a violator is left out.
            at_root = [t for t in pairs if t.clause == loc.root_clause
                       and invariants.violation(t, positive_sql=right[j % len(right)], alpha=s.alpha,
                                                within=False) is None]
            if at_root:
                out.append(at_root[0].as_dict())
    return out


def with_candidate_contrasts(world_dir: str | os.PathLike, database_dir: Any, split: str, settings: Any,
                             tuples_path: str | os.PathLike) -> pathlib.Path:
    """``tuples_path``'s tuples plus the candidate contrasts of ``predictions_<split>.jsonl``, as a new
    JSONL next to it (``<name>-contrasts.jsonl``, built once: the same inputs give the same tuples)."""
    from caper_jax.data.spider import ShownQuestions
    from caper_jax.data.tfds_caper import read_tables
    from caper_jax.sql.tuples import Annotator

    tuples_path = pathlib.Path(tuples_path)
    out = tuples_path.with_name(tuples_path.stem + "-contrasts.jsonl")
    if out.exists():
        return out
    predictions = pathlib.Path(world_dir) / f"predictions_{split}.jsonl"
    records = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()] \
        if predictions.exists() else []
    shown = ShownQuestions.of_split(world_dir, split)   # BIRD's evidence as a Hint line, as the annotator reads it
    records = [{**r, "question": shown(r)} if isinstance(r, dict) and isinstance(r.get("question"), str) else r
               for r in records]
    tables = read_tables(world_dir)
    annotator = Annotator(database_dir, settings, tables)
    try:
        extra = candidate_contrasts(records, annotator, tables)
    finally:
        annotator.close()
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(tuples_path.read_text())
        f.writelines(json.dumps(t) + "\n" for t in extra)
    os.replace(tmp, out)
    logging.getLogger("caper_jax").info("candidate contrasts: %d tuples from %s added to %s", len(extra),
                                        predictions, out)
    return out
