"""Reading JSON-lines inputs strictly, one line at a time, so that a bad line is only that line.

Used by every command that reads JSON lines (annotate, evaluate ex, verify). Each line is decoded
as UTF-8 on its own (invalid bytes are never replaced by U+FFFD and passed on as if they were the
input: the line is reported with its number and skipped) and parsed as JSON; a string holding a
lone surrogate (``"\\ud800"`` is valid JSON but not Unicode: it cannot be encoded, executed or
written back) is refused the same way. Lines are split on ``\\n`` only; blank lines are skipped.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


class LineError(ValueError):
    """One input line cannot be used; the message says why (without the file or line number)."""


class UndecodableLine(str):
    """A line that is not UTF-8: its text (invalid bytes as U+FFFD, for display only) and ``error``.

    ``parse_json_line`` refuses it, so it can travel through code that iterates text lines
    without ever being taken for the input.
    """

    error: str


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = UndecodableLine(raw.decode("utf-8", errors="replace"))
        line.error = f"not UTF-8 (byte {error.start + 1} of the line is {raw[error.start:error.start + 1]!r})"
        return line


@contextlib.contextmanager
def open_text_lines(path: str | os.PathLike) -> Iterator[Iterator[str]]:
    """``with open_text_lines(p) as lines``: like a text file's lines, decoded one line at a time.

    A directory is refused with a ValueError (one line at the command lines), not IsADirectoryError."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not a JSON-lines file")
    with open(path, "rb") as f:
        yield (_decode(raw) for raw in f)


def read_text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str | LineError]]:
    """(1-based line number, decoded text or the LineError of that line), blank lines skipped."""
    with open_text_lines(path) as lines:
        for number, text in enumerate(lines, start=1):
            if isinstance(text, UndecodableLine):
                yield number, LineError(text.error)
            elif text.strip():
                yield number, text


def lone_surrogate(value: Any) -> str | None:
    """A description of the first string in ``value`` that is not valid Unicode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return f"\\u{ord(value[error.start]):04x} at character {error.start + 1} of a string"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key) or lone_surrogate(item)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = lone_surrogate(item)
            if found:
                return found
    return None


def parse_json_line(text: str) -> Any:
    """The JSON value of one line; LineError if it is not UTF-8, not JSON or holds a lone surrogate."""
    if isinstance(text, UndecodableLine):
        raise LineError(text.error)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise LineError(f"not JSON ({error.msg})") from None
    except RecursionError:
        raise LineError("not JSON (nested too deeply)") from None
    bad = lone_surrogate(value)
    if bad:
        raise LineError(f"holds a lone surrogate ({bad}), which is not valid Unicode")
    return value


def read_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value or LineError) for every non-blank line."""
    for number, text in read_text_lines(path):
        if isinstance(text, LineError):
            yield number, text
            continue
        try:
            yield number, parse_json_line(text)
        except LineError as error:
            yield number, error


__all__ = ["LineError", "UndecodableLine", "lone_surrogate", "open_text_lines", "parse_json_line",
           "read_json_lines", "read_text_lines"]
