"""Clause-PRM training input: preference tuples -> length-bucketed, host-sliced batches (Grain).

docs/pipeline.md has the full story. The pieces: the records (``caper_jax.data.prm_records``), the
token ids of each state (``caper_jax.data.clause_encoder``), the global plan every host computes
alike (``caper_jax.data.bucket_plan``) and the within-trajectory groups
(``caper_jax.data.within_groups``); this module loads each step's host slice.

* **Everything is a Grain MapDataset.** ``range(steps_per_epoch).repeat(num_epochs)
  .map_with_index(load)``: random access by step index, so the iterator state is one integer and
  ``get_state``/``set_state`` resume exactly, in any epoch, with Grain's threaded prefetch.
* **Lengths are measured once**, at construction: every record is tokenised (prompts are cached
  per (question, schema)) to find its bucket. Bad records fail here, with their index, before any
  accelerator time is spent.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from caper_jax.data.bucket_plan import bucket_index, default_bucket_lengths, epoch_plan
from caper_jax.data.clause_encoder import (ClauseEncoder, PromptFn, Tokenizer, pair_lengths, record_side,
                                           resolve_pad_id)
from caper_jax.data.prm_records import PipelineError, Records, clause_id, is_counterfactual, is_within
from caper_jax.data.within_groups import GroupEncoder, WithinGroup, within_groups

BATCH_KEYS = (
    "chosen_ids", "chosen_mask", "chosen_pos", "rejected_ids", "rejected_mask", "rejected_pos",
    "margin", "clause_id", "weight", "lm_weight", "record_index",
)
GROUP_KEYS = ("group_ids", "group_mask", "group_pos", "group_margin", "group_weight")
GROUP_SLOT_MULTIPLE = 8   # group_pos/group_margin widths are rounded up to this (few shapes for jit)


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
        sides = [record_side(rec, side) for rec in records for side in ("chosen", "rejected")]
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
    batch (``GROUP_KEYS``, ``caper_jax.data.within_groups``); the pair rows then hold the other tuples. An epoch is
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
        kept += [(g, n) for g, n in kept if is_counterfactual(records[g.records[0]])] * (counterfactual_repeat - 1)
        groups = [g for g, _ in kept]
        group_lengths = np.asarray([n for _, n in kept], np.int32)
        slots = max((1 + len(g.records) for g in groups), default=0)
        slots = -(-slots // GROUP_SLOT_MULTIPLE) * GROUP_SLOT_MULTIPLE
    if counterfactual_repeat > 1:
        pair_indices = list(pair_indices) + [i for i in pair_indices if is_counterfactual(records[i])] * (
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


class _Subset:
    """``records[indices[i]]`` by ``i`` (the records a plan covers)."""

    def __init__(self, records: Records, indices: np.ndarray):
        self.records, self.indices = records, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[int(self.indices[i])]

