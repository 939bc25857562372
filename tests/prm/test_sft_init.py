"""A Clause-PRM initialised from an SFT run (model.init_from), and the policy's clause confidence.

References: the SFT run's own parameters as the evaluation loader restores them (bit-exact), and
log-probs of the policy's full-vocabulary logits (``model(ids)`` + log_softmax) for the confidence.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from caper_jax.eval import policy as policy_lib
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel.rules import DEFAULT_RULES
from caper_jax.prm import trainer as prm_trainer
from caper_jax.utils.errors import CheckpointError
from tests.helpers import build_policy_run, build_prm_run, session_root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    prm = build_prm_run(session_root(tmp_path_factory))
    return build_policy_run(tmp_path_factory.mktemp("policy"), prm / "demo_world"), prm


def _prm_config(init_from: str, **model):
    from configs.prm import get_config

    config = get_config()
    config.model.init_from = init_from
    for key, value in model.items():
        config.model[key] = value
    return config


def _prm_settings(init_from: str, **model):
    """The PRM's settings as ``validate`` builds them, without its check of the run (the tests call it)."""
    from caper_jax.prm.settings import PrmSettings
    from caper_jax.settings import from_config

    return from_config(PrmSettings, _prm_config(init_from, **model))


def test_backbone_is_the_sft_runs_and_the_head_is_new(runs):
    sft_dir, _ = runs
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    policy = policy_lib.load_policy(sft_dir, mesh, DEFAULT_RULES)
    vocab = policy.model.config.vocab_size
    prm = prm_trainer.build_model(_prm_settings(str(sft_dir)), vocab, mesh, DEFAULT_RULES)
    ours = dict(nnx.to_flat_state(nnx.state(prm, nnx.Param)))
    sft = dict(nnx.to_flat_state(nnx.state(policy.model, nnx.Param)))
    assert set(ours) == {("backbone", *path) for path in sft} | {("score_head",)}
    for path, value in sft.items():
        np.testing.assert_array_equal(jax.device_get(ours[("backbone", *path)][...]), jax.device_get(value[...]),
                                      err_msg=str(path))
    head = np.asarray(jax.device_get(prm.score_head[...]))
    assert head.shape == (policy.model.config.hidden_size,) and np.all(np.isfinite(head)) and np.any(head != 0)
    # The PRM trains from it: a forward runs and gives one score per row.
    ids = np.ones((2, 16), np.int32)
    assert prm(ids, np.ones_like(ids), np.array([3, 15])).shape == (2,)


def test_a_missing_or_mismatched_sft_run_is_one_clear_error(runs, tmp_path):
    sft_dir, prm_dir = runs
    cases = [(_prm_config(str(tmp_path / "nope")), "neither a trainer workdir"),
             (_prm_config(str(prm_dir)), "'prm' trainer, not SFT/GRPO"),
             (_prm_config(str(sft_dir), param_dtype="bfloat16"), "differs from this PRM's"),
             (_prm_config(str(sft_dir), hf_dir="/x"), "set one")]
    for config, message in cases:
        with pytest.raises(CheckpointError, match=message):
            prm_trainer.validate(config)
    with pytest.raises(CheckpointError, match="a different tokenizer"):
        prm_trainer.check_init_from(_prm_settings(str(sft_dir)), vocab_size=10**6)   # more tokens than rows


def test_clause_confidence_matches_full_vocabulary_log_probs(runs):
    import jax.numpy as jnp

    from caper_jax.sql.contract import policy_prompt
    from caper_jax.eval.confidence import clause_logprobs
    from caper_jax.sql.clauses import split_clauses

    sft_dir, _ = runs
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    policy = policy_lib.load_policy(sft_dir, mesh, DEFAULT_RULES)
    rows = [{"question": "how many singers?", "schema": "singer(id, name, age)",
             "sql": "SELECT count(*) FROM singer WHERE age > 20"},
            {"question": "names", "schema": "singer(id, name)", "sql": "SELECT name FROM singer ORDER BY name"},
            {"question": "x", "schema": "t(a)", "sql": "SELEC ((("}]
    got = clause_logprobs(policy, rows, max_len=256, batch_size=2)
    assert got[2] is None
    tok = policy.tokenizer
    for row, values in zip(rows[:2], got[:2]):
        prompt = tok(policy_prompt(row["question"], row["schema"]), add_special_tokens=False)["input_ids"]
        enc = tok(row["sql"], add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray([prompt + enc["input_ids"] + [policy.stop_token]], np.int32)
        logits = policy.model(jnp.asarray(ids), jnp.ones_like(ids))
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[0]
        per_token = [logp[len(prompt) + t - 1, ids[0, len(prompt) + t]] for t in range(ids.shape[1] - len(prompt))]
        units = split_clauses(row["sql"])
        bounds = [u.start for u in units[1:]] + [len(row["sql"]) + 1]
        starts = [s for s, _ in enc["offset_mapping"]] + [len(row["sql"])]
        expected, first = [], 0
        for bound in bounds:  # tokens are in order: each clause takes those that start before the next clause
            mine = [lp for s, lp in zip(starts, per_token) if s < bound][first:]
            first += len(mine)
            expected.append(np.mean(mine))
        np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-5)
