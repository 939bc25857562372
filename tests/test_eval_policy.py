"""Policy evaluation: EX of greedy / first sample / MV@k / PRM best-of-k / oracle.

References: hand-computed EX on Spider dev with hand-written predictions, and ``evaluate ex`` (an
independent implementation of EX and majority vote) on the predictions an end-to-end run writes.
"""
import json
import pathlib

import numpy as np
import pytest

from caper_jax import evaluate
from caper_jax.eval import policy as policy_lib
from caper_jax.eval.ex import evaluate_ex
from caper_jax.prm import scoring
from caper_jax.sft.data import SftExample
from caper_jax.sql.execution import Executors
from caper_jax.utils.errors import CheckpointError
from tests.helpers import REPO, build_policy_run, build_prm_run, run_command, session_root

WRONG_ROWS = "SELECT 'no such answer', 12345"
WRONG_ERROR = "SELECT * FROM no_such_table"
GARBAGE = "SELEC name FRM ((("


def stub_prm(good: set[str]):
    """Clauses of a 'good' query score 1, of any other parseable query -1."""
    def score(rows):
        return [np.full(len(scoring.clause_names(r["sql"])), 1.0 if r["sql"] in good else -1.0) for r in rows]
    return score


def test_score_examples_by_hand(spider):
    examples = [e for e in json.loads((spider / "dev.json").read_text()) if e["db_id"] == "concert_singer"][:3]
    exs = [SftExample(e["question"], "schema", e["query"], e["db_id"]) for e in examples]
    gold = [e.sql for e in exs]
    same_result = "select COUNT(*)  from singer where 1"
    assert gold[0] == "SELECT count(*) FROM singer"
    greedy = [gold[0], WRONG_ERROR, gold[2]]
    samples = [[WRONG_ROWS, gold[0], WRONG_ROWS],   # first x, vote x (2 wrong agree), PRM ok, oracle ok
               [gold[1], WRONG_ROWS, WRONG_ERROR],  # first ok, vote ok (tie: earliest), PRM ok
               [GARBAGE, GARBAGE, WRONG_ERROR]]     # nothing right
    with Executors(spider / "database") as executors:
        metrics, rows = policy_lib.score_examples(exs, greedy, samples, executors, prm_scores=stub_prm(set(gold)))
        # Weighted vote: a gold (weight sigmoid(1)) outweighs two agreeing wrong rows (2 sigmoid(-1) = 0.54);
        # nothing executes in the third: best-of-k decides.
        assert metrics.pop("prm") == pytest.approx({"min": 2 / 3, "mean": 2 / 3, "last": 2 / 3, "vote_min": 2 / 3,
                                                    "vote_mean": 2 / 3, "vote_last": 2 / 3})
        assert metrics == pytest.approx({"greedy": 2 / 3, "greedy_executable": 2 / 3, "first_sample": 1 / 3,
                                         "majority_vote": 1 / 3, "oracle": 2 / 3})
        assert [r["vote"] for r in rows] == [0, 0, 0]
        assert [r["prm"]["min"]["chosen"] for r in rows] == [1, 0, 2]  # garbage scores -inf: the error wins
        assert rows[2]["prm"]["mean"]["scores"][:2] == [None, None]
        assert [r["prm"]["vote_min"]["chosen"] for r in rows] == [1, 0, 2]
        assert rows[0]["prm"]["vote_min"]["classes"] == [0, 1, 0] and rows[2]["prm"]["vote_min"]["classes"] == [None] * 3
        # The PRM likes only a wrong answer; three candidates agree on the right one: best-of-k follows the
        # PRM, the weighted vote the three (3 sigmoid(-1) = 0.807 > sigmoid(1) = 0.731).
        metrics, rows = policy_lib.score_examples(exs[:1], [WRONG_ROWS], [[WRONG_ROWS, gold[0], same_result, gold[0]]],
                                                  executors, prm_scores=stub_prm({WRONG_ROWS}), aggregates=("min",))
        assert metrics["prm"] == {"min": 0.0, "vote_min": 1.0}
        assert rows[0]["prm"]["vote_min"]["chosen"] == 1
        assert rows[0]["prm"]["vote_min"]["scores"] == pytest.approx([1 / (1 + np.exp(-1))] + [1 / (1 + np.e)] * 3)
        # A vote between two equal results written differently: they share a bucket.
        metrics, _ = policy_lib.score_examples(exs[:1], [WRONG_ROWS], [[WRONG_ROWS, gold[0], same_result]],
                                               executors)
        assert metrics == pytest.approx({"greedy": 0.0, "greedy_executable": 1.0, "first_sample": 0.0,
                                         "majority_vote": 1.0, "oracle": 1.0})
        with pytest.raises(ValueError, match="same number of samples"):
            policy_lib.score_examples(exs[:2], greedy[:2], [[gold[0]], [gold[1], gold[1]]], executors)
        with pytest.raises(ValueError, match="3 examples, 2 greedy"):
            policy_lib.score_examples(exs, greedy[:2], samples, executors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    prm = build_prm_run(session_root(tmp_path_factory))
    return build_policy_run(tmp_path_factory.mktemp("policy"), prm / "demo_world"), prm


def test_eval_config_end_to_end_agrees_with_evaluate_ex(runs, tmp_path, capsys):
    policy, prm = runs
    out = tmp_path / "eval"
    code = run_command(evaluate, f"--config={REPO / 'configs/eval.py'}:k=2,n=3", f"--workdir={out}",
                                 f"--config.policy.workdir={policy}", f"--config.prm.path={prm}",
                                 "--config.prm.max_len=256", "--config.sampling.max_new_tokens=12",
                                 "--config.sampling.batch_size=4")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = json.loads(captured.out.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    metrics = results["metrics"]
    assert printed == {"n": 3, "k": 2, **metrics} and set(metrics["prm"]) == set(scoring.SELECTORS)
    assert "Policy evaluation finished in" in captured.err and "MV@2" in captured.err   # the closing summary
    assert str(out / "results.md") in captured.err
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["samples"]) == 2 for r in rows)
    for row in rows:
        for how, choice in row["prm"].items():
            if how.startswith(scoring.VOTE_PREFIX):
                continue
            values = [-np.inf if v is None else v for v in choice["scores"]]
            assert choice["chosen"] == int(np.argmax(values))
    # EX and majority vote recomputed by `evaluate ex` from the SQL the run wrote.
    world = prm / "demo_world"
    dev = json.loads((world / "dev.json").read_text())
    index = {(e["question"], e["query"]): i for i, e in enumerate(dev)}
    greedy_file, sample_file = tmp_path / "greedy.jsonl", tmp_path / "samples.jsonl"
    greedy_file.write_text("".join(json.dumps({"index": index[r["question"], r["gold"]], "pred": r["greedy"]}) + "\n"
                                   for r in rows))
    sample_file.write_text("".join(json.dumps({"index": index[r["question"], r["gold"]], "candidates": r["samples"]})
                                   + "\n" for r in rows))
    assert evaluate_ex(world, "dev", greedy_file, report=lambda m: None)["ex"] == pytest.approx(metrics["greedy"])
    mv = evaluate_ex(world, "dev", sample_file, report=lambda m: None)["mv"]
    assert mv == pytest.approx({"n": 3, "first": metrics["first_sample"], "vote": metrics["majority_vote"],
                                "any": metrics["oracle"]})
    assert all(0.0 <= v <= metrics["oracle"] for v in metrics["prm"].values())
    table = (out / "results.md").read_text()
    assert "| MV@2 |" in table and "| PRM-last@2 |" in table


