"""Where each clause of a completion ends, in tokens: the host-side bridge from SQL text to GRPO's clause ends.

``split_clauses`` (``caper_jax.sql.clauses``) cuts the text into top-level clauses with character spans;
``spans_to_token_ends`` maps each span to the token holding its last character through the tokenizer's
offsets (those of the tokens the policy sampled: ``sampling.decode_with_offsets``); ``pad_clause_ends``
stacks a batch's rows into the ``int32 [B, K]`` array, padded with -1, that ``caper_jax.rl.rewards``'
layouts read. Pure NumPy on small arrays.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from caper_jax.sql.clauses import SqlParseError, split_clauses


def clause_token_ends(text: str, offsets: np.ndarray) -> tuple[np.ndarray, bool]:
    """(token index of each top-level clause's last token, whether the text parsed into clauses)."""
    if not text.strip():
        return np.zeros(0, np.int32), False
    try:
        units = split_clauses(text)
    except SqlParseError:
        return np.zeros(0, np.int32), False
    if not units:
        return np.zeros(0, np.int32), False
    try:
        return spans_to_token_ends(units, offsets), True
    except ValueError:  # spans the offsets cannot place (e.g. no non-empty token): treat as unparsed
        return np.zeros(0, np.int32), False


def _span_bounds(span) -> tuple[int, int]:
    if hasattr(span, "start") and hasattr(span, "end"):
        return int(span.start), int(span.end)
    start, end = span
    return int(start), int(end)


def spans_to_token_ends(spans: Iterable, offsets: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """Token index of the last token of each character span.

    Args:
      spans: ``(start, end)`` pairs (end exclusive) or objects with ``.start``/``.end`` such as
        ``caper_jax.sql.clauses.ClauseUnit``, as character offsets into the tokenised text.
      offsets: ``[T, 2]`` character ``(start, end)`` of each token (a Hugging Face tokenizer's
        ``return_offsets_mapping=True``); empty tokens ``(s, s)`` such as special tokens are skipped.

    Returns:
      ``int32 [len(spans)]``: for each span, the token holding its last character ``end - 1``. A span
      that ends inside a token maps to that token (the PRM must see the whole clause, so the score is
      read once the token completing it has been generated); a character that falls between tokens
      (e.g. whitespace a tokenizer leaves out of its offsets) maps to the last token before it.
      Ends are non-decreasing when the spans are in text order.

    Raises:
      ValueError: an empty span, or a span ending before the first token or past the last one.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    nonempty = np.flatnonzero(offsets[:, 1] > offsets[:, 0])
    if nonempty.size == 0:
        raise ValueError("offsets hold no non-empty token")
    token_starts = offsets[nonempty, 0]
    text_end = int(offsets[nonempty, 1].max())
    ends = []
    for span in spans:
        start, end = _span_bounds(span)
        if end <= start:
            raise ValueError(f"empty or reversed span ({start}, {end})")
        last_char = end - 1
        if last_char >= text_end:
            raise ValueError(f"span ({start}, {end}) ends past the tokenised text (ends at {text_end})")
        slot = int(np.searchsorted(token_starts, last_char, side="right")) - 1
        if slot < 0:
            raise ValueError(f"span ({start}, {end}) ends before the first token")
        ends.append(int(nonempty[slot]))
    return np.asarray(ends, dtype=np.int32)


def pad_clause_ends(rows: Sequence[Sequence[int]], max_clauses: int) -> np.ndarray:
    """Stacks per-row clause ends into ``int32 [B, max_clauses]`` padded with -1.

    Raises ValueError when a row has more than ``max_clauses`` ends (truncating would silently move
    the execution reward to the wrong clause).
    """
    out = np.full((len(rows), max_clauses), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        if len(row) > max_clauses:
            raise ValueError(f"row {i} has {len(row)} clause ends > max_clauses {max_clauses}")
        out[i, : len(row)] = row
    return out
