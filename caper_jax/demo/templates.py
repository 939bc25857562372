"""Question templates of the demo world: one SQL shape, its slots, and several English paraphrases.

A template is a function of a ``Slots`` object (the database's schema plus a sampler of literal
values for one split) that returns the gold SQL and the paraphrases of the question; it returns
``None`` when the database cannot host it. Templates address columns by role (schemas.py),
so each one instantiates on all five databases.

Literal values come from pools computed on the database itself (distinct values, round thresholds
inside the 15–85 % quantile range, per-group aggregates), so every predicate selects some rows but
not all of them. Each pool is cut once, by a seeded shuffle, into a dev part (``DEV_VALUE_FRACTION``)
and a train part: a dev question never shows a literal that a train question uses in the same
database column.
"""
from __future__ import annotations

import dataclasses
import random
import sqlite3
from typing import Callable, Sequence

from caper_jax.demo.schemas import DemoSchema, Table, Value

DEV_VALUE_FRACTION = 0.25
SPLITS = ("train", "dev")


def sql_literal(value: Value) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def text_literal(value: Value) -> str:
    """A literal as a question writes it."""
    return sql_literal(value).strip("'") if isinstance(value, str) else sql_literal(value)


class ValuePools:
    """Seeded train/dev partition of every literal pool of one database, computed by SQL on demand."""

    def __init__(self, conn: sqlite3.Connection, db_id: str, seed: int):
        self._conn = conn
        self._db_id = db_id
        self._seed = seed
        self._cache: dict[str, dict[str, list[Value]]] = {}

    def values(self, key: str, query: str, *, step: float = 1, trim: float = 0.0,
               drop_extremes: bool = False) -> dict[str, list[Value]]:
        if key not in self._cache:
            raw = [r[0] for r in self._conn.execute(query).fetchall() if r[0] is not None]
            self._cache[key] = self._split(key, _pool(raw, step=step, trim=trim, drop_extremes=drop_extremes))
        return self._cache[key]

    def _split(self, key: str, pool: list[Value]) -> dict[str, list[Value]]:
        if len(pool) < 2:
            return {"train": [], "dev": []}
        order = sorted(pool, key=lambda v: (str(type(v)), v))
        random.Random(f"{self._seed}:{self._db_id}:{key}").shuffle(order)
        n_dev = max(1, round(DEV_VALUE_FRACTION * len(order)))
        return {"dev": order[:n_dev], "train": order[n_dev:]}


def _pool(raw: list[Value], *, step: float, trim: float, drop_extremes: bool) -> list[Value]:
    if not raw:
        return []
    if isinstance(raw[0], str):
        return sorted(set(raw))
    ordered = sorted(raw)
    lo = ordered[int(trim * (len(ordered) - 1))]
    hi = ordered[int((1 - trim) * (len(ordered) - 1))]
    rounded = sorted({_round(v, step) for v in ordered if lo <= v <= hi})
    if drop_extremes:
        rounded = rounded[1:-1]
    return rounded


def _round(value: float, step: float) -> Value:
    r = round(value / step) * step
    return int(r) if float(r).is_integer() else round(r, 2)


class NoValue(Exception):
    """A template cannot be instantiated on this database and split (its value pool is empty)."""


@dataclasses.dataclass
class Slots:
    """What a template sees: the schema, a seeded RNG, and value pools restricted to one split."""

    schema: DemoSchema
    pools: ValuePools
    split: str
    rng: random.Random

    def choice(self, options: Sequence):
        return options[self.rng.randrange(len(options))]

    def _pick(self, pool: dict[str, list[Value]], k: int = 1) -> list[Value]:
        values = pool[self.split]
        if len(values) < k:
            raise NoValue()
        return self.rng.sample(values, k)

    def equal(self, table: Table, role: str, k: int = 1) -> list[Value]:
        """Existing values of a column (for = and IN)."""
        c = table.c(role)
        return self._pick(self.pools.values(f"eq:{table.name}.{c}", f"SELECT DISTINCT {c} FROM {table.name}"), k)

    def threshold(self, table: Table, role: str, k: int = 1) -> list[Value]:
        """Round thresholds inside the 15–85 % range of a numeric column (for <, >, BETWEEN)."""
        column = table.column(role)
        pool = self.pools.values(f"thr:{table.name}.{column.name}", f"SELECT {column.name} FROM {table.name}",
                                 step=column.step, trim=0.15)
        return sorted(self._pick(pool, k))

    def aggregate(self, key: str, query: str, step: float = 1) -> Value:
        """A threshold among per-group aggregates, without the extremes (some groups pass, some not)."""
        return self._pick(self.pools.values(key, query, step=step, drop_extremes=True))[0]

    def initial(self, table: Table, role: str) -> str:
        c = table.c(role)
        query = f"SELECT substr({c}, 1, 1) FROM {table.name} GROUP BY 1 HAVING COUNT(*) >= 2"
        return str(self._pick(self.pools.values(f"initial:{table.name}.{c}", query))[0])


