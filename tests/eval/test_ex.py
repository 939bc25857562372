"""`python -m caper_jax.evaluate ex`: EX on Spider dev with prediction files built here."""
import json

import pytest

from caper_jax import evaluate
from caper_jax.eval.ex import evaluate_ex
from tests.helpers import run_command

WRONG_ERROR = "SELECT * FROM no_such_table"
WRONG_ROWS = "SELECT 'no such answer', 12345"


@pytest.fixture(scope="module")
def dev(spider):
    examples = json.loads((spider / "dev.json").read_text())
    present = {p.name for p in (spider / "database").iterdir()}
    return examples, present


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def run_cli(capsys, *args):
    code = run_command(evaluate, "ex", *args)
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_gold_as_prediction_scores_one_and_missing_databases_are_excluded(spider, dev, tmp_path, capsys):
    examples, present = dev
    predictions = write_lines(tmp_path / "p.jsonl", [{"index": i, "pred": e["query"]}
                                                     for i, e in enumerate(examples)])
    out = tmp_path / "out.jsonl"
    code, summary, err = run_cli(capsys, "--data", spider, "--split", "dev", "--predictions", predictions,
                                 "--output", out)
    missing = sum(e["db_id"] not in present for e in examples)
    assert code == 0 and missing > 0
    assert summary == {"ex": 1.0, "n": len(examples) - missing, "excluded": {"missing_db": missing},
                       "malformed": 0}
    assert "wta_1" in err and "missing_db" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(examples)
    assert all(r["correct"] is (True if examples[r["index"]]["db_id"] in present else None) for r in rows)
    assert all(r["sql"] == r["pred"] for r in rows if r["correct"])


def test_known_wrong_predictions_score_zero(spider, dev, tmp_path, capsys):
    examples, present = dev
    indices = [i for i, e in enumerate(examples) if e["db_id"] in present][:200]
    records = [{"index": i, "pred": WRONG_ERROR if k % 2 else WRONG_ROWS} for k, i in enumerate(indices)]
    code, summary, _ = run_cli(capsys, "--data", spider, "--predictions",
                               write_lines(tmp_path / "p.jsonl", records))
    assert code == 0 and summary["ex"] == 0.0 and summary["n"] == 200


def test_majority_vote_ties_failures_and_summary(spider, dev, tmp_path):
    examples, present = dev
    i, j, k, m, q, r = [i for i, e in enumerate(examples) if e["db_id"] == "concert_singer"][:6]
    gold = {x: examples[x]["query"] for x in (i, j, k, m, q, r)}
    assert gold[i] == "SELECT count(*) FROM singer"
    same_as_gold = "select COUNT(*)  from singer where 1"  # other text, same result: same vote
    records = [
        {"index": i, "candidates": [WRONG_ERROR, gold[i], WRONG_ROWS, same_as_gold]},  # 2 vs 1: right
        {"index": j, "candidates": [WRONG_ROWS, gold[j], WRONG_ROWS]},  # wrong pair outvotes gold
        {"index": k, "candidates": [gold[k], WRONG_ROWS]},  # tie: first bucket wins, right
        {"index": m, "candidates": [WRONG_ROWS, gold[m]]},  # tie: first bucket wins, wrong
        {"index": q, "candidates": [WRONG_ERROR, WRONG_ERROR + " "]},  # all fail: first, wrong
        {"index": r, "pred": gold[r]},  # pred lines count in ex, not in mv
    ]
    out = tmp_path / "out.jsonl"
    summary = evaluate_ex(spider, "dev", write_lines(tmp_path / "p.jsonl", records), output=out,
                          report=lambda message: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["correct"] for r in rows] == [True, False, True, False, False, True]
    assert [row["sql"] for row in rows] == [gold[i], WRONG_ROWS, gold[k], WRONG_ROWS, WRONG_ERROR, gold[r]]
    assert rows[4]["error"] == "runtime"
    assert summary["ex"] == pytest.approx(3 / 6) and summary["n"] == 6
    assert summary["mv"] == pytest.approx({"n": 5, "first": 1 / 5, "vote": 2 / 5, "any": 4 / 5})


