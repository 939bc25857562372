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
import json
import logging
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from caper_jax import checkpoint as ckpt_lib
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.policy.build import build_policy
from caper_jax.policy.logprobs import lm_head, token_logprobs
from caper_jax.utils.optim import TrainState, guarded_update, init_state, learning_rate, make_optimizer
from caper_jax.sft import data as data_lib
from caper_jax.utils.errors import NonFiniteLossError
from caper_jax.utils.monitoring import MetricWriter, Progress, plot_curves, read_metrics

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


_PROGRAMS: dict[tuple, Callable] = {}


def frozen(cfg) -> tuple:
    """A hashable snapshot of a (nested) ConfigDict."""
    return tuple(sorted((k, frozen(v) if hasattr(v, "items") else v) for k, v in cfg.items()))


def cached_program(key: tuple, build: Callable[[], Callable]) -> Callable:
    """One jitted program per ``key`` and process. ``key`` must hold everything the program depends on
    (graphdef, hyperparameters, shardings); a resumed or repeated run in the same process then reuses
    the compiled program instead of tracing and compiling a fresh ``jax.jit`` of a new partial."""
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build()
    return _PROGRAMS[key]


def jit_train_step(graphdef, tx, chunk_size: int, state_sharding=None, optim=None):
    """The jitted SFT step (state donated); cached per process when ``optim`` (the ConfigDict ``tx`` was
    made from) is given."""
    def build():
        return jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx, chunk_size=chunk_size),
                       donate_argnums=0, out_shardings=None if state_sharding is None else (state_sharding, None))
    if optim is None:
        return build()
    shardings = None if state_sharding is None else tuple(jax.tree.leaves(state_sharding))
    return cached_program(("sft", graphdef, frozen(optim), chunk_size, shardings), build)


# -- loop


def validate(config) -> None:
    """Every config value checked before any data, model or compilation work starts."""
    from caper_jax.models.presets import PRESETS

    if config.data.kind not in ("demo", "spider"):
        raise ValueError(f"data.kind={config.data.kind!r}; expected 'demo' or 'spider'")
    if config.model.preset not in PRESETS and not config.model.hf_dir:
        raise ValueError(f"model.preset={config.model.preset!r}; expected one of {PRESETS} or model.hf_dir")
    from caper_jax.models.config import REMAT_POLICIES

    if config.model.remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat={config.model.remat!r}; expected one of {REMAT_POLICIES}")
    buckets = tuple(config.data.bucket_lengths)
    if list(buckets) != sorted(set(buckets)) or buckets[-1] > config.data.max_len:
        raise ValueError(f"data.bucket_lengths={buckets} must be increasing and <= data.max_len")
    if config.data.batch_size < 1 or config.data.batch_size % jax.process_count():
        raise ValueError(f"data.batch_size={config.data.batch_size} must be a positive multiple of the "
                         f"process count {jax.process_count()}")
    if config.optim.total_steps < 1 or config.optim.lr <= 0:
        raise ValueError("optim.total_steps must be >= 1 and optim.lr > 0")
    for key in ("log_every", "ckpt_every", "chunk_size"):
        if config[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {config[key]}")
    if config.eval.num_examples < 0 or config.eval.batch_size < 1 or config.eval.max_new_tokens < 1:
        raise ValueError("eval.num_examples must be >= 0, eval.batch_size and eval.max_new_tokens >= 1")
    mesh_lib.resolve_mesh_shape(tuple(config.mesh_shape.values()), jax.device_count())
    rules_lib.rules_dict(config.sharding_rules)


def create_state(model, tx, mesh, rules) -> tuple[Any, TrainState, Any]:
    """(graphdef, sharded TrainState, its shardings) for a built model."""
    graphdef, params = nnx.split(model)
    shardings = rules_lib.logical_to_sharding(jax.eval_shape(lambda p: init_state(p, tx), params), mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings)(params)
    return graphdef, state, shardings


def _holdout(config, world) -> list[data_lib.SftExample]:
    examples = data_lib.examples_from_split(world.dir, config.data.eval_split,
                                            schema_values=config.data.schema_values)
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(examples))[: config.eval.num_examples]
    return [examples[i] for i in sorted(order)]