Builder = Callable[[Slots], tuple[str, list[str]]]


@dataclasses.dataclass(frozen=True)
class Template:
    id: str
    features: tuple[str, ...]  # the SQL constructs it exercises (documentation and coverage tests)
    build: Builder


TEMPLATES: list[Template] = []


def template(template_id: str, *features: str) -> Callable[[Builder], Builder]:
    def register(build: Builder) -> Builder:
        TEMPLATES.append(Template(template_id, tuple(features), build))
        return build
    return register


def _more_less(op: str) -> tuple[str, ...]:
    return ("above", "more than", "greater than") if op == ">" else ("below", "less than", "under")


def _join(child: Table, child_role: str, parent: Table) -> str:
    return f"JOIN {parent.name} ON {child.q(child_role)} = {parent.q('id')}"


# ----------------------------------------------------------------------------- SELECT / WHERE

@template("distinct_values", "SELECT DISTINCT")
def _distinct_values(x: Slots):
    s = x.schema
    table, role = x.choice([(s.item, "kind"), (s.person, "place"), (s.parent, "group")])
    noun = table.noun(role)
    sql = f"SELECT DISTINCT {table.c(role)} FROM {table.name}"
    return sql, [f"What are the distinct {noun} values of the {table.plural}?",
                 f"List every different {noun} that appears among the {table.plural}.",
                 f"Show each {noun} of the {table.plural}, without repeats."]


@template("filter_threshold", "WHERE >/<")
def _filter_threshold(x: Slots):
    e = x.schema.item
    role = x.choice(["num", "count"])
    op = x.choice([">", "<"])
    (v,) = x.threshold(e, role)
    noun, w = e.noun(role), x.choice(_more_less(op))
    sql = f"SELECT {e.c('name')} FROM {e.name} WHERE {e.c(role)} {op} {sql_literal(v)}"
    return sql, [f"Which {e.plural} have a {noun} {w} {text_literal(v)}?",
                 f"List the {e.noun('name')} of every {e.singular} whose {noun} is {w} {text_literal(v)}.",
                 f"Find all {e.plural} with {noun} {w} {text_literal(v)}."]


@template("filter_category", "SELECT 2 columns", "WHERE =")
def _filter_category(x: Slots):
    e = x.schema.item
    (v,) = x.equal(e, "kind")
    kind, name, num = e.noun("kind"), e.noun("name"), e.noun("num")
    sql = f"SELECT {e.c('name')}, {e.c('num')} FROM {e.name} WHERE {e.c('kind')} = {sql_literal(v)}"
    return sql, [f"Show the {name} and {num} of every {e.singular} whose {kind} is {v}.",
                 f"For {e.plural} with {kind} {v}, give their {name} and {num}.",
                 f"What are the {name} and the {num} of the {v} {e.plural}?"]


@template("filter_and", "WHERE AND", "WHERE = / <>")
def _filter_and(x: Slots):
    e = x.schema.item
    (v,) = x.equal(e, "kind")
    negate = x.choice([False, False, True])
    op = x.choice([">", "<"])
    (t,) = x.threshold(e, "num")
    kind, num, w = e.noun("kind"), e.noun("num"), x.choice(_more_less(op))
    sql = (f"SELECT {e.c('name')} FROM {e.name} WHERE {e.c('kind')} {'<>' if negate else '='} {sql_literal(v)} "
           f"AND {e.c('num')} {op} {sql_literal(t)}")
    if negate:
        return sql, [f"Which {e.plural} have a {kind} other than {v} and a {num} {w} {t}?",
                     f"List the {e.noun('name')} of {e.plural} not in {kind} {v} whose {num} is {w} {t}.",
                     f"Find {e.plural} whose {kind} is not {v} and whose {num} is {w} {t}."]
    return sql, [f"Which {e.plural} have {kind} {v} and a {num} {w} {t}?",
                 f"List the {e.noun('name')} of {v} {e.plural} whose {num} is {w} {t}.",
                 f"Find {e.plural} in the {v} {kind} with {num} {w} {t}."]


