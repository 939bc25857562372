"""SFT input pipeline: (question, schema) -> gold SQL + END_OF_SQL, as length-bucketed Grain batches.

Design:

* **Sequence** = ``policy_prompt(question, schema)`` ++ ``gold SQL`` ++ ``END_OF_SQL``, tokenised as two
  pieces without special tokens (the prompt text carries its own chat markers), exactly the layout the
  sampler continues at GRPO time: the policy learns to write the SQL right after the prompt and close
  it with the stop token. Too long: prompt tokens are dropped from the LEFT; the SQL is never cut
  (``SqlTooLongError``), since a truncated target teaches a wrong query.
* **Targets and loss mask**: ``targets[t] = input_ids[t + 1]`` (pad at the end) and ``loss_mask[t] = 1``
  where that target is a SQL or stop token, so ``loss = mean over masked t of -log p(targets[t] |
  ids[:t+1])``; prompt tokens are context only. Explicit targets keep the loss a plain function of
  (logits, targets, mask), the way big_vision and MaxText feed decoders.
* **Global plan, host slices**: the batch plan is ``caper_jax.data.bucket_plan.epoch_plan`` (shuffle,
  stable sort by length bucket, cut, shuffle the chunks) — a pure function of (seed, epoch, lengths) that
  every host computes identically, so all hosts agree on each step's sequence length; each host then
  gathers only its own rows. The demo and Spider training sets are small, so every example is tokenised
  once up front (bad examples fail here, with their index, before any compile).
* **Grain**: ``MapDataset.range(steps_per_epoch).repeat(num_epochs).map_with_index(load)``, random
  access by step, so the iterator state is one integer and checkpoints resume the data exactly.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import grain
import numpy as np

from caper_jax.data.bucket_plan import bucket_index, default_bucket_lengths, epoch_plan
from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.data.spider import db_path, load_schemas, load_split
from caper_jax.policy.prompts import stop_token_id
from caper_jax.sql.contract import policy_prompt, serialize_schema

BATCH_KEYS = ("input_ids", "attention_mask", "targets", "loss_mask")


class SftDataError(ValueError):
    """An SFT example cannot be used (empty SQL, unknown database, SQL longer than max_len)."""


class SqlTooLongError(SftDataError):
    """The SQL plus its stop token alone exceed max_len, so no prompt truncation can fit it."""


@dataclasses.dataclass(frozen=True)
class SftExample:
    question: str
    schema: str     # serialised schema (caper_jax.sql.contract.serialize_schema)
    sql: str        # gold SQL, the target
    db_id: str = ""
    evidence: str = ""  # BIRD's hint; part of the prompt


def examples_from_split(data_dir, split: str, *, schema_values: int = 0,
                        values_for: Callable[[str], bool] | None = None) -> list[SftExample]:
    """Spider/BIRD/demo-layout examples of one split with their serialised schemas.

    Questions, schemas and databases come from the one layout reader, ``caper_jax.data.spider``
    (Spider's train = train_spider.json + train_others.json; BIRD's ``<split>_tables.json`` and
    ``<split>_databases/`` first for their split).

    ``schema_values`` > 0 lists that many frequent values per text column, read from each database;
    ``values_for(db_id)`` False leaves them out for that database (evaluation: its file is missing).
    """

    schemas = load_schemas(data_dir, split)
    serialised: dict[str, str] = {}
    out = []
    for ex in load_split(data_dir, split):
        if ex.db_id not in schemas:
            raise SftDataError(f"{split}[{ex.index}]: database {ex.db_id!r} is not in the schema file of {data_dir}")
        if ex.db_id not in serialised:
            values = schema_values if values_for is None or values_for(ex.db_id) else 0
            path = db_path(data_dir, ex.db_id, split) if values else None
            serialised[ex.db_id] = serialize_schema(schemas[ex.db_id], values, path)
        out.append(SftExample(ex.question, serialised[ex.db_id], ex.query, ex.db_id, ex.evidence))
    return out


def encode_examples(examples: Sequence[SftExample], tokenizer, max_len: int
                    ) -> tuple[list[np.ndarray], np.ndarray]:
    """(token ids per example, number of prompt tokens kept per example), left-truncated to max_len."""
    if not examples:
        raise SftDataError("no SFT examples")
    stop = stop_token_id(tokenizer)
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    sql_ids = tokenizer([ex.sql.strip() for ex in examples], add_special_tokens=False)["input_ids"]
    sequences, prompt_lengths = [], np.zeros(len(examples), np.int32)
    for i, (ex, prompt, sql) in enumerate(zip(examples, prompt_ids, sql_ids)):
        if not ex.sql.strip():
            raise SftDataError(f"example {i}: empty gold SQL")
        target = list(sql) + [stop]
        if len(target) >= max_len:  # at least one prompt token must precede the first target
            raise SqlTooLongError(f"example {i}: SQL + stop token is {len(target)} tokens >= max_len {max_len}")
        prompt = list(prompt)[-(max_len - len(target)):]
        sequences.append(np.asarray(prompt + target, np.int32))
        prompt_lengths[i] = len(prompt)
    return sequences, prompt_lengths


def make_batch(sequences: Sequence[np.ndarray], prompt_lengths: Sequence[int], length: int, size: int,
               pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded ``[size, length]`` batch; rows past ``len(sequences)`` are padding (loss_mask 0).

    ``targets[b, t] = input_ids[b, t + 1]``; ``loss_mask[b, t] = 1`` where that is a SQL or stop token.
    """
    batch = {"input_ids": np.full((size, length), pad_id, np.int32),
             "attention_mask": np.zeros((size, length), np.int32),
             "targets": np.full((size, length), pad_id, np.int32),
             "loss_mask": np.zeros((size, length), np.int32)}
    batch["attention_mask"][:, 0] = 1  # padding rows keep one visible token: no fully masked attention row
    for row, (ids, n_prompt) in enumerate(zip(sequences, prompt_lengths)):
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
        batch["targets"][row, : len(ids) - 1] = ids[1:]
        batch["loss_mask"][row, n_prompt - 1: len(ids) - 1] = 1
    return batch


