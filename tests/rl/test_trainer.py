"""The GRPO trainer: the update's dependence on rewards, and short end-to-end runs of every variant.

* All-equal rewards give advantages exactly 0; with beta = 0 the loss gradient is then exactly 0 and
  AdamW (no weight decay) leaves every parameter bit-identical. Unequal rewards move them, and the
  completion with the higher reward gains log-probability.
* sparse / token / clause runs of 2 steps on a small demo world (tiny random policy, a Clause-PRM run
  written here through the same Checkpointer the PRM trainer uses) write metrics and checkpoints, and
  a rerun with more steps resumes from the last checkpoint instead of starting over; the PRM scores the
  reward layout gets are the PRM's own scores of the sampled prefixes.
* On one forced rollout (two-clause completions put in place of the sampler's), GRPO reads the PRM at
  each clause's last token, and the clause variant's advantages are the hand-computed clause layout's
  while sparse's are the group-normalised execution reward alone.
"""
from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.utils.optim import init_state, make_optimizer
from caper_jax.rl import step as rl_step
from caper_jax.rl import trainer as T
from caper_jax.rl.step import advantages_from_rewards
from caper_jax.utils.monitoring import read_metrics
from tests.sft import persistent_compile_cache

SMALL_WORLD = dict(demo_train_size=40, demo_dev_size=10)


@pytest.fixture(scope="module", autouse=True)
def xla_cache(tmp_path_factory):
    """A persistent compilation cache for this module: six runs compile the same few programs."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


def grpo_config(**rl):
    from configs.grpo import get_config

    config = get_config()
    config.rl.update(dict(beta=0.0, group_size=2, prompts_per_step=2, update_epochs=1), **rl)
    config.optim.lr = 1e-2
    config.optim.warmup_steps = 0
    return config


def e2e_config(data_dir: str, variant: str = "sparse", beta: float = 0.0):
    """The end-to-end runs' config: 1 prompt x G=2, 8 new tokens, prompts padded to 192."""
    config = grpo_config(beta=beta, prompts_per_step=1)
    config.data.update(SMALL_WORLD, dir=data_dir)
    config.reward.variant = variant
    config.sampling.update(max_new_tokens=8, max_prompt_len=192)
    config.eval.update(num_examples=2, batch_size=2)
    config.update(export_hf=False, log_every=1, ckpt_every=1)
    config.optim.total_steps = 2
    return config


@pytest.fixture(scope="module")
def update_setup(world):
    """The e2e runs' policy, optimizer, mesh and shapes: the update program compiled here is the one the
    sparse/token runs below reuse (same process-wide program cache key)."""
    from caper_jax.loop import create_state
    from caper_jax.parallel import mesh as mesh_lib
    from caper_jax.rl.step import jit_completion_logprobs
    from caper_jax.rl.trainer import load_policy

    data_dir, tokenizer = world
    settings = T.validate(e2e_config(data_dir))
    mesh = mesh_lib.make_mesh(dict(settings.mesh_shape))
    rules = settings.sharding_rules
    policy = load_policy(settings, len(tokenizer), mesh, rules)
    tx = make_optimizer(settings.optim)
    graphdef, state, shardings = create_state(policy, tx, mesh, rules)
    rng = np.random.default_rng(0)
    new = settings.sampling.max_new_tokens
    ids = jnp.asarray(rng.integers(4, len(tokenizer), (2, settings.sampling.max_prompt_len + new)), jnp.int32)
    attention = jnp.ones_like(ids)
    logprobs = functools.partial(jit_completion_logprobs, input_ids=ids, attention_mask=attention,
                                 graphdef=graphdef, completion_len=new, temperature=1.0, chunk_size=settings.chunk_size)
    fresh_state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings)  # the e2e runs' layout
    return dict(params=state.params, fresh_state=fresh_state, ids=ids, attention=attention, new=new,
                logprobs=logprobs, mesh=mesh, update=rl_step.jit_update(graphdef, tx, settings, shardings),
                graphdef=graphdef, tx=tx, shardings=shardings)