@template("filter_or", "WHERE OR")
def _filter_or(x: Slots):
    c = x.schema.person
    a, b = x.equal(c, "place", k=2)
    place = c.noun("place")
    sql = (f"SELECT {c.c('name')} FROM {c.name} "
           f"WHERE {c.c('place')} = {sql_literal(a)} OR {c.c('place')} = {sql_literal(b)}")
    return sql, [f"Which {c.plural} have {place} {a} or {b}?",
                 f"List the names of {c.plural} whose {place} is either {a} or {b}.",
                 f"Find every {c.singular} with {place} {a} or {place} {b}."]


@template("filter_like", "WHERE LIKE")
def _filter_like(x: Slots):
    c = x.schema.person
    letter = x.initial(c, "name")
    sql = f"SELECT {c.c('name')} FROM {c.name} WHERE {c.c('name')} LIKE {sql_literal(letter + '%')}"
    return sql, [f"Which {c.plural} have a name starting with {letter}?",
                 f"List the {c.plural} whose name begins with the letter {letter}.",
                 f"Find all {c.plural} with names that start with '{letter}'."]


@template("filter_between", "WHERE BETWEEN")
def _filter_between(x: Slots):
    s = x.schema
    table, role = x.choice([(s.item, "count"), (s.item, "num"), (s.person, "age")])
    a, b = x.threshold(table, role, k=2)
    noun, name = table.noun(role), table.noun("name")
    sql = (f"SELECT {table.c('name')}, {table.c(role)} FROM {table.name} "
           f"WHERE {table.c(role)} BETWEEN {sql_literal(a)} AND {sql_literal(b)}")
    return sql, [f"Show the {name} and {noun} of {table.plural} with a {noun} between {a} and {b}.",
                 f"Which {table.plural} have a {noun} from {a} to {b}? Give {name} and {noun}.",
                 f"List {name} and {noun} of every {table.singular} whose {noun} lies between {a} and {b}."]


@template("filter_not_equal", "WHERE <>")
def _filter_not_equal(x: Slots):
    p = x.schema.parent
    (v,) = x.equal(p, "group")
    group = p.noun("group")
    sql = f"SELECT {p.c('name')} FROM {p.name} WHERE {p.c('group')} <> {sql_literal(v)}"
    return sql, [f"Which {p.plural} have a {group} other than {v}?",
                 f"List the names of {p.plural} whose {group} is not {v}.",
                 f"Find all {p.plural} that are not in {group} {v}."]


@template("lookup_by_name", "WHERE = name")
def _lookup_by_name(x: Slots):
    e = x.schema.item
    role = x.choice(["num", "count", "kind"])
    (v,) = x.equal(e, "name")
    noun = e.noun(role)
    sql = f"SELECT {e.c(role)} FROM {e.name} WHERE {e.c('name')} = {sql_literal(v)}"
    return sql, [f"What is the {noun} of the {e.singular} {v}?",
                 f"Give the {noun} of the {e.singular} whose {e.noun('name')} is {v}.",
                 f"Tell me the {noun} of {v}."]


# ----------------------------------------------------------------------------- aggregates

@template("count_threshold", "COUNT(*)", "WHERE >/<")
def _count_threshold(x: Slots):
    s = x.schema
    table, role = x.choice([(s.person, "age"), (s.item, "num"), (s.item, "count")])
    op = x.choice([">", "<"])
    (v,) = x.threshold(table, role)
    noun, w = table.noun(role), x.choice(_more_less(op))
    sql = f"SELECT COUNT(*) FROM {table.name} WHERE {table.c(role)} {op} {sql_literal(v)}"
    return sql, [f"How many {table.plural} have a {noun} {w} {v}?",
                 f"Count the {table.plural} whose {noun} is {w} {v}.",
                 f"What is the number of {table.plural} with {noun} {w} {v}?"]


