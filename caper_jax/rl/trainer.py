"""GRPO training of the text-to-SQL policy with clause-level process rewards (CAPER stage 3).

One step, top to bottom:

  prompts (Grain, checkpointed) --x G--> sampler (jitted prefill + decode loop, temperature / top-p,
  stop at END_OF_SQL or eos) --> host: decode, split_clauses, clause token ends, sandboxed execution
  vs gold --> device: frozen Clause-PRM per-token scores in ONE forward over prompt + completion
  (skipped for ``sparse``), frozen reference log-probs (skipped when beta = 0) --> ``layout_rewards``
  (variant) --> ``clause_advantages`` --> ``update_epochs`` x minibatches of the jitted, state-donating
  ``grpo_loss`` update --> metrics, checkpoint (policy state + prompt-iterator position).

``reward.variant`` in {sparse, token, clause} only changes the layout: one code path for CAPER and both
baselines. Old log-probs are the sampler's (tempered, unfiltered: the quantity ``token_logprobs``
recomputes), so no extra forward is spent on them, unless ``rl.recompute_old_logp`` asks for the trainer's
own (the first update's forward; with ``rl.tis_cap`` the sampler's then weight the loss: docs/grpo.md).
The policy starts from an SFT run's orbax checkpoint (``policy.sft_workdir``), an HF directory
(``model.hf_dir``) or a random preset (tests, smoke runs); the reference is that same starting point,
rebuilt on resume. The PRM comes from a PRM run's orbax checkpoint (``prm.workdir``, ``prm.ckpt``). All
hosts run the same rollout on the full (small) prompt batch; device arrays are global, host-side scoring is
repeated per host (cheap, deterministic).
"""
from __future__ import annotations

import logging
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from caper_jax import loop, runs
from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.data.data_world import prepare_world
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.frozen import frozen_params
from caper_jax.models.sampler import SamplingConfig, generate, prefill_group_size
from caper_jax.parallel import multihost
from caper_jax.policy import rollout as rollout_lib
from caper_jax.policy.build import build_policy
from caper_jax.policy.prompts import check_prompt_widths, prompt_batch, stop_token_id
from caper_jax.prm.model import ClausePRM
from caper_jax.utils.optim import make_optimizer
from caper_jax.rl.settings import GrpoSettings
from caper_jax.rl.step import (advantages_from_rewards, jit_completion_logprobs, jit_update, logp_mismatch,
                               prm_token_scores, updates_per_step)
from caper_jax.sections import check_devices, check_world
from caper_jax.settings import from_config
from caper_jax.sft import data as data_lib
from caper_jax.sql.contract import policy_prompt
from caper_jax.sql.execution import Executors
from caper_jax.utils import summary as summary_lib

log = logging.getLogger("caper_jax")


# -- the starting policy and the frozen PRM (other runs, read by caper_jax.runs.load_run)


def load_policy(settings: GrpoSettings, vocab_size: int, mesh, rules):
    """The starting policy: an SFT run's (or converted HF model's) checkpoint, an HF directory or a
    random preset; in this run's dtypes and remat."""
    if settings.policy.sft_workdir:
        run = runs.load_run(settings.policy.sft_workdir, module=Qwen35ForCausalLM, mesh=mesh, rules=rules,
                            step=settings.policy.ckpt, trainers=runs.POLICY_TRAINERS, dtype=settings.model.dtype,
                            param_dtype=settings.model.param_dtype, remat=settings.model.remat)
        policy = run.model
        multihost.log_main("policy: %s step %d", settings.policy.sft_workdir, run.step)
    else:
        policy = build_policy(settings.model, vocab_size, settings.seed, mesh, rules)
        multihost.log_main("policy: %s", settings.model.hf_dir or f"random {settings.model.preset}")
    runs.check_vocab("policy", policy.config.vocab_size, vocab_size)
    return policy


def check_runs(settings: GrpoSettings) -> None:
    """The SFT run and the PRM run this GRPO run reads exist, are whole and are of the right trainer:
    one ``CheckpointError`` naming the settings key, before any work (``validate`` cannot: the
    reproduction validates its GRPO configs before their runs exist)."""
    if settings.policy.sft_workdir:
        try:
            runs.read_run(settings.policy.sft_workdir, step=settings.policy.ckpt, trainers=runs.POLICY_TRAINERS)
        except runs.CheckpointError as error:
            raise runs.CheckpointError(f"policy.sft_workdir={settings.policy.sft_workdir!r}: {error}") from error
    if settings.reward.uses_prm:
        try:
            runs.read_run(settings.prm.workdir, step=settings.prm.ckpt, trainers=("prm",))
        except runs.CheckpointError as error:
            raise runs.CheckpointError(f"prm.workdir={settings.prm.workdir!r}: {error}") from error