def update_once(setup, exec_rewards):
    """One GRPO update (beta = 0) on a hand-made rollout of one group of 2 completions."""
    with jax.set_mesh(setup["mesh"]):
        state = setup["fresh_state"](setup["params"])  # a new state: the update donates its input
        before = jax.tree.map(np.asarray, state.params)
        completion = jnp.ones((2, setup["new"]), jnp.int32)
        old_logp = setup["logprobs"](state.params)
        adv, _ = rl_step.advantages_from_rewards(
            jnp.zeros((2, setup["new"])), jnp.full((2, 8), -1, jnp.int32), jnp.asarray(exec_rewards, jnp.float32),
            completion, jnp.ones(2, bool), variant="sparse", group_size=2, gamma=1.0, prm_weight=1.0,
            exec_failure_reward=0.0, format_penalty=0.0, scale_by_std=True, std_ddof=0, std_eps=1e-6,
            std_scope="group")
        batch = {"input_ids": setup["ids"], "attention_mask": setup["attention"], "completion_mask": completion,
                 "old_logp": old_logp, "advantages": adv}
        state, metrics = setup["update"](state, batch)
        new_logp = setup["logprobs"](state.params)
    return before, state, np.asarray(adv), np.asarray(old_logp).sum(1), np.asarray(new_logp).sum(1), metrics