@template("aggregate_in_category", "AVG/MAX/MIN/SUM", "WHERE =")
def _aggregate_in_category(x: Slots):
    e = x.schema.item
    agg = x.choice(["AVG", "MAX", "MIN", "SUM"])
    (v,) = x.equal(e, "kind")
    word = {"AVG": "average", "MAX": "highest", "MIN": "lowest", "SUM": "total"}[agg]
    kind, num = e.noun("kind"), e.noun("num")
    sql = f"SELECT {agg}({e.c('num')}) FROM {e.name} WHERE {e.c('kind')} = {sql_literal(v)}"
    return sql, [f"What is the {word} {num} of {e.plural} whose {kind} is {v}?",
                 f"Compute the {word} {num} over the {v} {e.plural}.",
                 f"Among {e.plural} with {kind} {v}, what is the {word} {num}?"]


@template("min_max", "MAX", "MIN")
def _min_max(x: Slots):
    s = x.schema
    table, role = x.choice([(s.item, "num"), (s.item, "count"), (s.person, "age"), (s.event, "amount")])
    noun = table.noun(role)
    sql = f"SELECT MAX({table.c(role)}), MIN({table.c(role)}) FROM {table.name}"
    return sql, [f"What are the highest and lowest {noun} of the {table.plural}?",
                 f"Give the maximum and the minimum {noun} among all {table.plural}.",
                 f"Find the largest and the smallest {noun} of any {table.singular}."]


@template("aggregate_in_year", "SUM/AVG", "WHERE =")
def _aggregate_in_year(x: Slots):
    v = x.schema.event
    agg = x.choice(["SUM", "AVG"])
    (y,) = x.equal(v, "year")
    noun = v.noun("amount")
    word = "total" if agg == "SUM" else "average"
    sql = f"SELECT {agg}({v.c('amount')}) FROM {v.name} WHERE {v.c('year')} = {y}"
    return sql, [f"What is the {word} {noun} of all {v.plural} in {y}?",
                 f"Compute the {word} {noun} over the {v.plural} made in {y}.",
                 f"In {y}, what was the {word} {noun} across {v.plural}?"]


@template("count_distinct", "COUNT(DISTINCT)", "WHERE =")
def _count_distinct(x: Slots):
    s = x.schema
    v, c = s.event, s.person
    (y,) = x.equal(v, "year")
    sql = f"SELECT COUNT(DISTINCT {v.c('person')}) FROM {v.name} WHERE {v.c('year')} = {y}"
    return sql, [f"How many different {c.plural} {s.event_verb} {s.item.plural} in {y}?",
                 f"Count the distinct {c.plural} with at least one {v.singular} in {y}.",
                 f"In {y}, how many unique {c.plural} had {v.plural}?"]


# ----------------------------------------------------------------------------- GROUP BY / HAVING

def _group_choice(x: Slots) -> tuple[Table, str]:
    s = x.schema
    return x.choice([(s.item, "kind"), (s.person, "place"), (s.parent, "group"), (s.event, "year")])


@template("count_per_group", "GROUP BY", "COUNT(*)")
def _count_per_group(x: Slots):
    table, role = _group_choice(x)
    noun = table.noun(role)
    sql = f"SELECT {table.c(role)}, COUNT(*) FROM {table.name} GROUP BY {table.c(role)}"
    return sql, [f"How many {table.plural} are there for each {noun}?",
                 f"Count the {table.plural} per {noun}.",
                 f"For every {noun}, show the number of {table.plural}."]


@template("avg_per_group", "GROUP BY", "AVG")
def _avg_per_group(x: Slots):
    s = x.schema
    table, group, role = x.choice([(s.item, "kind", "num"), (s.item, "kind", "count"), (s.person, "place", "age")])
    g, noun = table.noun(group), table.noun(role)
    sql = f"SELECT {table.c(group)}, AVG({table.c(role)}) FROM {table.name} GROUP BY {table.c(group)}"
    return sql, [f"What is the average {noun} of {table.plural} for each {g}?",
                 f"For every {g}, give the mean {noun} of its {table.plural}.",
                 f"Show each {g} with the average {noun} of the {table.plural}."]