def load_prm(settings: GrpoSettings, vocab_size: int, mesh, rules):
    """The frozen Clause-PRM of a PRM run (``prm.workdir``), computing in this run's compute dtype:
    ``(graphdef, params)`` with its matmul weights held in that dtype (``frozen_params``: the same
    scores as the stored fp32 weights, half their memory)."""
    run = runs.load_run(settings.prm.workdir, module=ClausePRM, mesh=mesh, rules=rules, step=settings.prm.ckpt,
                        trainers=("prm",), dtype=settings.model.dtype)
    runs.check_vocab("PRM", run.model.config.vocab_size, vocab_size)
    multihost.log_main("Clause-PRM: %s step %d", settings.prm.workdir, run.step)
    graphdef, stored = nnx.split(run.model)
    del run
    return graphdef, frozen_params(stored, settings.model.dtype, reads_head=False, tied=True)


def reference_params(params, dtype: str, *, tied: bool):
    """The frozen reference policy: a copy of the starting ``params`` (the train state is donated) with
    its matmul weights in the compute ``dtype``; the LM head (or the tied embedding) as stored:
    ``token_logprobs`` reads it in fp32, so the reference's log-probs equal the starting policy's."""
    return frozen_params(params, dtype, reads_head=True, tied=tied)


def is_logging_step(settings: GrpoSettings, step: int) -> bool:
    """The steps whose metrics ``loop.TrainingRun.train`` logs (and the GRPO row reads): every ``log_every``-th and
    the last. Only their updates compute the policy's entropy."""
    return step % settings.log_every == 0 or step == settings.optim.total_steps


# -- data


def rl_examples(world, split: str, executors, schema_values: int) -> tuple[list, list]:
    """(examples, gold results) of a split, dropping examples whose gold SQL does not execute."""
    examples = data_lib.examples_from_split(world.dir, split, schema_values=schema_values)
    kept, golds = [], []
    for ex in examples:
        gold = executors.execute(ex.db_id, ex.sql)
        if gold.ok:
            kept.append(ex)
            golds.append(gold)
    if len(kept) < len(examples):
        multihost.log_main("%s: dropped %d examples whose gold SQL fails", split, len(examples) - len(kept))
    if not kept:
        raise ValueError(f"no usable {split} examples in {world.dir}")
    return kept, golds


def prompt_iterator(num_examples: int, prompts_per_step: int, seed: int) -> grain.DatasetIterator:
    """Example indices, reshuffled every epoch, ``prompts_per_step`` at a time (checkpointable)."""
    dataset = (grain.MapDataset.range(num_examples).shuffle(seed=seed).repeat(None)
               .batch(prompts_per_step, drop_remainder=True))
    return iter(dataset.to_iter_dataset())


def _minibatches(batch: dict, count: int):
    rows = next(iter(batch.values())).shape[0]
    size = rows // count
    for i in range(count):
        yield {k: v[i * size:(i + 1) * size] for k, v in batch.items()}


# -- loop


def validate(config) -> GrpoSettings:
    """The config built into ``GrpoSettings`` (every value checked there), then ``check_job``; before any
    data, model or compilation work. The runs it reads are checked when it starts (``check_runs``)."""
    settings = from_config(GrpoSettings, config)
    check_job(settings)
    return settings


def check_job(settings: GrpoSettings) -> None:
    """What the settings alone cannot say: the world's folder and tokenizer are named, the mesh fits the devices."""
    check_world(settings.data, settings.model)
    check_devices(settings)


def reward_config(settings: GrpoSettings) -> rollout_lib.RewardConfig:
    r = settings.reward
    return rollout_lib.RewardConfig(correct_reward=r.correct, wrong_reward=r.wrong, failure_reward=r.failure,
                                    semantics=r.semantics)