@pytest.mark.parametrize("args, message", [
    (["--config.policy.hf_dir=/tmp"], "set exactly one of policy.workdir and policy.hf_dir"),
    (["--config.prm.aggregates=('max',)"], "prm.aggregates"),
    (["--config.sampling.kk=3"], "invalid eval config: unknown config key 'sampling.kk'; did you mean ['sampling.k'"),
    (["--config.data.semantics=sql"], "data.semantics='sql'"),
])
def test_bad_eval_config_is_one_clear_error(args, message, runs, tmp_path, capsys):
    policy, _ = runs
    out = tmp_path / "eval"
    code = run_command(evaluate, f"--config={REPO / 'configs/eval.py'}", f"--workdir={out}",
                                 f"--config.policy.workdir={policy}", *args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_policy_loads_alike_from_workdir_and_hf_export(runs, tmp_path):
    import jax
    from flax import nnx

    from caper_jax.models import to_hf
    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.parallel.rules import DEFAULT_RULES

    policy_dir, _ = runs
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    from_workdir = policy_lib.load_policy(policy_dir, mesh, DEFAULT_RULES)
    assert from_workdir.train_config["trainer"] == "sft" and from_workdir.source.endswith("checkpoints/3")
    out = to_hf(from_workdir.model, from_workdir.model.config, tmp_path / "hf")
    from_workdir.tokenizer.save_pretrained(str(out))
    from_hf = policy_lib.load_policy(out, mesh, DEFAULT_RULES)
    assert from_hf.stop_token == from_workdir.stop_token and from_hf.train_config is None
    ours, theirs = nnx.to_flat_state(nnx.state(from_workdir.model)), nnx.to_flat_state(nnx.state(from_hf.model))
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(jax.device_get(a[...]), jax.device_get(b[...]), err_msg=str(path))
    with pytest.raises(CheckpointError, match="not SFT/GRPO"):
        policy_lib.load_policy(build_prm_run(pathlib.Path(runs[1]).parent), mesh, DEFAULT_RULES)
