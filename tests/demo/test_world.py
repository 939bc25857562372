"""The demo world against independent references: SQLite itself (schemas, results), sqlglot's parser
(SQL constructs), a token-level diff of gold and prediction (root clauses), and the annotator's
canonical localisation (root clauses of respelled predictions)."""
import collections
import functools
import itertools
import json
import pathlib
import sqlite3

import pytest
import sqlglot
from sqlglot import exp
from sqlglot.dialects.sqlite import SQLite
from sqlglot.tokens import TokenType

from caper_jax.demo.templates import TEMPLATES
from caper_jax.demo.world import build_demo_world

MISTAKE_KINDS = {"wrong_column", "wrong_join_key", "wrong_table", "wrong_operator", "wrong_connective",
                 "wrong_literal", "missing_condition", "extra_condition", "wrong_aggregate", "wrong_group_by",
                 "wrong_having_threshold", "wrong_order_direction", "wrong_limit", "missing_distinct",
                 "missing_column"}
HARMLESS_KINDS = {"column_order", "redundant_distinct", "count_key", "equated_column", "comma_join"}
SURFACE_KINDS = {"keyword_case", "neq_spelling", "table_aliases", "qualification", "commuted_conjuncts",
                 "commuted_join_condition", "join_order"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> pathlib.Path:
    return build_demo_world(tmp_path_factory.mktemp("demo"), seed=0)


def _load(world, name):
    path = world / name
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(path.read_text())


@functools.lru_cache(maxsize=None)
def _connect(world, db_id):
    return sqlite3.connect(f"file:{world / 'database' / db_id / f'{db_id}.sqlite'}?mode=ro", uri=True)


def _rows(conn, sql):
    return [tuple(r) for r in conn.execute(sql).fetchall()]


def _equal(gold, pred, ordered):
    """Spider's comparison written out: same rows as a list (ordered) or multiset, any column order."""
    if len(gold) != len(pred) or (gold and len(gold[0]) != len(pred[0])):
        return False
    if not gold:
        return True
    for perm in itertools.permutations(range(len(gold[0]))):
        p = [tuple(r[i] for i in perm) for r in pred]
        if (p == gold) if ordered else (sorted(map(repr, p)) == sorted(map(repr, gold))):
            return True
    return False


def test_layout_sizes_and_fields(world):
    train, dev = _load(world, "train.json"), _load(world, "dev.json")
    assert (len(train), len(dev)) == (1500, 300)
    for example in train + dev:
        assert {"db_id", "question", "query", "template_id", "paraphrase_id"} <= set(example)
    tables = _load(world, "tables.json")
    assert len(tables) >= 5 and all(entry["foreign_keys"] for entry in tables)
    for split, n in (("train", 1500), ("dev", 300)):
        predictions = _load(world, f"predictions_{split}.jsonl")
        assert [p["index"] for p in predictions] == list(range(n))
        examples = train if split == "train" else dev
        assert all(p["gold"] == examples[p["index"]]["query"] and p["split"] == split for p in predictions)


def test_tables_json_matches_sqlite(world):
    for entry in _load(world, "tables.json"):
        conn = _connect(world, entry["db_id"])
        names = entry["table_names_original"]
        assert sorted(names) == sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
        columns = entry["column_names_original"]
        for t, table in enumerate(names):
            info = conn.execute(f"PRAGMA table_info({table})").fetchall()
            assert [r[1] for r in info] == [c for i, c in columns if i == t]
            pk = [r[1] for r in info if r[5]]
            assert pk == [columns[k][1] for k in entry["primary_keys"] if columns[k][0] == t]
            fks = {(r[3], r[2], r[4]) for r in conn.execute(f"PRAGMA foreign_key_list({table})")}
            expected = {(columns[a][1], names[columns[b][0]], columns[b][1])
                        for a, b in entry["foreign_keys"] if columns[a][0] == t}
            assert fks == expected
            count = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            assert count >= 10
        total = sum(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in names)
        assert 300 <= total <= 1000  # "a few hundred rows" per database
        types = {"INTEGER": "number", "REAL": "number", "TEXT": "text"}
        for (t, name), spider_type in zip(columns[1:], entry["column_types"][1:]):
            declared = {r[1]: r[2] for r in conn.execute(f"PRAGMA table_info({names[t]})")}[name]
            assert types[declared] == spider_type


def _reversed_copy(world, db_id) -> sqlite3.Connection:
    """The database in memory with every table's rows stored in the reverse order, without its keys or
    indexes: SQLite scans it in another order, so a result that depends on the scan order (rows tied
    under ORDER BY, a LIMIT without one) comes out differently."""
    conn = sqlite3.connect(":memory:", uri=True)
    conn.execute("ATTACH DATABASE ? AS src", (f"file:{world / 'database' / db_id / f'{db_id}.sqlite'}?mode=ro",))
    for (table,) in conn.execute("SELECT name FROM src.sqlite_master WHERE type='table'").fetchall():
        conn.execute(f"CREATE TABLE main.{table} AS SELECT * FROM src.{table} ORDER BY rowid DESC")
    conn.commit()
    conn.execute("DETACH DATABASE src")
    return conn


def _rounded(rows):
    """Floats to 9 significant digits: a SUM or AVG adds its terms in scan order, so its last bits move."""
    return [tuple(float(f"{v:.9g}") if isinstance(v, float) else v for v in row) for row in rows]


def test_every_gold_runs_and_returns_rows(world):
    """Every gold runs on its database and returns rows, not all NULL, and the same rows (in the same order
    where it has ORDER BY) when SQLite reads the tables in the reverse order: the gold's answer is its
    data's, not the engine's scan order."""
    reversed_copies = {}
    for example in _load(world, "train.json") + _load(world, "dev.json"):
        rows = _rows(_connect(world, example["db_id"]), example["query"])
        assert rows and any(v is not None for r in rows for v in r), example
        if example["db_id"] not in reversed_copies:
            reversed_copies[example["db_id"]] = _reversed_copy(world, example["db_id"])
        rows, again = _rounded(rows), _rounded(_rows(reversed_copies[example["db_id"]], example["query"]))
        if again != rows:   # the same rows in another order: only a gold without ORDER BY may do that
            assert sqlglot.parse_one(example["query"], read="sqlite").args.get("order") is None, example
            assert sorted(map(repr, again)) == sorted(map(repr, rows)), example


def test_templates_cover_every_clause_type(world):
    assert len(TEMPLATES) >= 30
    train = _load(world, "train.json")
    seen = collections.Counter()
    for example in train:
        tree = sqlglot.parse_one(example["query"], read="sqlite")
        for node in tree.walk():
            seen[type(node).__name__] += 1
            if isinstance(node, exp.Ordered):
                seen["DESC" if node.args.get("desc") else "ASC"] += 1
            if isinstance(node, exp.Subquery) and node.find(exp.Avg):
                seen["scalar AVG subquery"] += 1
            if isinstance(node, exp.Not) and isinstance(node.this, exp.In):
                seen["NOT IN"] += 1
    needed = ["Join", "Where", "EQ", "NEQ", "GT", "LT", "And", "Or", "Like", "Between", "Group", "Having",
              "Order", "ASC", "DESC", "Limit", "In", "NOT IN", "scalar AVG subquery", "Intersect", "Except",
              "Union", "Distinct", "Count", "Avg", "Sum", "Min", "Max"]
    assert not [n for n in needed if seen[n] == 0], seen
    paraphrases = collections.defaultdict(set)
    for example in train:
        paraphrases[example["template_id"]].add(example["paraphrase_id"])
    assert set(paraphrases) == {t.id for t in TEMPLATES}
    assert all(len(p) >= 2 for p in paraphrases.values()), paraphrases


def _literal_keys(example):
    """(db, compared expression, GROUP BY, literal) for every literal compared with something."""
    def bare(node):
        node = node.copy()
        for column in node.find_all(exp.Column):
            column.set("table", None)
        return node.sql()
    tree = sqlglot.parse_one(example["query"], read="sqlite")
    keys = set()
    for literal in tree.find_all(exp.Literal):
        parent = literal.parent
        if isinstance(parent, exp.Limit) or not isinstance(parent, (exp.Binary, exp.Between, exp.Like)):
            continue
        select = literal.find_ancestor(exp.Select)
        group = select.args.get("group") if select else None
        group = bare(group) if group is not None and literal.find_ancestor(exp.Having) else ""
        keys.add((example["db_id"], bare(parent.this), group, literal.this))
    return keys


def test_split_by_template_and_value(world):
    train, dev = _load(world, "train.json"), _load(world, "dev.json")
    train_pairs = {(e["template_id"], e["db_id"]) for e in train}
    dev_pairs = {(e["template_id"], e["db_id"]) for e in dev}
    assert not train_pairs & dev_pairs
    # Every template is in both splits; in dev, on exactly one database.
    dev_dbs = collections.defaultdict(set)
    for template, db in dev_pairs:
        dev_dbs[template].add(db)
    assert set(dev_dbs) == {t for t, _ in train_pairs} and all(len(d) == 1 for d in dev_dbs.values())
    train_literals = set().union(*map(_literal_keys, train))
    dev_literals = set().union(*map(_literal_keys, dev))
    assert dev_literals and not train_literals & dev_literals
    assert not {(e["db_id"], e["question"]) for e in train} & {(e["db_id"], e["question"]) for e in dev}


def _same_rows(gold, pred, ordered):
    """Exactly the same rows (as a list when ordered), columns in the same order."""
    return pred == gold if ordered else sorted(map(repr, pred)) == sorted(map(repr, gold))


def test_predictions_verified_by_sqlite(world):
    counts, respelled = collections.Counter(), collections.Counter()
    for split in ("train", "dev"):
        for p in _load(world, f"predictions_{split}.jsonl"):
            conn = _connect(world, p["db_id"])
            gold = _rows(conn, p["gold"])
            ordered = sqlglot.parse_one(p["gold"], read="sqlite").args.get("order") is not None
            pred = _rows(conn, p["pred"])
            counts[p["kind"]] += 1
            assert set(p["surface"]) <= SURFACE_KINDS and len(set(p["surface"])) == len(p["surface"]) <= 3
            if p["kind"] == "exact":
                assert p["pred"] == p["gold"] == p["surface_gold"] and p["true_root_clause"] is None
                assert p["surface"] == []
            elif p["kind"] == "surface":
                assert p["pred"] != p["gold"] and p["true_root_clause"] is None
                assert _same_rows(gold, pred, ordered)
                assert [p["error_kind"].split(":")[1]] == p["surface"] and p["surface_gold"] == p["pred"]
            elif p["kind"] == "suspect":
                # fails by execution, yet only by a literal's case or a number's type
                assert not _equal(gold, pred, ordered) and p["true_root_clause"] is None, p
                assert p["error_kind"] == f"suspect:{p['suspect']}" and p["suspect"] == "type"
                assert p["errors"] == [] and p["harmless"] == []
            else:
                assert not _equal(gold, pred, ordered), p
                assert set(p["harmless"]) <= HARMLESS_KINDS and len(p["harmless"]) <= 1
                n_errors = 1 if p["kind"] == "error" else 2
                assert len(p["errors"]) == n_errors and p["error_kind"] == "+".join(e["kind"] for e in p["errors"])
                assert p["true_root_clause"] == p["errors"][0]["clause"]
                # The gold in the prediction's spelling: another text, the same rows.
                assert (p["surface_gold"] != p["gold"]) == bool(p["surface"] or p["harmless"]), p
                # (a harmless column order keeps the rows up to Spider's column permutation)
                assert (_equal if p["harmless"] else _same_rows)(gold, _rows(conn, p["surface_gold"]), ordered), p
                assert not {"table_aliases", "qualification"} <= set(p["surface"])
                respelled[bool(p["surface"])] += 1
    assert all(counts[k] > 0 for k in ("exact", "surface", "error", "double_error", "suspect")), counts
    # SURFACE_SHARE = 0.5 of the wrong predictions draw a respelling; a few admit none that verifies.
    assert 0.4 <= respelled[True] / (respelled[True] + respelled[False]) <= 0.55, respelled


_UNIT = {TokenType.SELECT: "SELECT", TokenType.FROM: "FROM", TokenType.WHERE: "WHERE",
         TokenType.GROUP_BY: "GROUP BY", TokenType.HAVING: "HAVING", TokenType.ORDER_BY: "ORDER BY",
         TokenType.LIMIT: "LIMIT", TokenType.UNION: "UNION", TokenType.INTERSECT: "INTERSECT",
         TokenType.EXCEPT: "EXCEPT"}


def _clause_at(tokens, position):
    """The clause a token position lies in, from depth-0 keywords (compound operators own the rest)."""
    clause, depth = None, 0
    for token in tokens[:position + 1]:
        depth += (token.token_type == TokenType.L_PAREN) - (token.token_type == TokenType.R_PAREN)
        name = _UNIT.get(token.token_type)
        if depth == 0 and name and clause not in ("UNION", "INTERSECT", "EXCEPT"):
            clause = name
    return clause


def test_root_clause_matches_first_textual_difference(world):
    """Against the gold in the prediction's own spelling, the first difference is the root clause."""
    dialect = SQLite()
    checked = 0
    for p in _load(world, "predictions_train.jsonl") + _load(world, "predictions_dev.jsonl"):
        if p["kind"] not in ("error", "double_error"):
            continue
        gold, pred = dialect.tokenize(p["surface_gold"]), dialect.tokenize(p["pred"])
        i = next(i for i, (a, b) in enumerate(itertools.zip_longest(gold, pred))
                 if a is None or b is None or (a.token_type, a.text) != (b.token_type, b.text))
        # A deletion shows in the gold's tokens, an insertion in the prediction's.
        candidates = {_clause_at(gold, i) if i < len(gold) else None, _clause_at(pred, i) if i < len(pred) else None}
        assert p["true_root_clause"] in candidates, p
        checked += 1
    assert checked > 1000


def test_catalogue_is_covered(world):
    predictions = _load(world, "predictions_train.jsonl")
    kinds = collections.Counter(e["kind"] for p in predictions for e in p["errors"])
    assert set(kinds) <= MISTAKE_KINDS
    assert set(kinds) == MISTAKE_KINDS, kinds
    surface = {p["error_kind"].split(":")[1] for p in predictions if p["kind"] == "surface"}
    assert surface == SURFACE_KINDS
    respelled = {name for p in predictions if p["kind"] in ("error", "double_error") for name in p["surface"]}
    assert respelled == SURFACE_KINDS


def test_respelled_predictions_still_localise_to_their_root(world):
    """The annotator's canonical localisation sees through the respelling: it blames the true root
    clause, where the first textual difference from the gold often lies elsewhere."""
    from caper_jax.sql.execution import Executor
    from caper_jax.sql.localize import localize
    from caper_jax.sql.schema import Schema

    respelled = [p for p in _load(world, "predictions_dev.jsonl") if p["surface"] and p["true_root_clause"]]
    assert len(respelled) >= 80
    textual_misses = 0
    for db_id in sorted({p["db_id"] for p in respelled}):
        path = world / "database" / db_id / f"{db_id}.sqlite"
        schema = Schema.from_sqlite(path)
        with Executor(path) as executor:
            for p in (p for p in respelled if p["db_id"] == db_id):
                assert localize(p["gold"], p["pred"], executor, schema).root_clause == p["true_root_clause"], p
                gold, pred = SQLite().tokenize(p["gold"]), SQLite().tokenize(p["pred"])
                first = next(i for i, (a, b) in enumerate(itertools.zip_longest(gold, pred)) if a is None
                             or b is None or (a.token_type, a.text.lower()) != (b.token_type, b.text.lower()))
                textual_misses += _clause_at(pred, min(first, len(pred) - 1)) != p["true_root_clause"]
    # Without the respelling the first (case-insensitive) difference would be the root clause.
    assert textual_misses >= len(respelled) // 3, textual_misses


def test_harmless_differences_precede_the_root_and_the_annotator_sees_past_them(world):
    """A harmless difference sits in a clause before the root: the first canonical difference is
    not the root any more, the execution-verified walk still finds it; suspect failures are
    flagged with their reason."""
    from caper_jax.sql.execution import Executor
    from caper_jax.sql.localize import localize
    from caper_jax.sql.schema import Schema

    records = _load(world, "predictions_train.jsonl") + _load(world, "predictions_dev.jsonl")
    harmless = [p for p in records if p["harmless"]]
    suspects = [p for p in records if p["kind"] == "suspect"]
    kinds = collections.Counter(k for p in harmless for k in p["harmless"])
    assert len(harmless) >= 100 and len(kinds) >= 4, kinds
    assert len(suspects) >= 10 and {p["suspect"] for p in suspects} == {"type"}
    found, canonical_found = 0, 0
    for db_id in sorted({p["db_id"] for p in harmless + suspects}):
        path = world / "database" / db_id / f"{db_id}.sqlite"
        schema = Schema.from_sqlite(path)
        with Executor(path) as executor:
            for p in (p for p in harmless if p["db_id"] == db_id):
                found += localize(p["gold"], p["pred"], executor, schema).root_clause == p["true_root_clause"]
                canonical = localize(p["gold"], p["pred"], executor, schema, rules=(), verify=False)
                canonical_found += canonical.root_clause == p["true_root_clause"]
            for p in (p for p in suspects if p["db_id"] == db_id):
                assert localize(p["gold"], p["pred"], executor, schema).suspect == p["suspect"], p
    assert found >= 0.95 * len(harmless), (found, len(harmless))
    assert canonical_found <= 0.5 * len(harmless), (canonical_found, len(harmless))


def test_build_is_deterministic_and_seeded(tmp_path):
    a = build_demo_world(tmp_path / "a", seed=3, train_size=120, dev_size=40)
    b = build_demo_world(tmp_path / "b", seed=3, train_size=120, dev_size=40)
    c = build_demo_world(tmp_path / "c", seed=4, train_size=120, dev_size=40)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "train.json").read_bytes() != (c / "train.json").read_bytes()
    assert (a / "database/shop/shop.sqlite").read_bytes() != (c / "database/shop/shop.sqlite").read_bytes()