def test_bird_semantics_ignore_duplicates_that_spider_counts(spider, dev, tmp_path):
    examples, _ = dev
    index = next(i for i, e in enumerate(examples) if e["query"] == "SELECT count(*) FROM singer")
    doubled = "SELECT count(*) FROM singer UNION ALL SELECT count(*) FROM singer"  # same row twice
    predictions = write_lines(tmp_path / "p.jsonl", [{"index": index, "pred": doubled}])
    assert evaluate_ex(spider, "dev", predictions, semantics="spider")["ex"] == 0.0
    assert evaluate_ex(spider, "dev", predictions, semantics="bird")["ex"] == 1.0


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(spider, dev, tmp_path):
    examples, _ = dev
    good = {"index": 0, "pred": examples[0]["query"]}
    bad = ["not json", "[1, 2]", {"pred": "SELECT 1"}, {"index": len(examples), "pred": "SELECT 1"},
           {"index": True, "pred": "SELECT 1"}, {"index": 0}, {"index": 0, "pred": "x", "candidates": ["x"]},
           {"index": 0, "candidates": []}, {"index": 0, "candidates": ["SELECT 1", 3]},
           {"index": 0, "pred": 7}]
    reports = []
    other = {"index": 1, "pred": examples[1]["query"]}
    summary = evaluate_ex(spider, "dev", write_lines(tmp_path / "p.jsonl", [good, *bad, "", other]),
                          report=reports.append)
    assert summary["malformed"] == len(bad) and summary["n"] == 2 and summary["ex"] == 1.0
    assert [int(r.split(":")[1]) for r in reports] == list(range(2, 2 + len(bad)))


def test_cli_rejects_missing_files(spider, tmp_path, capsys):
    code = run_command(evaluate, "ex", "--data", str(spider), "--predictions", str(tmp_path / "absent.jsonl"))
    assert code == 2 and "absent.jsonl" in capsys.readouterr().err
    code = run_command(evaluate, "ex", "--data", spider, "--predictions", "p", "--semantics", "exact")
    assert code == 2 and "--semantics=exact: value should be one of" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["ex", "--data", "d", "--predictons", "p"], "Unknown command line flag 'predictons'. Did you mean: predictions"),
    (["ex", "--data", "d", "--predictions", "p", "--workdir=w"], "evaluate ex: not a flag of this command: --workdir"),
    (["ex", "--data", "d"], "evaluate ex: --predictions required"),
    (["ex", "extra"], "usage: python -m caper_jax.evaluate ex"),
    (["--timeout_s=soon"], "flag --timeout_s=soon"),
])
def test_a_bad_command_line_is_exit_status_2_before_any_work(args, message, capsys):
    assert run_command(evaluate, *args) == 2 and message in capsys.readouterr().err


def test_bird_layout_with_sql_key_and_dev_databases(tmp_path):
    import sqlite3
    root = tmp_path / "bird"
    (root / "dev_databases" / "tiny").mkdir(parents=True)
    connection = sqlite3.connect(root / "dev_databases" / "tiny" / "tiny.sqlite")
    connection.executescript("CREATE TABLE t (a INTEGER); INSERT INTO t VALUES (1), (1), (2);")
    connection.commit()
    connection.close()
    (root / "dev.json").write_text(json.dumps([
        {"db_id": "tiny", "question": "all a", "SQL": "SELECT a FROM t", "evidence": ""},
        {"db_id": "gone", "question": "?", "SQL": "SELECT 1", "evidence": ""}]))
    predictions = write_lines(tmp_path / "p.jsonl", [
        {"index": 0, "pred": "SELECT DISTINCT a FROM t"},  # same set, fewer rows
        {"index": 1, "pred": "SELECT 1"}])
    bird = evaluate_ex(root, "dev", predictions, semantics="bird", report=lambda message: None)
    spider = evaluate_ex(root, "dev", predictions, semantics="spider", report=lambda message: None)
    assert bird == {"ex": 1.0, "n": 1, "excluded": {"missing_db": 1}, "malformed": 0}
    assert spider["ex"] == 0.0 and spider["n"] == 1


