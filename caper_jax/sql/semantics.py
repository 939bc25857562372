"""EX semantics of the evaluators: which SQL is executed, and how two results are compared.

    spider            test-suite-sql-eval's ``result_eq`` on the queries as written (bag of rows, or
                      an ordered list when the gold has ORDER BY; any column permutation). This is
                      the official evaluator with ``--keep_distinct``, and the semantically right
                      verdict: it agrees with that mode on 5,832 of 5,832 published predictions
                      (docs/evaluation.md).
    spider_official   the official evaluator's DEFAULT mode (taoyds/test-suite-sql-eval,
                      ``--etype exec`` without ``--keep_distinct``), the one papers report: every
                      ``DISTINCT`` token is removed from the gold and from the prediction before
                      either is executed, then the results are compared as ``spider`` does. Use it
                      to report numbers comparable with published ones; it calls some wrong
                      predictions right (``COUNT(DISTINCT x)`` vs ``COUNT(x)``) and the converse.
    bird              BIRD's evaluator: ``set(gold rows) == set(pred rows)``.

Only the evaluation entry points (``evaluate ex``, ``verify``, policy evaluation) accept
``spider_official``; rewards and annotation compare results of the queries as written.
"""
from __future__ import annotations

import re
from typing import Literal

from sqlglot.dialects.sqlite import SQLite
from sqlglot.errors import SqlglotError
from sqlglot.tokens import TokenType

EvalSemantics = Literal["spider", "spider_official", "bird"]
SEMANTICS: tuple[str, ...] = ("spider", "spider_official", "bird")

_DISTINCT_WORD = re.compile(r"\bdistinct\b", re.IGNORECASE)
# Quoted text (strings, quoted identifiers) is never touched by the fallback below.
_QUOTED = re.compile(r"('[^']*(?:''[^']*)*'|\"[^\"]*(?:\"\"[^\"]*)*\"|`[^`]*(?:``[^`]*)*`|\[[^\]]*\])")


def check_semantics(semantics: str, *, what: str = "semantics") -> str:
    """``semantics`` if it is one of SEMANTICS; otherwise a ValueError naming them."""
    if semantics not in SEMANTICS:
        raise ValueError(f"{what}={semantics!r}; expected one of {', '.join(SEMANTICS)}")
    return semantics


def comparison(semantics: str) -> Literal["spider", "bird"]:
    """The ``results_equal`` semantics of an EX semantics (``spider_official`` compares as ``spider``)."""
    check_semantics(semantics)
    return "bird" if semantics == "bird" else "spider"


def remove_distinct(sql: str) -> str:
    """``sql`` with every DISTINCT keyword token cut out, the rest left byte for byte.

    The official evaluator drops each sqlparse token whose text is ``distinct`` (any case) and joins
    the others: ``SELECT DISTINCT a`` -> ``SELECT  a``, ``COUNT(DISTINCT a)`` -> ``COUNT( a)``;
    strings, quoted identifiers, comments and names such as ``distinct_id`` are single tokens and
    stay. Here sqlglot's SQLite tokenizer finds the DISTINCT keyword tokens and their spans are
    deleted from the text. SQL the tokenizer refuses (an unterminated quote, say, which fails to
    execute anyway) falls back to deleting the word ``distinct`` outside quoted text.
    """
    if "distinct" not in sql.lower():
        return sql
    try:
        tokens = SQLite().tokenize(sql)
    except (SqlglotError, ValueError):
        parts = _QUOTED.split(sql)
        parts[::2] = [_DISTINCT_WORD.sub("", part) for part in parts[::2]]
        return "".join(parts)
    spans = [(t.start, t.end + 1) for t in tokens
             if t.token_type == TokenType.DISTINCT and sql[t.start:t.end + 1].lower() == "distinct"]
    if not spans:
        return sql
    pieces, position = [], 0
    for start, end in spans:
        pieces.append(sql[position:start])
        position = end
    pieces.append(sql[position:])
    return "".join(pieces)


def executed_sql(sql: str, semantics: str) -> str:
    """The SQL an evaluator runs for ``sql`` under ``semantics`` (DISTINCT removed for spider_official)."""
    return remove_distinct(sql) if check_semantics(semantics) == "spider_official" else sql


__all__ = ["EvalSemantics", "SEMANTICS", "check_semantics", "comparison", "executed_sql", "remove_distinct"]