def test_finished_build_is_reused_and_settings_rebuild(tmp_path):
    out = build_demo_world(tmp_path, seed=0, train_size=60, dev_size=20)
    stamp = (out / "train.json").stat().st_mtime_ns
    build_demo_world(tmp_path, seed=0, train_size=60, dev_size=20)
    assert (out / "train.json").stat().st_mtime_ns == stamp
    build_demo_world(tmp_path, seed=0, train_size=61, dev_size=20)
    assert len(_load(out, "train.json")) == 61


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="positive"):
        build_demo_world(tmp_path, train_size=0)
    with pytest.raises(ValueError, match="prediction mix"):
        build_demo_world(tmp_path, train_size=20, dev_size=10, prediction_mix={"wrong": 1.0})
    with pytest.raises(ValueError, match="surface_share"):
        build_demo_world(tmp_path, train_size=20, dev_size=10, surface_share=1.5)


def test_surface_share_zero_gives_plain_wrong_predictions(tmp_path):
    plain = build_demo_world(tmp_path / "plain", seed=0, train_size=60, dev_size=20, surface_share=0.0)
    every = build_demo_world(tmp_path / "every", seed=0, train_size=60, dev_size=20, surface_share=1.0)
    plain_p, every_p = _load(plain, "predictions_train.jsonl"), _load(every, "predictions_train.jsonl")
    wrong = [i for i, p in enumerate(plain_p) if p["kind"] in ("error", "double_error")]
    assert wrong and all(plain_p[i]["surface"] == [] and (plain_p[i]["surface_gold"] == plain_p[i]["gold"]
                                                          or plain_p[i]["harmless"])
                         for i in wrong)
    # The share decides the respelling only: the same mistakes in the same places.
    assert [(every_p[i]["error_kind"], every_p[i]["true_root_clause"]) for i in wrong] == \
        [(plain_p[i]["error_kind"], plain_p[i]["true_root_clause"]) for i in wrong]
    assert sum(bool(every_p[i]["surface"]) for i in wrong) >= 0.8 * len(wrong)