def test_predictions_with_comments_are_graded_as_sqlite_runs_them(spider, dev, tmp_path):
    examples, _ = dev
    assert examples[0]["query"] == "SELECT count(*) FROM singer"
    commented = ["SELECT count(*) FROM singer -- n", "SELECT count(*)\nFROM singer -- n\n",
                 "SELECT count(*) -- c\nFROM singer", "SELECT count(*) FROM singer; /* c */",
                 "/* lead */ SELECT count(*) FROM singer; -- c", "SELECT count(*) FROM singer /* it's -- */"]
    predictions = write_lines(tmp_path / "p.jsonl", [{"index": 0, "candidates": commented}]
                              + [{"index": i + 1, "pred": examples[i + 1]["query"] + " -- the gold, commented"}
                                 for i in range(3)])
    out = tmp_path / "out.jsonl"
    summary = evaluate_ex(spider, "dev", predictions, output=out, report=lambda message: None)
    assert summary["ex"] == 1.0 and summary["n"] == 4 and summary["mv"]["first"] == 1.0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["correct"] and "error" not in r for r in rows)


def test_published_failures_are_the_spider_way_misses_of_each_system(tmp_path):
    """A hand-made Spider layout and two systems' files (.sql lines, DIN-SQL's CSV): a failure is a
    prediction on an existing database that errs or whose rows differ from gold's (as bags; in order
    only when gold has ORDER BY); a file without one prediction per example is refused."""
    import csv
    import sqlite3

    from caper_jax.data.spider import DataError
    from caper_jax.eval.ex import published_failures

    root, systems = tmp_path / "spider", tmp_path / "systems"
    (root / "database" / "shop").mkdir(parents=True)
    systems.mkdir()
    connection = sqlite3.connect(root / "database" / "shop" / "shop.sqlite")
    connection.executescript("CREATE TABLE t (v INTEGER); INSERT INTO t VALUES (1), (2);")
    connection.commit()
    connection.close()
    golds = ["SELECT v FROM t", "SELECT v FROM t ORDER BY v", "SELECT count(*) FROM t", "SELECT 1"]
    (root / "dev.json").write_text(json.dumps([{"db_id": "gone" if i == 3 else "shop", "question": f"q{i}",
                                                "query": sql} for i, sql in enumerate(golds)]))
    # Gold's rows in another order (right without ORDER BY), reversed under ORDER BY, an error, a missing database.
    (systems / "a.sql").write_text("SELECT v FROM t ORDER BY v DESC\nSELECT v FROM t ORDER BY v DESC\n"
                                   "SELECT count(*) FROM nowhere\tshop\nSELECT 2\n")
    with open(systems / "b.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["PREDICTED SQL"])
        writer.writerows([[sql] for sql in golds])
    (systems / "short.sql").write_text("SELECT 1\n")
    failures = published_failures(root, systems, ("a.sql", "b.csv"))
    assert failures == [
        {"system": "a.sql", "index": 1, "db_id": "shop", "question": "q1", "gold": golds[1],
         "pred": "SELECT v FROM t ORDER BY v DESC"},
        {"system": "a.sql", "index": 2, "db_id": "shop", "question": "q2", "gold": golds[2],
         "pred": "SELECT count(*) FROM nowhere"}]   # the trailing <TAB><db_id> of the gold-file layout dropped
    with pytest.raises(DataError, match="short.sql: 1 predictions for 4 examples"):
        published_failures(root, systems, ("b.csv", "short.sql"))