def test_equal_rewards_leave_params_unchanged(update_setup):
    before, state, adv, _, _, metrics = update_once(update_setup, [1.0, 1.0])
    assert np.all(adv == 0.0)
    assert float(metrics["refused"]) == 0.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_unequal_rewards_move_params_towards_the_better_completion(update_setup):
    before, state, adv, old, new, _ = update_once(update_setup, [1.0, 0.0])
    assert adv[0].min() > 0 > adv[1].max()
    moved = sum(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(before),
                                                                        jax.tree.leaves(state.params)))
    assert moved > 0
    gain = new - old
    assert gain[0] > 0 > gain[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from caper_jax.data.data_world import prepare_world

    config = grpo_config()
    config.data.update(SMALL_WORLD, dir=str(tmp_path_factory.mktemp("world")))
    return config.data.dir, prepare_world(T.validate(config), config.data.dir).tokenizer


@pytest.fixture(scope="module")
def prm_run(tmp_path_factory, world):
    """A PRM trainer workdir holding one checkpoint of a random tiny Clause-PRM (the PRM trainer's layout)."""
    from caper_jax import checkpoint as ckpt_lib
    from caper_jax import runs
    from caper_jax.models.presets import model_preset
    from caper_jax.prm.model import ClausePRM
    from configs.prm import get_config

    _, tokenizer = world
    config = get_config()
    workdir = tmp_path_factory.mktemp("prm_run")
    prm = ClausePRM(model_preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(3))
    state = init_state(nnx.state(prm), make_optimizer(config.optim))
    with ckpt_lib.Checkpointer(workdir / "checkpoints", async_save=False) as checkpointer:
        checkpointer.save(7, state, config=config.to_dict(), run=runs.record(prm.config, None), force=True)
    return workdir


def prm_prefix_scores(vocab_size: int, prompt_ids, prompt_mask, tokens, ends) -> np.ndarray:
    """The Clause-PRM's score of each prefix ``prompt + completion[:e + 1]`` for ``(row, e)`` in ``ends``: every
    prefix alone (no left padding, nothing after it) through the PRM rebuilt as the ``prm_run`` fixture
    builds it, read at its last token. The reference for what the trainer hands to ``layout_rewards``."""
    from caper_jax.models.presets import model_preset
    from caper_jax.prm.model import ClausePRM

    graphdef, params = nnx.split(ClausePRM(model_preset("tiny", vocab_size=vocab_size), rngs=nnx.Rngs(3)))
    prefixes = [[*prompt_ids[b][prompt_mask[b] > 0], *tokens[b, :e + 1]] for b, e in ends]
    ids = np.zeros((len(prefixes), max(map(len, prefixes))), np.int32)
    mask = np.zeros_like(ids)
    for i, prefix in enumerate(prefixes):
        ids[i, :len(prefix)], mask[i, :len(prefix)] = prefix, 1
    score = jax.jit(lambda p, i, m, at: nnx.merge(graphdef, p)(i, m, at))
    return np.asarray(score(params, ids, mask, mask.sum(1) - 1))


class Recorder:
    """Wraps the trainer's sampler and ``advantages_from_rewards``: what each step sampled and what it handed
    to the reward layout (PRM scores, execution rewards, parse flags) and got back (token advantages)."""

    def __init__(self, monkeypatch, forced: list[list[int]] | None = None):
        self.samples, self.calls, self.forced = [], [], forced
        monkeypatch.setattr(T, "generate", self.generate)
        monkeypatch.setattr(T, "advantages_from_rewards", self.advantages)

    def generate(self, model, prompt_ids, prompt_mask, key, sampling, group_size=1):
        """The real sampler, or (``forced``) the given completions with log-probs 0. Records each row's
        prompt: the step's distinct prompts repeated to their groups, as the rollout lays them out."""
        from caper_jax.models.sampler import SampleOutput, generate

        if self.forced is None:
            output = generate(model, prompt_ids, prompt_mask, key, sampling, group_size=group_size)
        else:
            rows = prompt_ids.shape[0] * group_size
            tokens = np.full((rows, sampling.max_new_tokens), sampling.pad_id, np.int32)
            for b in range(rows):
                tokens[b, :len(self.forced[b])] = self.forced[b]
            output = SampleOutput(jnp.asarray(tokens), jnp.asarray([len(f) for f in self.forced], jnp.int32),
                                  jnp.zeros(tokens.shape, jnp.float32))
        self.samples.append(dict(prompt_ids=np.repeat(np.asarray(prompt_ids), group_size, axis=0),
                                 prompt_mask=np.repeat(np.asarray(prompt_mask), group_size, axis=0),
                                 tokens=np.asarray(output.tokens), lengths=np.asarray(output.lengths)))
        return output

    def advantages(self, prm_scores, clause_ends, exec_rewards, completion_mask, parse_ok, **settings):
        adv, stats = advantages_from_rewards(prm_scores, clause_ends, exec_rewards, completion_mask, parse_ok,
                                             **settings)
        self.calls.append(dict(prm_scores=np.asarray(prm_scores), exec_rewards=np.asarray(exec_rewards),
                               parse_ok=np.asarray(parse_ok), completion_mask=np.asarray(completion_mask),
                               advantages=np.asarray(adv)))
        return adv, stats


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
@pytest.mark.parametrize("variant,beta", [("sparse", 0.0), ("token", 0.0), ("clause", 0.04)])
def test_end_to_end_and_resume(variant, beta, world, prm_run, tmp_path, monkeypatch):
    """Sampled rollouts (a random policy's: its completions need not parse); the PRM scores the layout gets
    are the PRM's scores of the sampled completion's prefixes (none for sparse). The clause run (frozen PRM,
    reference model, KL) is then resumed for one more step."""
    config = e2e_config(world[0], variant, beta)
    config.prm.workdir = str(prm_run) if variant != "sparse" else ""
    recorder = Recorder(monkeypatch)
    results = T.run(T.validate(config), str(tmp_path))
    assert results["eval/n"] == 2 and 0.0 <= results["eval/greedy_ex"] <= 1.0
    sample, call = recorder.samples[0], recorder.calls[0]
    if variant == "sparse":
        assert not call["prm_scores"].any()
    else:
        positions = [(b, t) for b in range(2) for t in range(int(sample["lengths"][b]))]
        expected = prm_prefix_scores(len(world[1]), sample["prompt_ids"], sample["prompt_mask"], sample["tokens"],
                                     positions)
        np.testing.assert_allclose([call["prm_scores"][b, t] for b, t in positions], expected, rtol=1e-3, atol=1e-3)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for key in ("rollout/ex", "rollout/unit_reward_mean", "train/clip_frac_low", "train/entropy",
                "perf/rollout_tokens_per_s", "perf/update_tokens_per_s", "perf/score_s", "perf/prm_s"):
        assert np.isfinite(train_rows[-1][key]), key
    parts = ("perf/rollout_s", "perf/score_s", "perf/prm_s", "perf/reference_s", "perf/update_s")
    for row in train_rows:   # the timed parts are disjoint pieces of the step
        assert all(row[k] >= 0 for k in parts) and sum(row[k] for k in parts) <= row["perf/step_s"] + 1e-6
        assert row["perf/update_s"] > 0 and row["perf/rollout_s"] > 0
    assert ("train/kl_ref" in train_rows[-1]) == (beta > 0)
    assert (tmp_path / "checkpoints" / "2").is_dir()
    from caper_jax import runs
    saved = runs.read_run(tmp_path)   # the run records the policy's architecture and the world's tokenizer
    assert saved.tokenizer_dir == pathlib.Path(world[0]) / "tokenizer"
    units = train_rows[-1]["rollout/units_per_sample"]
    assert units == 1.0 if variant == "sparse" else units >= 1.0

    if variant != "clause":   # resuming is the same code for every variant: the one with the most parts
        return
    config.optim.total_steps = 3
    T.run(T.validate(config), str(tmp_path))
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "rollout/reward_mean" in r]
    assert steps == [1, 2, 3], "the rerun must resume at step 3, not start over"
    assert (tmp_path / "checkpoints" / "3").is_dir()
    assert json.loads((tmp_path / "results.json").read_text())["variant"] == variant