@template("having_count", "GROUP BY", "HAVING COUNT")
def _having_count(x: Slots):
    table, role = _group_choice(x)
    c = table.c(role)
    k = x.aggregate(f"groupcount:{table.name}.{c}", f"SELECT COUNT(*) FROM {table.name} GROUP BY {c}")
    noun = table.noun(role)
    sql = f"SELECT {c} FROM {table.name} GROUP BY {c} HAVING COUNT(*) > {k}"
    return sql, [f"Which {noun} values have more than {k} {table.plural}?",
                 f"List each {noun} shared by more than {k} {table.plural}.",
                 f"Find the {noun} with over {k} {table.plural}."]


@template("having_avg", "GROUP BY", "HAVING AVG")
def _having_avg(x: Slots):
    s = x.schema
    table, group, role = x.choice([(s.person, "place", "age"), (s.item, "kind", "num"), (s.item, "kind", "count")])
    g, c = table.c(group), table.c(role)
    op = x.choice([">", "<"])
    t = x.aggregate(f"groupavg:{table.name}.{g}.{c}", f"SELECT AVG({c}) FROM {table.name} GROUP BY {g}",
                    step=table.column(role).step)
    w = x.choice(_more_less(op))
    group_noun, noun = table.noun(group), table.noun(role)
    sql = f"SELECT {g} FROM {table.name} GROUP BY {g} HAVING AVG({c}) {op} {sql_literal(t)}"
    return sql, [f"Which {group_noun} values have an average {noun} {w} {t} among their {table.plural}?",
                 f"List the {group_noun} whose {table.plural} have a mean {noun} {w} {t}.",
                 f"Find each {group_noun} where the average {noun} of {table.plural} is {w} {t}."]


@template("group_with_filter", "WHERE", "GROUP BY", "MAX")
def _group_with_filter(x: Slots):
    e = x.schema.item
    (t,) = x.threshold(e, "count")
    kind, num, count = e.noun("kind"), e.noun("num"), e.noun("count")
    sql = (f"SELECT {e.c('kind')}, MAX({e.c('num')}) FROM {e.name} "
           f"WHERE {e.c('count')} > {sql_literal(t)} GROUP BY {e.c('kind')}")
    return sql, [f"For {e.plural} with a {count} above {t}, what is the highest {num} in each {kind}?",
                 f"Considering only {e.plural} whose {count} exceeds {t}, give the maximum {num} per {kind}.",
                 f"Show each {kind} and its top {num} among {e.plural} with {count} over {t}."]


# ----------------------------------------------------------------------------- ORDER BY / LIMIT

@template("top_k", "ORDER BY DESC/ASC", "LIMIT")
def _top_k(x: Slots):
    s = x.schema
    table, role = x.choice([(s.item, "num"), (s.item, "count"), (s.parent, "size")])
    k = x.choice([1, 2, 3, 5])
    desc = x.choice([True, False])
    noun, name = table.noun(role), table.noun("name")
    sql = (f"SELECT {table.c('name')} FROM {table.name} ORDER BY {table.c(role)} "
           f"{'DESC' if desc else 'ASC'} LIMIT {k}")
    most = "highest" if desc else "lowest"
    if k == 1:
        return sql, [f"Which {table.singular} has the {most} {noun}?",
                     f"Give the {name} of the {table.singular} with the {most} {noun}.",
                     f"Find the {table.singular} whose {noun} is the {most}."]
    return sql, [f"Which {k} {table.plural} have the {most} {noun}?",
                 f"List the {name} of the {k} {table.plural} with the {most} {noun}.",
                 f"Name the {k} {table.plural} with the {'largest' if desc else 'smallest'} {noun}."]


@template("order_filtered", "WHERE =", "ORDER BY DESC/ASC")
def _order_filtered(x: Slots):
    c = x.schema.person
    (v,) = x.equal(c, "place")
    desc = x.choice([True, False])
    place = c.noun("place")
    sql = (f"SELECT {c.c('name')}, {c.c('age')} FROM {c.name} WHERE {c.c('place')} = {sql_literal(v)} "
           f"ORDER BY {c.c('age')} {'DESC' if desc else 'ASC'}")
    order = "from oldest to youngest" if desc else "from youngest to oldest"
    way = "descending" if desc else "ascending"
    return sql, [f"List the names and ages of {c.plural} with {place} {v}, {order}.",
                 f"Show name and age of every {c.singular} whose {place} is {v}, sorted by age in {way} order.",
                 f"For {c.plural} with {place} {v}, give their names and ages ordered {order}."]


