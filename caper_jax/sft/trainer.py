"""Supervised fine-tuning of the Qwen3.5 policy: (question, schema) -> gold SQL + END_OF_SQL.

Same shape as the Clause-PRM loop (``caper_jax.prm.trainer``): world -> sharded model and optimizer
state -> Grain pipeline -> resume -> jitted steps with donated state -> checkpoints -> evaluation ->
export. The loss is the mean negative log-likelihood of the SQL and stop tokens only (prompt tokens
are context); log-probs come from ``caper_jax.policy.logprobs.token_logprobs``, which never materialises the
``[B, T, V]`` logits (248k vocabulary at scale). A step whose loss or gradient is not finite is
refused inside the jitted function, as in ``caper_jax.prm.step``. At the end: greedy-decode EX on a
held-out slice through the sampler and the sandboxed Executor (``results.json``), an HF export.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from caper_jax import loop, runs
from caper_jax.data.data_world import prepare_world
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.parallel import multihost
from caper_jax.policy.build import build_policy
from caper_jax.policy.logprobs import lm_head, token_logprobs
from caper_jax.policy.prompts import stop_token_id
from caper_jax.policy.rollout import held_out_ex
from caper_jax.sections import OptimSettings, check_devices, check_world
from caper_jax.settings import from_config
from caper_jax.sft import data as data_lib
from caper_jax.sft.settings import SftSettings
from caper_jax.sql.execution import Executors
from caper_jax.utils import summary as summary_lib
from caper_jax.utils.optim import TrainState, guarded_update, make_optimizer

log = logging.getLogger("caper_jax")


# -- step


def sft_loss(params, batch: dict, *, graphdef, chunk_size: int) -> tuple[jax.Array, dict]:
    """Mean NLL of ``targets`` over ``loss_mask`` (SQL and stop tokens); prompt positions excluded."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"])
    head, tied = lm_head(model)
    logp = token_logprobs(hidden, head, batch["targets"], chunk_size, tied=tied)
    mask = batch["loss_mask"].astype(bool)
    tokens = jnp.maximum(mask.sum(), 1)
    nll = -jnp.where(mask, logp, 0.0).sum() / tokens
    return nll, {"tokens": mask.sum().astype(jnp.float32)}


def train_step(state: TrainState, batch: dict, *, graphdef, tx: optax.GradientTransformation,
               chunk_size: int) -> tuple[TrainState, dict]:
    (loss, aux), grads = jax.value_and_grad(functools.partial(sft_loss, graphdef=graphdef, chunk_size=chunk_size),
                                            has_aux=True)(state.params, batch)
    new_state, guard = guarded_update(state, loss, grads, tx)
    return new_state, {**guard, **aux}


def jit_train_step(graphdef, tx, chunk_size: int, state_sharding=None, optim: OptimSettings | None = None):
    """The jitted SFT step (state donated); cached per process when ``optim`` (the settings ``tx`` was
    made from) is given."""
    key = None if optim is None else ("sft", graphdef, optim, chunk_size)
    return loop.jit_state_step(functools.partial(train_step, graphdef=graphdef, tx=tx, chunk_size=chunk_size),
                               key, state_sharding)


# -- loop


def validate(config) -> SftSettings:
    """The config built into ``SftSettings`` (every value checked there), then what only this job can answer
    (``check_job``); before any data, model or compilation work."""
    settings = from_config(SftSettings, config)
    check_job(settings)
    return settings


def check_job(settings: SftSettings) -> None:
    """What the settings alone cannot say: the world's folder and tokenizer are named, the mesh fits the
    devices, the global batch splits over the processes."""
    check_world(settings.data, settings.model)
    check_devices(settings)
    if settings.data.batch_size < 1 or settings.data.batch_size % jax.process_count():
        raise ValueError(f"data.batch_size={settings.data.batch_size} must be a positive multiple of the "
                         f"process count {jax.process_count()}")


