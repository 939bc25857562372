"""What the Clause-PRM reads: the token ids of one state (prompt ++ SQL up to a clause) or of a whole query.

* **Sequence** = ``prompt_ids(question, schema) ++ sql_ids(prefix + clause)``, tokenised as two
  pieces without special tokens, so the prompt is tokenised once per question and the training
  sequence is exactly the first tokens of the evaluation sequence that ``score_batch``
  (``caper_jax.data.prm_scoring_batches``) builds for the whole query (``scored_text``). Too long:
  tokens are dropped from the LEFT (prompt first, then the SQL prefix); the clause itself is never
  cut (``ClauseTooLongError``). A query's last clause arrives from the annotator as
  ``clause + END_OF_SQL`` (the end of the query is part of its state), so its score is read after
  the end-of-SQL token, where ``score_batch`` reads it in a whole query.
* **Prompts are cached** per (question, schema): many tuples share a question.
* ``pair_lengths`` measures every record once (the longer of its two sides), for the bucket plan;
  ``resolve_pad_id`` is the padding id of every PRM and policy batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from caper_jax.data.prm_records import PipelineError, Records
from caper_jax.sql.clauses import SqlParseError, split_clauses
from caper_jax.sql.contract import END_OF_SQL, prm_prompt

PromptFn = Callable[[str, str], str]


class ClauseTooLongError(PipelineError):
    """The clause alone has more tokens than max_len, so no truncation can keep it whole."""


class Tokenizer(Protocol):
    """What the pipeline needs of a tokenizer: HF-style batch __call__ (fast tokenizers add offsets)."""

    def __call__(self, text: list[str], **kwargs: Any) -> Mapping[str, Any]: ...


def join_sql(prefix: str, clause: str) -> str:
    """prefix + clause, with one space between them if neither side brings whitespace.

    Prefixes are ``sql[:unit.start]`` (trailing gap included); the space only guards producers that
    strip it. Trailing whitespace of the clause is dropped so the last token is a clause token.
    """
    clause = clause.rstrip()
    if prefix and not prefix[-1].isspace() and clause and not clause[0].isspace():
        return prefix + " " + clause
    return prefix + clause


def token_ids(tokenizer: Tokenizer, texts: list[str], offsets: bool = False) -> Any:
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
            fresh = [np.asarray(ids, np.int32) for ids in token_ids(self.tokenizer, texts)["input_ids"]]
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
        sql_ids = token_ids(self.tokenizer, texts)["input_ids"]
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
            offsets = token_ids(self.tokenizer, [text], offsets=True)["offset_mapping"][0]
            n_clause = sum(1 for _, end in offsets if end > clause_start)
        except TypeError:  # slow tokenizer: count the clause on its own
            n_clause = len(token_ids(self.tokenizer, [text[clause_start:]])["input_ids"][0])
        if n_clause > self.max_len:
            raise ClauseTooLongError(f"record {index}: clause has {n_clause} tokens > max_len={self.max_len}")


def scored_text(sql: str) -> tuple[str, list]:
    """(the text the PRM reads for a whole query, its clause units).

    The clauses as written (a trailing ``;`` or comment dropped) followed by ``END_OF_SQL``: the end
    of the query is part of the last clause's state, as in the tuples (``caper_jax.sql.tuples``).
    SQL that does not split into clauses comes back stripped, with no units.
    """

    try:
        units = split_clauses(sql)
    except SqlParseError:
        units = []
    if not units:
        return sql.rstrip(), []
    return sql[:units[-1].end] + END_OF_SQL, units


def pair_lengths(records: Records, encoder: ClauseEncoder, chunk: int = 1024) -> np.ndarray:
    """max(len(chosen sequence), len(rejected sequence)) per record, after truncation."""
    lengths = np.zeros(len(records), np.int32)
    names = getattr(records, "indices", None)  # a _Subset names its rows by their record index
    for start in range(0, len(records), chunk):
        indices = range(start, min(start + chunk, len(records)))
        sides = [record_side(rec, side) for rec in map(records.__getitem__, indices) for side in ("chosen", "rejected")]
        encoded = encoder.encode(sides, [i if names is None else int(names[i]) for i in indices for _ in range(2)])
        lengths[start: start + len(indices)] = [max(len(a), len(b)) for a, b in zip(encoded[::2], encoded[1::2])]
    return lengths


def record_side(record: Mapping[str, Any], side: str) -> tuple[str, str, str, str]:
    return record["question"], record["schema"], record[f"prefix_{side}"], record[side]


def resolve_pad_id(tokenizer: Tokenizer, pad_id: int | None) -> int:
    if pad_id is not None:
        return pad_id
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0