@template("argmax_group", "GROUP BY", "ORDER BY COUNT(*)", "LIMIT")
def _argmax_group(x: Slots):
    table, role = _group_choice(x)
    desc = x.choice([True, False])
    c, noun = table.c(role), table.noun(role)
    sql = f"SELECT {c} FROM {table.name} GROUP BY {c} ORDER BY COUNT(*) {'DESC' if desc else 'ASC'} LIMIT 1"
    most, common = ("most", "most common") if desc else ("fewest", "least common")
    return sql, [f"Which {noun} has the {most} {table.plural}?",
                 f"Find the {noun} with the {'largest' if desc else 'smallest'} number of {table.plural}.",
                 f"What is the {common} {noun} among {table.plural}?"]


# ----------------------------------------------------------------------------- JOIN

@template("join_columns", "JOIN")
def _join_columns(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    role = x.choice(["name", "group"])
    sql = f"SELECT {e.q('name')}, {p.q(role)} FROM {e.name} {_join(e, 'parent', p)}"
    what = f"{p.singular}'s {p.noun(role)}" if role != "name" else f"{p.singular} name"
    return sql, [f"Show each {e.singular}'s {e.noun('name')} together with its {what}.",
                 f"List every {e.singular} with the {what}.",
                 f"For all {e.plural}, give the {e.noun('name')} and the {what}."]


@template("join_filter_parent", "JOIN", "WHERE =")
def _join_filter_parent(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    (v,) = x.equal(p, "group")
    group = p.noun("group")
    sql = f"SELECT {e.q('name')} FROM {e.name} {_join(e, 'parent', p)} WHERE {p.q('group')} = {sql_literal(v)}"
    return sql, [f"Which {e.plural} belong to a {p.singular} whose {group} is {v}?",
                 f"List the {e.noun('name')} of {e.plural} from {p.plural} with {group} {v}.",
                 f"Find all {e.plural} whose {p.singular} has {group} {v}."]


@template("join_filter_child", "JOIN", "WHERE >/<")
def _join_filter_child(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    op = x.choice([">", "<"])
    (t,) = x.threshold(e, "num")
    num, w = e.noun("num"), x.choice(_more_less(op))
    sql = (f"SELECT {e.q('name')}, {p.q('name')} FROM {e.name} {_join(e, 'parent', p)} "
           f"WHERE {e.q('num')} {op} {sql_literal(t)}")
    return sql, [f"For {e.plural} with a {num} {w} {t}, show their {e.noun('name')} and {p.singular} name.",
                 f"List {e.plural} whose {num} is {w} {t} together with the name of their {p.singular}.",
                 f"Which {e.plural} have a {num} {w} {t}, and which {p.singular} does each belong to?"]


@template("join_count_per_parent", "JOIN", "GROUP BY", "COUNT(*)")
def _join_count_per_parent(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    sql = f"SELECT {p.q('name')}, COUNT(*) FROM {e.name} {_join(e, 'parent', p)} GROUP BY {p.q('name')}"
    return sql, [f"How many {e.plural} does each {p.singular} have?",
                 f"For every {p.singular}, give its name and the number of its {e.plural}.",
                 f"Count the {e.plural} of each {p.singular}, by {p.singular} name."]


@template("join_having_avg", "JOIN", "GROUP BY", "HAVING AVG")
def _join_having_avg(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    num = e.c("num")
    query = f"SELECT AVG({e.q('num')}) FROM {e.name} {_join(e, 'parent', p)} GROUP BY {p.q('name')}"
    t = x.aggregate(f"joinavg:{e.name}.{num}", query, step=e.column("num").step)
    sql = (f"SELECT {p.q('name')} FROM {e.name} {_join(e, 'parent', p)} "
           f"GROUP BY {p.q('name')} HAVING AVG({e.q('num')}) > {sql_literal(t)}")
    return sql, [f"Which {p.plural} have {e.plural} with an average {e.noun('num')} above {t}?",
                 f"List the {p.plural} whose {e.plural} average more than {t} in {e.noun('num')}.",
                 f"Find {p.singular} names where the mean {e.noun('num')} of their {e.plural} exceeds {t}."]


@template("join_top_people", "JOIN", "GROUP BY", "ORDER BY SUM", "LIMIT")
def _join_top_people(x: Slots):
    s = x.schema
    v, c = s.event, s.person
    k = x.choice([1, 3, 5])
    amount = v.noun("amount")
    sql = (f"SELECT {c.q('name')}, SUM({v.q('amount')}) FROM {v.name} {_join(v, 'person', c)} "
           f"GROUP BY {c.q('name')} ORDER BY SUM({v.q('amount')}) DESC LIMIT {k}")
    who = f"the {c.singular}" if k == 1 else f"the {k} {c.plural}"
    return sql, [f"Who are {who} with the largest total {amount} over their {v.plural}, and what is that total?",
                 f"List {who} with the highest summed {amount} of {v.plural}, with the sum.",
                 f"Find {who} whose {v.plural} add up to the most {amount}; show name and total."]


@template("join_three_tables", "JOIN x2", "WHERE =", "SELECT DISTINCT")
def _join_three_tables(x: Slots):
    s = x.schema
    v, c, e = s.event, s.person, s.item
    (k,) = x.equal(e, "kind")
    sql = (f"SELECT DISTINCT {c.q('name')} FROM {v.name} {_join(v, 'person', c)} {_join(v, 'item', e)} "
           f"WHERE {e.q('kind')} = {sql_literal(k)}")
    kind = e.noun("kind")
    return sql, [f"Which {c.plural} {s.event_verb} {e.plural} whose {kind} is {k}?",
                 f"List the distinct names of {c.plural} who {s.event_verb} a {e.singular} with {kind} {k}.",
                 f"Find every {c.singular} that {s.event_verb} at least one {k} {e.singular}."]


@template("join_count_filter", "JOIN", "WHERE AND", "COUNT(*)")
def _join_count_filter(x: Slots):
    s = x.schema
    v, e = s.event, s.item
    (t,) = x.threshold(e, "num")
    (y,) = x.equal(v, "year")
    num = e.noun("num")
    sql = (f"SELECT COUNT(*) FROM {v.name} {_join(v, 'item', e)} "
           f"WHERE {e.q('num')} > {sql_literal(t)} AND {v.q('year')} = {y}")
    return sql, [f"How many {v.plural} in {y} involved {e.plural} with a {num} above {t}?",
                 f"Count the {v.plural} of {y} whose {e.singular} has a {num} over {t}.",
                 f"In {y}, how many {v.plural} were for {e.plural} with {num} greater than {t}?"]


# ----------------------------------------------------------------------------- nested subqueries

@template("in_subquery", "WHERE IN (subquery)")
def _in_subquery(x: Slots):
    s = x.schema
    v, c = s.event, s.person
    (y,) = x.equal(v, "year")
    sql = (f"SELECT {c.c('name')} FROM {c.name} WHERE {c.c('id')} IN "
           f"(SELECT {v.c('person')} FROM {v.name} WHERE {v.c('year')} = {y})")
    return sql, [f"Which {c.plural} {s.event_verb} something in {y}?",
                 f"List the names of {c.plural} with at least one {v.singular} in {y}.",
                 f"Find the {c.plural} who appear in the {v.plural} of {y}."]


@template("not_in_subquery", "WHERE NOT IN (subquery)")
def _not_in_subquery(x: Slots):
    s = x.schema
    v = s.event
    table, role = x.choice([(s.item, "item"), (s.person, "person")])
    (y,) = x.equal(v, "year")
    sql = (f"SELECT {table.c('name')} FROM {table.name} WHERE {table.c('id')} NOT IN "
           f"(SELECT {v.c(role)} FROM {v.name} WHERE {v.c('year')} = {y})")
    return sql, [f"Which {table.plural} have no {v.plural} in {y}?",
                 f"List the {table.noun('name')} of {table.plural} that do not appear in any {v.singular} of {y}.",
                 f"Find the {table.plural} without a single {v.singular} in {y}."]


@template("scalar_avg_compare", "WHERE > (SELECT AVG)")
def _scalar_avg_compare(x: Slots):
    s = x.schema
    table, role = x.choice([(s.item, "num"), (s.item, "count"), (s.person, "age")])
    op = x.choice([">", "<"])
    c, noun = table.c(role), table.noun(role)
    sql = f"SELECT {table.c('name')} FROM {table.name} WHERE {c} {op} (SELECT AVG({c}) FROM {table.name})"
    w = "above" if op == ">" else "below"
    return sql, [f"Which {table.plural} have a {noun} {w} the average?",
                 f"List the {table.noun('name')} of {table.plural} whose {noun} is {w} the average {noun}.",
                 f"Find all {table.plural} with {noun} {w} the mean {noun} of all {table.plural}."]


@template("count_above_avg_in_kind", "COUNT(*)", "WHERE AND", "WHERE > (SELECT AVG)")
def _count_above_avg_in_kind(x: Slots):
    e = x.schema.item
    (k,) = x.equal(e, "kind")
    c, num, kind = e.c("num"), e.noun("num"), e.noun("kind")
    sql = (f"SELECT COUNT(*) FROM {e.name} WHERE {e.c('kind')} = {sql_literal(k)} "
           f"AND {c} > (SELECT AVG({c}) FROM {e.name})")
    return sql, [f"How many {e.plural} with {kind} {k} have a {num} above the overall average?",
                 f"Count the {k} {e.plural} whose {num} exceeds the average {num} of all {e.plural}.",
                 f"Among {e.plural} whose {kind} is {k}, how many are above the mean {num}?"]


@template("parent_in_subquery", "WHERE IN (subquery)", "subquery WHERE")
def _parent_in_subquery(x: Slots):
    s = x.schema
    e, p = s.item, s.parent
    (t,) = x.threshold(e, "num")
    num = e.noun("num")
    sql = (f"SELECT {p.c('name')} FROM {p.name} WHERE {p.c('id')} IN "
           f"(SELECT {e.c('parent')} FROM {e.name} WHERE {e.c('num')} > {sql_literal(t)})")
    return sql, [f"Which {p.plural} have at least one {e.singular} with a {num} above {t}?",
                 f"List the names of {p.plural} offering some {e.singular} whose {num} exceeds {t}.",
                 f"Find {p.plural} that have {e.plural} with {num} over {t}."]


# ----------------------------------------------------------------------------- compound queries

@template("intersect", "INTERSECT")
def _intersect(x: Slots):
    e = x.schema.item
    (a,) = x.threshold(e, "num")
    (b,) = x.threshold(e, "count")
    kind, num, count = e.c("kind"), e.noun("num"), e.noun("count")
    sql = (f"SELECT {kind} FROM {e.name} WHERE {e.c('num')} > {sql_literal(a)} INTERSECT "
           f"SELECT {kind} FROM {e.name} WHERE {e.c('count')} < {sql_literal(b)}")
    noun = e.noun("kind")
    return sql, [f"Which {noun} values have both a {e.singular} with {num} above {a} and one with {count} below {b}?",
                 f"List each {noun} that has {e.plural} with a {num} over {a} "
                 f"and also {e.plural} with a {count} under {b}.",
                 f"Find the {noun} shared by {e.plural} with {num} above {a} and {e.plural} with {count} below {b}."]


@template("except", "EXCEPT", "JOIN")
def _except(x: Slots):
    s = x.schema
    c, v = s.person, s.event
    (place,) = x.equal(c, "place")
    noun = c.noun("place")
    sql = (f"SELECT {c.c('name')} FROM {c.name} WHERE {c.c('place')} = {sql_literal(place)} EXCEPT "
           f"SELECT {c.q('name')} FROM {c.name} JOIN {v.name} ON {c.q('id')} = {v.q('person')}")
    return sql, [f"Which {c.plural} with {noun} {place} have no {v.plural} at all?",
                 f"List the {c.plural} whose {noun} is {place} but who never {s.event_verb} anything.",
                 f"Find {c.plural} from {noun} {place} without a single {v.singular}."]


@template("union", "UNION")
def _union(x: Slots):
    e = x.schema.item
    (a,) = x.threshold(e, "num")
    (b,) = x.threshold(e, "count")
    name, num, count = e.c("name"), e.noun("num"), e.noun("count")
    sql = (f"SELECT {name} FROM {e.name} WHERE {e.c('num')} > {sql_literal(a)} UNION "
           f"SELECT {name} FROM {e.name} WHERE {e.c('count')} < {sql_literal(b)}")
    return sql, [f"Which {e.plural} have a {num} above {a} or a {count} below {b}?",
                 f"List {e.plural} that either have {num} over {a} or {count} under {b}.",
                 f"Find every {e.singular} whose {num} exceeds {a} or whose {count} is less than {b}."]
