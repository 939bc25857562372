"""Length buckets and the global batch plan that every host computes alike (the PRM's and SFT's inputs).

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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