class _StepLoader:
    """step index -> this host's rows of that global batch (thread-safe: Grain prefetches in threads)."""

    def __init__(self, sequences, prompt_lengths, buckets, ladder, global_batch_size, seed, rows,
                 steps_per_epoch, pad_id):
        self.sequences, self.prompt_lengths, self.buckets, self.ladder = sequences, prompt_lengths, buckets, ladder
        self.global_batch_size, self.seed, self.rows = global_batch_size, seed, rows
        self.steps_per_epoch, self.pad_id = steps_per_epoch, pad_id
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if epoch not in self._plans:
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[epoch] = epoch_plan(self.buckets, self.global_batch_size, self.seed, epoch)
            return self._plans[epoch]

    def __call__(self, index: int, step: int) -> dict[str, np.ndarray]:
        plan, batch_bucket = self._plan(index // self.steps_per_epoch)
        mine = [int(r) for r in plan[step, self.rows] if r >= 0]
        size = self.rows.stop - self.rows.start
        return make_batch([self.sequences[r] for r in mine], [self.prompt_lengths[r] for r in mine],
                          self.ladder[batch_bucket[step]], size, self.pad_id)


@dataclasses.dataclass(frozen=True)
class SftPipeline:
    dataset: grain.MapDataset
    steps_per_epoch: int
    num_examples: int
    bucket_lengths: tuple[int, ...]

    def iterator(self, num_threads: int = 2, prefetch: int = 4) -> grain.DatasetIterator:
        options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        return iter(self.dataset.to_iter_dataset(options))


def sft_pipeline(examples: Sequence[SftExample], tokenizer, *, global_batch_size: int, max_len: int,
                 bucket_lengths: Sequence[int] | None = None, seed: int = 0, num_epochs: int | None = None,
                 process_index: int = 0, process_count: int = 1) -> SftPipeline:
    """This host's stream of SFT batches (``num_epochs=None``: repeat forever, new order per epoch)."""
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"process_count={process_count}")
    ladder = tuple(int(n) for n in (bucket_lengths or default_bucket_lengths(max_len)))
    if ladder[-1] > max_len:
        raise ValueError(f"longest bucket {ladder[-1]} > max_len {max_len}")
    sequences, prompt_lengths = encode_examples(examples, tokenizer, max_len)
    buckets = bucket_index(np.asarray([len(s) for s in sequences]), ladder)
    steps_per_epoch = -(-len(sequences) // global_batch_size)
    host = global_batch_size // process_count
    loader = _StepLoader(sequences, prompt_lengths, buckets, ladder, global_batch_size, seed,
                         slice(process_index * host, (process_index + 1) * host), steps_per_epoch,
                         resolve_pad_id(tokenizer, None))
    dataset = grain.MapDataset.range(steps_per_epoch).repeat(num_epochs).map_with_index(loader)
    return SftPipeline(dataset, steps_per_epoch, len(sequences), ladder)