def run(config, workdir: str) -> dict:
    started = time.perf_counter()
    from caper_jax.data.world import prepare_world
    from caper_jax.policy.rollout import greedy_ex
    from caper_jax.sql.execution import Executors

    multihost.initialize()
    workdir = pathlib.Path(workdir)
    main = multihost.is_main_process()
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
    writer = MetricWriter(workdir, enabled=main)

    world = prepare_world(config, workdir)
    tokenizer = world.tokenizer
    stop = data_lib.stop_token_id(tokenizer)
    train_examples = data_lib.examples_from_split(world.dir, config.data.train_split,
                                                  schema_values=config.data.schema_values)

    mesh = mesh_lib.make_mesh(config.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in config.sharding_rules)
    model = build_policy(config.model, len(tokenizer), config.seed, mesh, rules)
    tx = make_optimizer(config.optim)
    graphdef, state, state_sharding = create_state(model, tx, mesh, rules)
    del model
    step_fn = jit_train_step(graphdef, tx, config.chunk_size, state_sharding, optim=config.optim)
    multihost.log_main("SFT policy: %s parameters on mesh %s",
                       f"{sum(x.size for x in jax.tree.leaves(state.params)):,}", dict(mesh.shape))

    pipeline = data_lib.sft_pipeline(
        train_examples, tokenizer, global_batch_size=config.data.batch_size, max_len=config.data.max_len,
        bucket_lengths=config.data.bucket_lengths, seed=config.seed, num_epochs=None,
        process_index=jax.process_index(), process_count=jax.process_count())
    data_iter = pipeline.iterator()
    multihost.log_main("SFT examples: %d (%d steps per epoch)", pipeline.num_examples, pipeline.steps_per_epoch)

    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", max_to_keep=config.ckpt_keep,
                                         save_interval_steps=config.ckpt_every)
    restored = checkpointer.restore_latest(ckpt_lib.abstract_state(state), data_iterator=data_iter)
    if restored is not None:
        state = restored.state
        multihost.log_main("resumed from step %d", restored.step)
    first_step = int(state.step)

    total = config.optim.total_steps
    progress = Progress(total, first_step)
    pending, t0 = [], time.perf_counter()
    with jax.set_mesh(mesh):
        for step in range(first_step + 1, total + 1):
            batch = multihost.host_local_to_global(next(data_iter), mesh, rules)
            state, metrics = step_fn(state, batch)
            pending.append(metrics)
            if step % config.log_every == 0 or step == total:
                fetched = jax.device_get(pending)
                pending = []
                summary = {f"train/{k}": float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
                tokens_seen = sum(float(m["tokens"]) for m in fetched)
                elapsed, t0 = time.perf_counter() - t0, time.perf_counter()
                summary["train/target_tokens_per_s"] = tokens_seen / max(elapsed, 1e-9)
                summary["train/lr"] = float(learning_rate(config.optim)(step))
                line = progress.update(step)
                summary["train/steps_per_s"] = progress.steps_per_s
                writer.write(step, summary)
                multihost.log_main("%s  loss %.4f", line, summary["train/loss"])
            if int(state.nonfinite) > config.optim.max_consecutive_nonfinite:
                checkpointer.close()
                raise NonFiniteLossError(
                    f"step {step}: {int(state.nonfinite)} consecutive non-finite losses/gradients (limit "
                    f"{config.optim.max_consecutive_nonfinite}); the updates were refused and the last good "
                    f"checkpoint in {workdir / 'checkpoints'} is intact. Lower optim.lr or check the data.")
            checkpointer.save(step, state, data_iterator=data_iter, config=config.to_dict(), force=step == total)
        checkpointer.wait()

        policy = nnx.merge(graphdef, state.params)
        rows = []
        results = {"steps": total}
        if config.eval.num_examples:  # 0: no end-of-run EX (caper_jax.reproduce evaluates separately)
            with Executors(world.database_dir, timeout_s=config.eval.timeout_s) as executors:
                summary, rows = greedy_ex(
                    policy, tokenizer, _holdout(config, world), executors, max_prompt_len=config.eval.max_prompt_len,
                    max_new_tokens=config.eval.max_new_tokens, stop_tokens=(stop,), batch_size=config.eval.batch_size)
            results.update({"eval/greedy_ex": summary["ex"], "eval/executable": summary["executable"],
                            "eval/n": summary["n"], "eval/excluded": summary["excluded"]})
            multihost.log_main("greedy EX on %d held-out %s examples: %.3f (executable %.3f)", summary["n"],
                               config.data.eval_split, summary["ex"], summary["executable"])
    checkpointer.close()
    finish_policy_run(workdir, writer, total, results, rows, policy, tokenizer, export_hf=config.export_hf,
                      curves=["train/loss", "train/grad_norm"], png="loss_curve.png", title="SFT")
    from caper_jax.utils import summary as summary_lib

    summary_lib.policy_run("SFT", results, workdir, time.perf_counter() - started, eval_split=config.data.eval_split,
                           export=config.export_hf)
    return results


def finish_policy_run(workdir: pathlib.Path, writer: MetricWriter, step: int, results: dict, rows: list[dict],
                      policy: Qwen35ForCausalLM, tokenizer, *, export_hf: bool, curves: list[str], png: str,
                      title: str) -> None:
    """The end of an SFT or GRPO run: eval metrics, results.json, predictions, curves, HF export."""
    main = multihost.is_main_process()
    if "eval/n" in results:
        writer.write(step, {k: v for k, v in results.items() if k.startswith("eval/")})
    writer.close()
    if main:
        (workdir / "results.json").write_text(json.dumps(results, indent=1))
        with (workdir / "predictions_eval.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        plot_curves(read_metrics(workdir / "metrics.jsonl"), curves, workdir / png, title=title)
    if export_hf:
        from caper_jax.models import to_hf

        out = to_hf(policy, policy.config, workdir / "hf_export")
        if main:
            tokenizer.save_pretrained(str(out))


def dry_run(config) -> dict:
    """Lower + compile the SFT step on abstract shapes for the current devices; no weights."""
    from caper_jax.models.presets import model_preset
    from caper_jax.parallel.dry_run import report

    mesh = mesh_lib.make_mesh(config.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in config.sharding_rules)
    runtime = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype, remat=config.model.remat)
    model_config = model_preset(config.model.preset, **runtime)
    tx = make_optimizer(config.optim)
    graphdef, abstract = rules_lib.abstract_train_state(
        lambda: Qwen35ForCausalLM(model_config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules),
        lambda p: init_state(p, tx), mesh, rules)
    b, length = config.data.batch_size, config.data.max_len
    ids = jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=multihost.batch_sharding(mesh, 2, rules))
    batch = {key: ids for key in data_lib.BATCH_KEYS}
    print(f"SFT train step: preset {config.model.preset}, global batch {b} x {length} tokens, "
          f"remat {config.model.remat}, params {config.model.param_dtype}, compute {config.model.dtype}")
    return report(jit_train_step(graphdef, tx, config.chunk_size), (abstract, batch), mesh,
                  params=abstract.params)