def run(settings: SftSettings, workdir: str) -> dict:
    run = loop.TrainingRun.start(settings, workdir)
    world = prepare_world(settings, run.workdir)
    tokenizer = world.tokenizer
    stop = stop_token_id(tokenizer)
    train_examples = data_lib.examples_from_split(world.dir, settings.data.train_split,
                                                  schema_values=settings.data.schema_values)

    mesh, rules = run.use_mesh()
    model = build_policy(settings.model, len(tokenizer), settings.seed, mesh, rules)
    tx = make_optimizer(settings.optim)
    graphdef, state, state_sharding = loop.create_state(model, tx, mesh, rules)
    run_record = runs.record(model.config, world.tokenizer_dir)   # saved with every checkpoint
    del model
    step_fn = jit_train_step(graphdef, tx, settings.chunk_size, state_sharding, optim=settings.optim)
    multihost.log_main("SFT policy: %s parameters on mesh %s",
                       f"{sum(x.size for x in jax.tree.leaves(state.params)):,}", dict(mesh.shape))

    pipeline = data_lib.sft_pipeline(
        train_examples, tokenizer, global_batch_size=settings.data.batch_size, max_len=settings.data.max_len,
        bucket_lengths=settings.data.bucket_lengths, seed=settings.seed, num_epochs=None,
        process_index=jax.process_index(), process_count=jax.process_count())
    data_iter = pipeline.iterator()
    multihost.log_main("SFT examples: %d (%d steps per epoch)", pipeline.num_examples, pipeline.steps_per_epoch)
    state = run.resume(state, data_iter, run_record=run_record)

    def step(state, _):
        return step_fn(state, multihost.host_local_to_global(next(data_iter), mesh, rules))

    def summarize(fetched, seconds):
        tokens_seen = sum(float(m["tokens"]) for m in fetched)
        return {**loop.train_means(fetched), "train/target_tokens_per_s": tokens_seen / max(seconds, 1e-9)}

    state = run.train(state, step, summarize=summarize, log_line=lambda s: f"  loss {s['train/loss']:.4f}")
    policy = nnx.merge(graphdef, state.params)
    rows = []
    results = {"steps": settings.optim.total_steps}
    if settings.eval.num_examples:  # 0: no end-of-run EX (the experiments evaluate separately)
        held_out = data_lib.examples_from_split(world.dir, settings.data.eval_split,
                                                schema_values=settings.data.schema_values)
        with jax.set_mesh(mesh), Executors(world.database_dir, timeout_s=settings.eval.timeout_s) as executors:
            ex_results, rows = held_out_ex(
                policy, tokenizer, held_out, executors, num_examples=settings.eval.num_examples, seed=settings.seed,
                split=settings.data.eval_split, max_prompt_len=settings.eval.max_prompt_len,
                max_new_tokens=settings.eval.max_new_tokens, stop_tokens=(stop,), batch_size=settings.eval.batch_size)
        results.update(ex_results)
    loop.finish_policy_run(run, results, rows, policy, tokenizer, curves=["train/loss", "train/grad_norm"],
                           png="loss_curve.png", title="SFT")
    summary_lib.policy_run("SFT", results, run.workdir, run.elapsed(), eval_split=settings.data.eval_split,
                           export=settings.export_hf)
    return results


def dry_run(settings: SftSettings) -> dict:
    """Lower + compile the SFT step on abstract shapes for the current devices; no weights."""
    b, length = settings.data.batch_size, settings.data.max_len
    return loop.dry_run(
        settings, Qwen35ForCausalLM, lambda graphdef, tx: jit_train_step(graphdef, tx, settings.chunk_size),
        lambda struct: {key: struct((b, length), jnp.int32) for key in data_lib.BATCH_KEYS},
        f"SFT train step: preset {settings.model.preset}, global batch {b} x {length} tokens, "
        f"remat {settings.model.remat}, params {settings.model.param_dtype}, compute {settings.model.dtype}")


def compile_programs(settings: SftSettings) -> dict[str, dict]:
    """Every device program an SFT step runs (the train step), on abstract shapes for the target's devices
    (``--compile_for``). The end-of-run greedy evaluation is the sampler's, as GRPO compiles it."""
    train = dry_run(settings)
    return {"train_step": {**train, "calls": 1, "resident_bytes": train["memory"]["peak_bytes"]}}