# Two completions of two clauses each (SELECT | WHERE or FROM), cut at token boundaries: row 0 runs (whatever
# its result: correct = wrong = 0.5), row 1 fails (there is no table t: failure = 0). Row 1 is shorter.
FORCED = (("SELECT 1", " WHERE 1"), ("SELECT x", " FROM t"))


@pytest.fixture(scope="module")
def forced_runs(world, prm_run, tmp_path_factory):
    """One GRPO step of each of sparse and clause on the same two forced completions, recorded; with the
    clause ends read off the text (the first clause's tokens, then the stop token) and the PRM's scores of
    every prefix ending there or one token either side of it."""
    from caper_jax.policy.prompts import stop_token_id

    data_dir, tokenizer = world
    encode = functools.partial(tokenizer, add_special_tokens=False)
    forced = [encode(first)["input_ids"] + encode(second)["input_ids"] + [stop_token_id(tokenizer)]
              for first, second in FORCED]
    for ids, (first, second) in zip(forced, FORCED):
        assert encode(first + second)["input_ids"] + [stop_token_id(tokenizer)] == ids   # cut at a token boundary
    ends = [(len(encode(first)["input_ids"]) - 1, len(ids) - 1) for ids, (first, _) in zip(forced, FORCED)]
    runs = {}
    for variant in ("sparse", "clause"):
        config = e2e_config(data_dir, variant)
        config.prm.workdir = str(prm_run) if variant == "clause" else ""
        config.reward.update(correct=0.5, wrong=0.5, failure=0.0)
        config.eval.num_examples = 0
        config.optim.total_steps = 1
        settings = T.validate(config)
        workdir = tmp_path_factory.mktemp(f"forced_{variant}")
        with pytest.MonkeyPatch.context() as monkeypatch:
            recorder = Recorder(monkeypatch, forced)
            T.run(settings, str(workdir))
        [sample], [call] = recorder.samples, recorder.calls
        [metrics] = [r for r in read_metrics(workdir / "metrics.jsonl") if "rollout/reward_mean" in r]
        runs[variant] = dict(sample=sample, call=call, metrics=metrics)
    sample = runs["clause"]["sample"]
    np.testing.assert_array_equal(sample["tokens"], runs["sparse"]["sample"]["tokens"])
    probes = [(b, e + shift) for b, row in enumerate(ends) for e in row for shift in (-1, 0, 1)
              if e + shift < len(forced[b])]
    scores = prm_prefix_scores(len(tokenizer), sample["prompt_ids"], sample["prompt_mask"], sample["tokens"], probes)
    return dict(runs=runs, ends=ends, lengths=[len(f) for f in forced], prefix=dict(zip(probes, scores)))


@pytest.mark.slow   # two end-to-end runs
def test_grpo_reads_the_prm_at_the_completions_clause_ends(forced_runs):
    """The per-token PRM scores GRPO slices out of the PRM's forward over prompt + completion line up with the
    completion: at each clause's last token (the stop token for the last clause) the score is the PRM's
    score of the prompt and the completion up to that token, which one token earlier or later is not."""
    call, prefix = forced_runs["runs"]["clause"]["call"], forced_runs["prefix"]
    for b, row in enumerate(forced_runs["ends"]):
        for e in row:
            assert call["prm_scores"][b, e] == pytest.approx(prefix[b, e], rel=1e-3, abs=1e-3), (b, e)
            for neighbour in (e - 1, e + 1):
                if (b, neighbour) in prefix:   # a slice off by one would read these instead
                    assert abs(prefix[b, neighbour] - prefix[b, e]) > 0.05, (b, e, neighbour)


