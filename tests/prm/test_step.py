"""The jitted PRM step on a tiny random model: it learns a fixed batch, refuses non-finite updates,
and the clause head reads exactly the positions it is given."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

from caper_jax.models import Qwen35Config
from caper_jax.prm.loss import LmAuxConfig, PairLossConfig, pairwise_loss
from caper_jax.prm.model import ClausePRM
from caper_jax.prm.step import jit_steps
from caper_jax.utils.optim import decay_mask, init_state, make_optimizer

# One model for every test here (its train step compiles once per batch layout): the vocabulary holds the
# trained BPE tokenizer of the within-groups test (tests/helpers.make_tokenizer, 427 tokens).
CONFIG = Qwen35Config.tiny(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
OPTIM = ConfigDict(dict(lr=3e-3, warmup_steps=2, total_steps=40, weight_decay=0.0, b1=0.9, b2=0.95,
                        grad_clip=1.0))


def make_batch(rng, b=4, t=24):
    ids = rng.integers(1, 64, size=(2, b, t)).astype(np.int32)
    mask = np.ones((2, b, t), np.int32)
    mask[:, :, -3:] = 0                                      # right padding
    pos = np.full((2, b), t - 4, np.int32)
    return {"chosen_ids": ids[0], "chosen_mask": mask[0], "chosen_pos": pos[0],
            "rejected_ids": ids[1], "rejected_mask": mask[1], "rejected_pos": pos[1],
            "margin": np.ones(b, np.float32), "weight": np.ones(b, np.float32), "lm_weight": np.ones(b, np.float32)}


@pytest.fixture(scope="module")
def setup():
    model = ClausePRM(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(OPTIM)
    train, evals, clauses = jit_steps(graphdef, tx, PairLossConfig())
    return model, graphdef, params, tx, train, evals, clauses


def test_backbone_has_no_lm_head(setup):
    model = setup[0]
    assert not hasattr(model.backbone, "lm_head")


def test_learns_a_fixed_batch(setup):
    """The first step's loss (its metrics are those before the update) is the margin-weighted Bradley-Terry
    loss of the head read from the backbone's hidden states at each row's own chosen and rejected
    positions, the padding row left out; then the step learns the batch."""
    model, graphdef, params, tx, train, _, _ = setup
    batch = make_batch(np.random.default_rng(0))
    batch["margin"] = np.array([0.15, 0.5, 0.85, 9.0], np.float32)
    batch["weight"] = np.array([1.0, 1.0, 1.0, 0.0], np.float32)        # a padding row, whatever its margin
    batch["chosen_pos"] = np.array([20, 11, 16, 8], np.int32)
    batch["rejected_pos"] = np.array([17, 20, 6, 13], np.int32)
    backbone = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p).backbone.hidden_states(ids, mask))
    hidden = np.asarray(backbone(params, np.concatenate([batch["chosen_ids"], batch["rejected_ids"]]),
                                 np.concatenate([batch["chosen_mask"], batch["rejected_mask"]])), np.float64)
    head = np.asarray(model.score_head[...], np.float64)

    def scores(side):
        rows = np.arange(4) + (4 if side == "rejected" else 0)
        return hidden[rows, batch[f"{side}_pos"]] @ head

    gap = scores("chosen") - scores("rejected")
    per_row = batch["margin"] / PairLossConfig().annotation_alpha * np.log1p(np.exp(-gap))     # -w(delta) log sigmoid(gap)
    expected = (per_row * batch["weight"]).sum() / batch["weight"].sum()
    state = init_state(jax.tree.map(jnp.copy, params), tx)
    losses = []
    for _ in range(30):
        state, m = train(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-4)
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(m["accuracy"]) == 1.0       # of the three real rows
    assert int(state.step) == 30 and int(state.nonfinite) == 0


def test_non_finite_step_is_refused(setup):
    _, _, params, tx, train, _, _ = setup
    state = init_state(jax.tree.map(jnp.copy, params), tx)
    batch = make_batch(np.random.default_rng(1))
    state, _ = train(state, batch)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = dict(batch, margin=np.full(4, np.nan, np.float32))
    state, m = train(state, bad)
    assert float(m["refused"]) == 1.0 and int(state.nonfinite) == 1
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    state, m = train(state, batch)
    assert float(m["refused"]) == 0.0 and int(state.nonfinite) == 0


def test_scores_are_the_head_at_the_given_positions(setup):
    model, graphdef, params, _, _, evals, clauses = setup
    batch = make_batch(np.random.default_rng(2))
    every = np.asarray(model.token_scores(jnp.asarray(batch["chosen_ids"]), jnp.asarray(batch["chosen_mask"])))
    r_pos, _ = evals(params, batch)
    np.testing.assert_allclose(r_pos, every[np.arange(4), batch["chosen_pos"]], rtol=1e-5, atol=1e-6)
    pos = np.array([[3, 7, -1]] * 4, np.int32)
    k = np.asarray(clauses(params, batch["chosen_ids"], batch["chosen_mask"], pos))
    np.testing.assert_allclose(k[:, :2], every[:, [3, 7]], rtol=1e-5, atol=1e-6)
    assert (k[:, 2] == 0).all()


def test_weight_decay_skips_norms(setup):
    params = setup[2]
    mask = decay_mask(params)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    norms = [k for k in flat if "norm" in k]
    assert norms and not any(flat[k] for k in norms)
    assert any(flat[k] for k in flat if "embed_tokens" in k)


def test_within_groups_give_the_loss_of_their_tuples_as_pairs(setup):
    """The same tuples, batched as pairs or with within-trajectory groups (one forward per negative
    query): same pairs, same scores, so the same loss and accuracy before the update.

    The grouped batch goes through the train step (its metrics are those of the loss before the update);
    the reference scores the tuples one pair per row with the forward-only eval step and applies
    ``pairwise_loss`` (checked by hand in test_loss.py) to those scores: no second train-step compile."""
    from tests.helpers import make_tokenizer, make_within_tuples, prompt_fn
    from caper_jax.data.prm_training_batches import prm_pipeline

    _, _, params, tx, train, evals, _ = setup
    tokenizer = make_tokenizer()
    assert len(tokenizer) <= CONFIG.vocab_size
    tuples = make_within_tuples()
    common = dict(max_len=192, bucket_lengths=(192,), prompt_fn=prompt_fn)
    as_pairs = prm_pipeline(tuples, tokenizer, global_batch_size=len(tuples), **common).dataset[0]
    grouped = prm_pipeline(tuples, tokenizer, global_batch_size=2, within_batch_size=8, **common).dataset[0]
    assert grouped["group_weight"].sum() == 7 and grouped["weight"].sum() == 2
    # 2 + (tuples - 2) pair rows vs 2 pair rows (4 sequences) + 7 group rows.
    assert (grouped["group_margin"] > 0).sum() == len(tuples) - 2
    assert "group_ids" not in as_pairs and as_pairs["weight"].sum() == len(tuples)
    r_chosen, r_rejected = evals(params, {k: v for k, v in as_pairs.items() if k != "record_index"})
    expected_loss, expected = pairwise_loss(r_chosen, r_rejected, as_pairs["margin"], as_pairs["weight"],
                                            PairLossConfig())
    state = init_state(jax.tree.map(jnp.copy, params), tx)
    _, got = train(state, {k: v for k, v in grouped.items() if k != "record_index"})
    np.testing.assert_allclose(float(got["loss"]), float(expected_loss), rtol=1e-5)
    np.testing.assert_allclose(float(got["accuracy"]), float(expected["accuracy"]), rtol=1e-6)
    np.testing.assert_allclose(float(got["margin_gap"]), float(expected["margin_gap"]), rtol=1e-4)


def test_lm_term_is_the_next_token_loss_of_the_chosen_sql(setup):
    """loss(lm_coef=c) - loss(0) = c * mean NLL of the chosen rows' SQL tokens, the NLL computed here
    from the full logits of the backbone (tied embedding head) with log_softmax."""
    model, graphdef, params, tx, train0, _, _ = setup
    batch = make_batch(np.random.default_rng(3))
    marker = 63
    batch["chosen_ids"][:, 5] = marker                   # prompt: 0..5, SQL: 6..chosen_pos (= 20)
    batch["chosen_ids"][:, :5] = np.where(batch["chosen_ids"][:, :5] == marker, 1, batch["chosen_ids"][:, :5])
    batch["chosen_ids"][:, 6:] = np.where(batch["chosen_ids"][:, 6:] == marker, 1, batch["chosen_ids"][:, 6:])
    batch["weight"][3] = 0.0                             # a padding row does not count
    batch["lm_weight"][2] = 0.0                          # nor a wrong query's state (a within-trajectory tuple)
    train_lm, _, _ = jit_steps(graphdef, tx, PairLossConfig(), lm_cfg=LmAuxConfig(coef=0.5, marker_id=marker))
    fresh = lambda: init_state(jax.tree.map(jnp.copy, params), tx)
    _, m0 = train0(fresh(), batch)
    _, m1 = train_lm(fresh(), batch)
    logits = model.backbone(jnp.asarray(batch["chosen_ids"]), jnp.asarray(batch["chosen_mask"]))
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    nll = [-logp[row, t - 1, batch["chosen_ids"][row, t]] for row in range(2) for t in range(6, 21)]
    np.testing.assert_allclose(float(m1["lm_nll"]), np.mean(nll), rtol=1e-5)
    np.testing.assert_allclose(float(m1["loss"]) - float(m0["loss"]), 0.5 * np.mean(nll), rtol=1e-4)
    assert "lm_nll" not in m0