def run(settings: GrpoSettings, workdir: str) -> dict:

    check_runs(settings)   # before the workdir and the world are made
    run = loop.TrainingRun.start(settings, workdir)
    world = prepare_world(settings, run.workdir)
    tokenizer = world.tokenizer
    stop_tokens = tuple(sorted({stop_token_id(tokenizer)} |
                               ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())))
    pad_id = resolve_pad_id(tokenizer, None)
    executors = Executors(world.database_dir, timeout_s=settings.reward.timeout_s, max_rows=settings.reward.max_rows)
    examples, golds = rl_examples(world, settings.data.train_split, executors, settings.data.schema_values)
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]

    mesh, rules = run.use_mesh()
    vocab = len(tokenizer)
    policy = load_policy(settings, vocab, mesh, rules)
    tx = make_optimizer(settings.optim, updates_per_step(settings))   # the schedule counts steps, not updates
    graphdef, state, state_sharding = loop.create_state(policy, tx, mesh, rules)
    # The starting point, before any update, copied (the state is donated) in the compute dtype.
    ref_params = (reference_params(state.params, settings.model.dtype, tied=policy.config.tie_word_embeddings)
                  if settings.rl.beta > 0 else None)
    run_record = runs.record(policy.config, world.tokenizer_dir)   # saved with every checkpoint
    del policy
    uses_prm = settings.reward.uses_prm
    prm_graphdef, prm_params = load_prm(settings, vocab, mesh, rules) if uses_prm else (None, None)
    # Two variants of the update: with the policy's entropy (a metric) on logging steps, without on the others.
    update = {logging: jit_update(graphdef, tx, settings, state_sharding, with_entropy=logging)
              for logging in (True, False)}
    widths = check_prompt_widths(settings.sampling.prompt_widths, settings.sampling.max_prompt_len)
    sampling = SamplingConfig(settings.sampling.max_new_tokens, settings.sampling.temperature, settings.sampling.top_k,
                              settings.sampling.top_p, stop_tokens=stop_tokens, pad_id=pad_id)
    reward_cfg = reward_config(settings)
    group = settings.rl.group_size
    multihost.log_main("GRPO (%s): %s policy parameters, %d prompts x G=%d per step, %d training prompts",
                       settings.reward.variant, f"{sum(x.size for x in jax.tree.leaves(state.params)):,}",
                       settings.rl.prompts_per_step, group, len(examples))

    data_iter = prompt_iterator(len(examples), settings.rl.prompts_per_step, settings.seed)
    state = run.resume(state, data_iter, run_record=run_record)
    base_key = jax.random.key(settings.seed)

    def step(state, step):
        t_start = time.perf_counter()
        distinct = np.asarray(next(data_iter))
        prompt_ids, prompt_mask = prompt_batch([prompts[i] for i in distinct], tokenizer,
                                               settings.sampling.max_prompt_len,
                                               pad_id=pad_id, widths=widths)
        # Each prompt is prefilled once and its cache repeated to its G rows (the sampler's group_size):
        # the same samples as prefilling it G times, for 1/G of the prefill's FLOPs; repeated beforehand as
        # far as the prefilled rows must cover the mesh's batch shards (prefill_group_size).
        shared = prefill_group_size(len(distinct), group, multihost.batch_multiple(mesh, rules))
        output = generate(nnx.merge(graphdef, state.params), jnp.asarray(np.repeat(prompt_ids, group // shared, axis=0)),
                          jnp.asarray(np.repeat(prompt_mask, group // shared, axis=0)),
                          jax.random.fold_in(base_key, step), sampling, group_size=shared)
        jax.block_until_ready(output)
        t_sampled = time.perf_counter()
        indices = np.repeat(distinct, group)  # consecutive rows = one group
        prompt_ids, prompt_mask = np.repeat(prompt_ids, group, axis=0), np.repeat(prompt_mask, group, axis=0)
        rollout = rollout_lib.assemble_rollout(
            prompt_ids, prompt_mask, output, tokenizer, executors, [examples[i].db_id for i in indices],
            [examples[i].sql for i in indices], [golds[i] for i in indices], stop_tokens, reward_cfg)
        t_scored = time.perf_counter()

        batch, _ = multihost.replicated_batch(
            {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
             "completion_mask": rollout.completion_mask, "old_logp": rollout.old_logp,
             "clause_ends": rollout.clause_ends, "exec_rewards": rollout.exec_rewards,
             "parse_ok": rollout.parse_ok}, mesh, rules)
        n_new = rollout.completion_mask.shape[1]
        if uses_prm:
            prm_scores = prm_token_scores(prm_params, batch["input_ids"], batch["attention_mask"],
                                          graphdef=prm_graphdef, last=n_new)
        else:
            prm_scores = jnp.zeros(batch["completion_mask"].shape, jnp.float32)
        jax.block_until_ready(prm_scores)   # so the PRM's time is its own, not the update's
        t_prm = time.perf_counter()
        advantages, unit_stats = advantages_from_rewards(
            prm_scores, batch["clause_ends"], batch["exec_rewards"], batch["completion_mask"], batch["parse_ok"],
            variant=settings.reward.variant, group_size=group, gamma=float(settings.rl.gamma),
            prm_weight=float(settings.reward.prm_weight), exec_failure_reward=float(settings.reward.failure),
            format_penalty=float(settings.reward.format_penalty), scale_by_std=settings.rl.scale_by_std,
            std_ddof=settings.rl.std_ddof, std_eps=float(settings.rl.std_eps), std_scope=settings.rl.std_scope)
        train_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask", "old_logp")}
        train_batch["advantages"] = advantages
        recompute, mismatch = settings.rl.recompute_old_logp, {}
        if recompute:
            # The first update takes its own log-probs as the old ones (ratio 1, not exp(trainer - sampler),
            # a numeric difference) and returns them: the old log-probs of the later updates (docs/grpo.md).
            train_batch["old_from_self"] = jnp.ones_like(batch["parse_ok"], dtype=bool)   # [B], laid out as the batch
            if settings.rl.tis_cap:
                train_batch["sampler_logp"] = batch["old_logp"]
        if ref_params is not None:
            train_batch["ref_logp"] = jit_completion_logprobs(
                ref_params, batch["input_ids"], batch["attention_mask"], graphdef=graphdef, completion_len=n_new,
                temperature=float(settings.sampling.temperature), chunk_size=settings.chunk_size)
        jax.block_until_ready(train_batch)   # so the reference's time is its own, not the update's
        t_prepared = time.perf_counter()

        updates = []
        update_fn = update[is_logging_step(settings, step)]
        for _ in range(settings.rl.update_epochs):
            for minibatch in _minibatches(train_batch, settings.rl.num_minibatches):
                state, m = update_fn(state, minibatch)
                if recompute:   # one minibatch (GrpoRl): the first update saw the whole rollout
                    m = dict(m)
                    own = m.pop("logp")
                    if not mismatch:
                        mismatch = logp_mismatch(own, batch["old_logp"], batch["completion_mask"])
                        train_batch.update(old_logp=own, old_from_self=jnp.zeros_like(train_batch["old_from_self"]))
                updates.append(m)
        state = state.replace(step=state.step + 1)
        jax.block_until_ready(state)
        t_end = time.perf_counter()

        rollout_s, update_s = t_sampled - t_start, t_end - t_prepared
        generated = float(rollout.completion_mask.sum())
        updated_tokens = float(rollout.attention_mask.sum()) * settings.rl.update_epochs
        return state, {"updates": updates, "unit_stats": unit_stats, "rollout": {
            "rollout/reward_mean": float(rollout.exec_rewards.mean()),
            "rollout/ex": float(rollout.correct.mean()),
            "rollout/parse_rate": float(rollout.parse_ok.mean()),
            "rollout/exec_rate": float(rollout.executed.mean()),
            "rollout/completion_len": generated / len(rollout.texts),
            "perf/rollout_s": rollout_s,
            "perf/rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
            "perf/score_s": t_scored - t_sampled,
            "perf/prm_s": t_prm - t_scored,
            "perf/reference_s": t_prepared - t_prm,
            **{f"rollout/{k}": float(v) for k, v in mismatch.items()},
            "perf/update_s": update_s,
            "perf/update_tokens_per_s": updated_tokens / max(update_s, 1e-9),
            "perf/step_s": t_end - t_start}}

    def summarize(fetched, _):
        # The row describes the last step alone: its rollout and the updates made from it.
        last = fetched[-1]
        return {**loop.train_means(last["updates"]),
                **{f"rollout/{k}": float(v) for k, v in last["unit_stats"].items()}, **last["rollout"]}

    def log_line(s):
        return (f"  exec reward {s['rollout/reward_mean']:.3f}  EX {s['rollout/ex']:.3f}"
                f"  parse {s['rollout/parse_rate']:.2f}"
                f"  kl {s.get('train/kl_ref', 0.0):.4f}  clip {s['train/clip_frac_low'] + s['train/clip_frac_high']:.3f}"
                f"  |A| {s['rollout/abs_advantage']:.3f}")

    state = run.train(state, step, summarize=summarize, log_line=log_line, steps_per_s_key="perf/steps_per_s")
    policy = nnx.merge(graphdef, state.params)
    rows = []
    results = {"variant": settings.reward.variant, "steps": settings.optim.total_steps}
    if settings.eval.num_examples:  # 0: no end-of-run EX (the experiments evaluate separately)
        held_out = data_lib.examples_from_split(world.dir, settings.data.eval_split,
                                                schema_values=settings.data.schema_values)
        with jax.set_mesh(mesh):
            ex_results, rows = rollout_lib.held_out_ex(
                policy, tokenizer, held_out, executors, num_examples=settings.eval.num_examples, seed=settings.seed,
                split=settings.data.eval_split, max_prompt_len=settings.sampling.max_prompt_len,
                max_new_tokens=settings.sampling.max_new_tokens, stop_tokens=stop_tokens,
                batch_size=settings.eval.batch_size, semantics=settings.reward.semantics)
        results.update(ex_results)
    executors.close()
    loop.finish_policy_run(run, results, rows, policy, tokenizer,
                           curves=["rollout/reward_mean", "rollout/ex", "train/kl_ref", "train/entropy"],
                           png="grpo_curves.png", title=f"GRPO ({settings.reward.variant})")
    summary_lib.policy_run(f"GRPO ({settings.reward.variant})", results, run.workdir, run.elapsed(),
                           eval_split=settings.data.eval_split, png="grpo_curves.png", export=settings.export_hf)
    return results


def dry_run(settings: GrpoSettings) -> dict:
    """Lower + compile the GRPO update on abstract shapes for the current devices; no weights."""
    rows = settings.rl.prompts_per_step * settings.rl.group_size // settings.rl.num_minibatches
    full, new = settings.sampling.max_prompt_len + settings.sampling.max_new_tokens, settings.sampling.max_new_tokens

    def batch(struct):
        batch = {"input_ids": struct((rows, full), jnp.int32), "attention_mask": struct((rows, full), jnp.int32),
                 "completion_mask": struct((rows, new), jnp.int32), "old_logp": struct((rows, new), jnp.float32),
                 "advantages": struct((rows, new), jnp.float32)}
        if settings.rl.beta > 0:
            batch["ref_logp"] = struct((rows, new), jnp.float32)
        if settings.rl.recompute_old_logp:
            batch["old_from_self"] = struct((rows,), jnp.bool_)
        if settings.rl.tis_cap:
            batch["sampler_logp"] = struct((rows, new), jnp.float32)
        return batch

    widths = check_prompt_widths(settings.sampling.prompt_widths, settings.sampling.max_prompt_len)
    kinds = ["prefill", "decode"] + (["PRM"] if settings.reward.uses_prm else []) + \
        (["reference"] if settings.rl.beta > 0 else []) + ["update"]
    updates = 2 if settings.log_every > 1 and settings.optim.total_steps > 1 else 1   # with / without the entropy
    print(f"prompt widths {list(widths)}: a run compiles at most {len(widths) * (len(kinds) - 1 + updates)} step "
          f"programs ({', '.join(kinds)}{' x 2' if updates == 2 else ''}, one per width); compiled here: the "
          f"update at the widest ({settings.sampling.max_prompt_len}). Programs of a run on real prompts: "
          f"bench/dry_run_grpo.py --count_programs")
    return loop.dry_run(
        settings, Qwen35ForCausalLM, lambda graphdef, tx: jit_update(graphdef, tx, settings), batch,
        f"GRPO update: preset {settings.model.preset}, minibatch {rows} x ({settings.sampling.max_prompt_len} + "
        f"{new}) tokens, beta {settings.rl.beta}, remat {settings.model.remat}")


def compile_programs(settings: GrpoSettings) -> dict[str, dict]:
    """Every device program a GRPO step runs (prefill, decode, Clause-PRM, reference, update: ``rl.dry_run``) at
    each prompt width of ``sampling.prompt_widths``, on abstract shapes for the target's devices
    (``--compile_for``); named ``program@width``. The update is the logging steps' (with the entropy)."""
    from caper_jax.rl import dry_run as plan_lib   # it imports this module

    mesh, _ = loop.mesh_and_rules(settings)
    programs = {}
    for width in check_prompt_widths(settings.sampling.prompt_widths, settings.sampling.max_prompt_len):
        planned = plan_lib.plan(settings, mesh, prompt_width=width)
        for name, figures in planned["programs"].items():
            programs[f"{name}@{width}"] = {
                "memory": figures.memory, "matmul_flops": figures.matmul_flops, "calls": figures.calls,
                "resident_bytes": figures.resident_bytes, "collective_bytes": figures.collective_bytes,
                "compile_s": figures.compile_s, "while_trips": figures.trips, "params": planned["params"],
                "largest_buffers": figures.largest_buffers}
    return programs