@pytest.mark.slow   # two end-to-end runs
def test_clause_rewards_differ_from_sparse_end_to_end(forced_runs):
    """The same forced rollout under sparse and clause. Sparse: no PRM score, one unit per row rewarded with
    its execution reward, every token's advantage the group-normalised execution reward. Clause: a unit
    per clause rewarded with the PRM's score of the prefix ending there (+ the execution reward on the
    last), normalised over the group's units; a token's advantage is the return-to-go from its clause."""
    sparse, clause = forced_runs["runs"]["sparse"], forced_runs["runs"]["clause"]
    ends, lengths, prefix = forced_runs["ends"], forced_runs["lengths"], forced_runs["prefix"]
    execution = np.array([0.5, 0.0])
    for run in (sparse, clause):
        np.testing.assert_array_equal(run["call"]["exec_rewards"], execution)
        assert run["call"]["parse_ok"].all()
        np.testing.assert_array_equal(run["call"]["completion_mask"].sum(1), lengths)

    def normalised(rewards):
        return (rewards - rewards.mean()) / (rewards.std() + 1e-6)

    expected_sparse = np.zeros((2, 8))
    for b, value in enumerate(normalised(execution)):
        expected_sparse[b, :lengths[b]] = value
    assert not sparse["call"]["prm_scores"].any()
    np.testing.assert_allclose(sparse["call"]["advantages"], expected_sparse, rtol=1e-5, atol=1e-5)
    assert sparse["metrics"]["rollout/units_per_sample"] == 1.0
    assert sparse["metrics"]["rollout/unit_reward_mean"] == pytest.approx(execution.mean())

    units = np.array([[prefix[b, first], prefix[b, last] + execution[b]] for b, (first, last) in enumerate(ends)])
    n = normalised(units)
    expected_clause = np.zeros((2, 8))
    for b, (first, last) in enumerate(ends):
        expected_clause[b, :first + 1] = n[b, 0] + n[b, 1]
        expected_clause[b, first + 1:last + 1] = n[b, 1]
    np.testing.assert_allclose(clause["call"]["advantages"], expected_clause, rtol=1e-3, atol=1e-3)
    assert clause["metrics"]["rollout/units_per_sample"] == 2.0
    assert clause["metrics"]["rollout/unit_reward_mean"] == pytest.approx(units.mean(), rel=1e-3, abs=1e-3)
    assert np.abs(clause["call"]["advantages"] - sparse["call"]["advantages"]).max() > 0.1


def test_the_frozen_prm_is_read_from_a_whole_checkpoint_only(world, prm_run, tmp_path):
    """Params of the newest verified step (the fixture's Rngs(3) init, not the loader's Rngs(0)) in the
    architecture of its run record; a missing step, an interrupted save or an empty run is one CheckpointError."""
    import shutil

    from caper_jax import runs
    from caper_jax.models.presets import model_preset
    from caper_jax.parallel.mesh import make_mesh
    from caper_jax.parallel.rules import DEFAULT_RULES
    from caper_jax.prm.model import ClausePRM
    from caper_jax.utils.errors import CheckpointError

    vocab = len(world[1])
    mesh, rules = make_mesh(), tuple(tuple(r) for r in DEFAULT_RULES)
    run = runs.load_run(prm_run, module=ClausePRM, mesh=mesh, rules=rules, trainers=("prm",))
    saved = nnx.state(ClausePRM(model_preset("tiny", vocab_size=vocab), rngs=nnx.Rngs(3)))
    assert run.step == 7 and run.model_config.vocab_size == vocab
    jax.tree.map(np.testing.assert_array_equal, nnx.state(run.model), saved)
    with pytest.raises(CheckpointError, match="has no step 5"):
        runs.load_run(prm_run, module=ClausePRM, mesh=mesh, rules=rules, step=5)
    damaged = tmp_path / "damaged"
    shutil.copytree(prm_run, damaged)
    (damaged / "checkpoints" / "7" / "caper_manifest.json").unlink()      # as a save killed mid-write
    for step in (0, 7):
        with pytest.raises(CheckpointError):
            runs.load_run(damaged, module=ClausePRM, mesh=mesh, rules=rules, step=step)
    with pytest.raises(CheckpointError):
        runs.load_run(tmp_path / "nothing", module=ClausePRM, mesh=mesh, rules=rules)


def test_config_accepts_exactly_the_registered_reward_variants():
    from caper_jax.rl.rewards import VARIANTS, reward_variant

    assert VARIANTS == ("sparse", "clause", "token")
    for name in VARIANTS:
        config = grpo_config()
        config.reward.variant = name
        config.prm.workdir = "prm_run" if name != "sparse" else ""  # only sparse trains without a PRM
        T.validate(config)
        assert reward_variant(name).uses_prm == (name != "sparse")
    for name in ("dense", "Clause", "tokens", ""):
        config = grpo_config()
        config.reward.variant = name
        config.prm.workdir = "prm_run"
        with pytest.raises(ValueError) as refused:
            T.validate(config)
        assert str(refused.value) == (f"reward.variant: unknown reward variant {name!r}; "
                                      "expected one of ('sparse', 'clause', 'token')")


def test_bad_config_is_refused():
    config = grpo_config()
    config.reward.variant = "clause"
    with pytest.raises(ValueError, match="prm.workdir"):
        T.validate(config)
    config = grpo_config(group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        T.validate(config)


def first_update(setup, settings, sampler_shift):
    """``rl.recompute_old_logp`` as the trainer runs it: a hand-made rollout of one group of 2 whose sampler
    log-probs are the policy's plus ``sampler_shift`` [2, N]; the first update with ``old_from_self``, and the
    same update with the sampler's log-probs as the old ones (today's default) for contrast."""
    with jax.set_mesh(setup["mesh"]):
        state = setup["fresh_state"](setup["params"])
        completion = jnp.ones((2, setup["new"]), jnp.int32)
        sampler = setup["logprobs"](state.params) + jnp.asarray(sampler_shift, jnp.float32)
        batch = {"input_ids": setup["ids"], "attention_mask": setup["attention"], "completion_mask": completion,
                 "old_logp": sampler, "advantages": jnp.asarray([[1.0], [-1.0]]) * completion}
        _, as_sampled = setup["update"](state, batch)
        extra = {"old_from_self": jnp.ones(2, bool), **({"sampler_logp": sampler} if settings.rl.tis_cap else {})}
        update = rl_step.jit_update(setup["graphdef"], setup["tx"], settings, setup["shardings"])
        _, own = update(setup["fresh_state"](setup["params"]), {**batch, **extra})
    return own, as_sampled, np.asarray(sampler)


def test_the_first_update_takes_its_own_log_probs_as_the_old_ones(update_setup, world):
    """rl.recompute_old_logp: ratio exactly 1 on every token at the first update, where the sampler's log-probs
    (here off by up to 2 %) give e^-shift; the update returns its log-probs (the later updates' old ones), which
    are the policy's at the rollout's parameters."""
    config = e2e_config(world[0])
    config.rl.recompute_old_logp = True
    settings = T.validate(config)
    shift = np.random.default_rng(0).uniform(-0.02, 0.02, (2, update_setup["new"]))
    own, as_sampled, sampler = first_update(update_setup, settings, shift)
    assert float(own["ratio_min"]) == float(own["ratio_max"]) == 1.0
    assert float(own["approx_kl"]) == 0.0
    assert float(as_sampled["ratio_max"]) == pytest.approx(np.exp(-shift.min()), rel=1e-4)
    assert float(as_sampled["ratio_min"]) == pytest.approx(np.exp(-shift.max()), rel=1e-4)
    np.testing.assert_allclose(np.asarray(own["logp"]), sampler - shift, rtol=0, atol=1e-5)
    assert "logp" not in as_sampled


def test_truncated_importance_weight_in_the_update(update_setup, world):
    """rl.tis_cap = 2: row 0's sampler log-probs are log 3 below the trainer's (weight min(3, 2) = 2, capped),
    row 1's equal (weight 1). Ratio 1 and advantages +-1 make the token-mean policy loss -(2 - 1) / 2 = -0.5."""
    config = e2e_config(world[0])
    config.rl.update(recompute_old_logp=True, tis_cap=2.0)
    settings = T.validate(config)
    shift = np.stack([np.full(update_setup["new"], -np.log(3.0)), np.zeros(update_setup["new"])])
    own, _, _ = first_update(update_setup, settings, shift)
    assert float(own["tis_weight_mean"]) == pytest.approx(1.5, rel=1e-5)
    assert float(own["tis_capped_frac"]) == pytest.approx(0.5)
    assert float(own["policy_loss"]) == pytest.approx(-0.5, rel=1e-5)


def test_tis_without_the_recomputation_is_refused():
    config = grpo_config(tis_cap=2.0)
    with pytest.raises(ValueError, match="rl.tis_cap=2.0 must be >= 0 .* needs rl.recompute_old_logp=True"):
        T.validate(config)
    T.validate(grpo_config(tis_cap=2.0, recompute_old_logp=True))
    with pytest.raises(ValueError, match="rl.recompute_old_logp needs rl.num_minibatches=1"):
        T.validate(grpo_config(recompute_old_logp=True, num_minibatches=2))
    with pytest.raises(ValueError, match="rl.tis_cap"):
        T.validate(grpo_config(tis_cap=-1.0, recompute_old_logp=True))
