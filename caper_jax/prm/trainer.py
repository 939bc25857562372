"""The Clause-PRM training loop: annotate -> train -> evaluate -> checkpoint -> export.

Reads top to bottom like big_vision's train.py. Everything heavy lives elsewhere: annotation in
``caper_jax.sql`` (streamed through Grain by ``caper_jax.data.annotation_source``), batches in
``caper_jax.data.prm_pipeline``, the jitted step in ``caper_jax.prm.step``, sharding in
``caper_jax.parallel``, checkpoints in ``caper_jax.checkpoint``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from caper_jax import checkpoint as ckpt_lib
from caper_jax.data import prm_pipeline as pipe_lib
from caper_jax.data.world import DataWorld, prepare_world
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.eval import prm_heldout as evaluation
from caper_jax.prm.export import export_prm_to_hf
from caper_jax.prm.loss import LmAuxConfig, PairLossConfig
from caper_jax.prm.model import ClausePRM
from caper_jax.prm import step as step_lib
from caper_jax.utils import optim as optim_lib
from caper_jax.sql.tuples import TUPLE_FORMAT, AnnotationSettings
from caper_jax.utils.errors import NonFiniteLossError
from caper_jax.utils.monitoring import MetricWriter, Progress, plot_curves, read_metrics

log = logging.getLogger("caper_jax")


def loss_config(config) -> PairLossConfig:
    return PairLossConfig(form=config.loss.form, margin_weight=config.loss.margin_weight,
                          alpha=config.annotate.alpha, offset_scale=config.loss.offset_scale,
                          center_coef=config.loss.center_coef)


def lm_config(config, tokenizer=None) -> LmAuxConfig:
    """The auxiliary SQL language-modelling term; the SQL follows the prompt's last <|im_start|>.

    Without a tokenizer (config validation, the dry run) the marker is token 0: same program, same cost.
    """
    marker = -1
    if config.loss.lm_coef:
        marker = 0 if tokenizer is None else tokenizer.convert_tokens_to_ids("<|im_start|>")
        if marker is None or (tokenizer is not None and marker == tokenizer.unk_token_id):
            raise ValueError("loss.lm_coef > 0 needs a tokenizer with the <|im_start|> token the prompt uses")
    return LmAuxConfig(coef=config.loss.lm_coef, marker_id=marker)


def annotation_settings(config) -> AnnotationSettings:
    a = config.annotate
    semantics = a.get("semantics", "spider")
    if semantics not in ("spider", "bird"):
        raise ValueError(f"annotate.semantics={semantics!r}; expected 'spider' or 'bird'")
    return AnnotationSettings(alpha=a.alpha, sigma=a.sigma, margin_floor=a.margin_floor,
                              per_query=a.per_query, compound=a.compound, site_balance=a.site_balance,
                              timeout_s=a.timeout_s, semantics=semantics,
                              within_trajectory=a.within_trajectory, seed=config.seed,
                              suspect_tuples=a.get("suspect_tuples", False))


def annotate_split(world: DataWorld, split: str, settings: AnnotationSettings, cache_dir: pathlib.Path
                   ) -> pathlib.Path:
    """Preference tuples of a split as JSONL, cached under a key of (data, split, settings).

    Annotation is deterministic (each trajectory seeds its own randomness), so every process of a
    multi-host job may build the same file; the atomic rename makes concurrent builds harmless.
    """
    from caper_jax.data.annotation_source import annotated_dataset, trajectory_dataset
    from caper_jax.data.tfds_caper import read_tables

    from caper_jax.data.spider import split_files

    # The split's files are part of the key: Spider's train reads train_others.json too since issue 15.
    files = [str(p.relative_to(world.dir)) for p in split_files(world.dir, split)]
    key = hashlib.sha256(json.dumps([str(world.dir), split, files, dataclasses.asdict(settings), TUPLE_FORMAT],
                                    sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / f"{split}-{key}.jsonl"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    trajectories = trajectory_dataset(world.dir, split)
    dataset = annotated_dataset(trajectories, world.database_dir, settings, tables=read_tables(world.dir))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    n = 0
    with tmp.open("w") as f:
        for record in dataset:
            f.write(json.dumps(record) + "\n")
            n += 1
    os.replace(tmp, path)
    multihost.log_main("annotated %s: %d trajectories -> %d tuples in %.1f s (%s)", split,
                       len(trajectories), n, time.perf_counter() - start, path)
    return path


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
    loss_config(config)            # form / margin_weight / alpha
    lm_config(config)              # lm_coef >= 0
    annotation_settings(config)    # alpha, sigma, floor, per_query, compound
    buckets = tuple(config.data.bucket_lengths)
    if list(buckets) != sorted(buckets) or buckets[-1] > config.data.max_len:
        raise ValueError(f"data.bucket_lengths={buckets} must be increasing and <= data.max_len")
    if config.data.batch_size < 1 or config.data.eval_batch_size < 1:
        # Caught here, not after minutes of annotation.
        raise ValueError(f"data.batch_size={config.data.batch_size} and data.eval_batch_size="
                         f"{config.data.eval_batch_size} must be >= 1")
    if config.data.within_batch_size < 0 or config.data.within_batch_size % jax.process_count():
        raise ValueError(f"data.within_batch_size={config.data.within_batch_size} must be >= 0 and a "
                         f"multiple of the process count {jax.process_count()}")
    if config.data.counterfactual_repeat < 1:
        raise ValueError(f"data.counterfactual_repeat={config.data.counterfactual_repeat} must be >= 1")
    if config.optim.total_steps < 1 or config.optim.lr <= 0:
        raise ValueError("optim.total_steps must be >= 1 and optim.lr > 0")
    for key in ("log_every", "eval_every", "ckpt_every"):
        if config[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {config[key]}")
    mesh_lib.resolve_mesh_shape(tuple(config.mesh_shape.values()), jax.device_count())
    rules_lib.rules_dict(config.sharding_rules)
    if config.model.get("init_from"):
        check_init_from(config)


class InitFromError(ValueError):
    """model.init_from does not name an SFT/GRPO run whose backbone fits this PRM."""


def check_init_from(config, vocab_size: int | None = None) -> None:
    """The run named by ``model.init_from`` exists and matches the PRM's architecture: one clear error
    before any data, annotation or training work (the parameters themselves are read in build_model)."""
    from caper_jax.eval import restore

    source = config.model.init_from
    if config.model.hf_dir:
        raise InitFromError(f"model.init_from={source!r} and model.hf_dir={config.model.hf_dir!r}: set one")
    try:
        step_dir = restore.latest_whole_step(restore.checkpoints_dir(source))
        stored = restore.stored_config(step_dir)
    except (restore.WorkdirError, FileNotFoundError) as error:
        raise InitFromError(f"model.init_from={source!r}: {error}") from error
    if stored.get("trainer") not in ("sft", "grpo"):
        raise InitFromError(f"model.init_from={source!r}: {step_dir} was written by the "
                            f"{stored.get('trainer')!r} trainer, not SFT/GRPO")
    model = stored.get("model", {})
    if model.get("hf_dir") or stored.get("policy", {}).get("hf_dir"):
        raise InitFromError(f"model.init_from={source!r} started from HF weights; set model.hf_dir to those instead")
    mismatched = {k: (model.get(k), config.model[k]) for k in ("preset", "param_dtype") if model.get(k) != config.model[k]}
    if mismatched:
        raise InitFromError(f"model.init_from={source!r}: the run's model differs from this PRM's "
                            f"(stored, here): {mismatched}")
    stored_vocab = restore.stored_param_shapes(step_dir).get("embed_tokens", (None,))[0]
    if vocab_size is not None and stored_vocab != vocab_size:
        raise InitFromError(f"model.init_from={source!r}: its embedding has {stored_vocab} rows but this PRM's "
                            f"tokenizer has {vocab_size} tokens (a different tokenizer)")


def build_model(config, vocab_size: int, mesh, rules) -> ClausePRM:
    """A ClausePRM created directly in its sharded layout: random init, HF weights, or (``model.init_from``)
    the backbone of an SFT/GRPO run — the policy as the stand-in for pretraining; the score head is new."""
    from caper_jax.models.presets import model_preset

    runtime = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype, remat=config.model.remat)
    if config.model.get("init_from"):
        from caper_jax.eval.policy import load_policy
        from caper_jax.prm.model import backbone_config

        check_init_from(config, vocab_size)
        # load_policy reads the newest whole checkpoint's params onto their shardings (eval/restore).
        backbone = load_policy(config.model.init_from, mesh, rules, dtype=config.model.dtype).model
        if not backbone.config.tie_word_embeddings:
            del backbone.lm_head   # the PRM reads no vocabulary logits (as load_prm_backbone)
        arch = backbone.config.replace(remat=config.model.remat)
        backbone.config = backbone_config(arch)
        return ClausePRM(arch, rngs=nnx.Rngs(config.seed), backbone=backbone)
    if config.model.hf_dir:
        from caper_jax.prm.export import load_prm_backbone

        return load_prm_backbone(config.model.hf_dir, mesh, rules, seed=config.seed, **runtime)
    model_config = model_preset(config.model.preset, vocab_size=vocab_size, **runtime)
    # mesh/rules reach the model's activation constraints; without them GSPMD replicated the
    # activations (measured: per-device temp of the 8-way step 3574 MiB vs 549 MiB with them).
    return rules_lib.create_sharded(
        lambda: ClausePRM(model_config, rngs=nnx.Rngs(config.seed), mesh=mesh, rules=rules), mesh, rules)


def run(config, workdir: str) -> dict:
    started = time.perf_counter()
    multihost.initialize()
    workdir = pathlib.Path(workdir)
    main = multihost.is_main_process()
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
    writer = MetricWriter(workdir, enabled=main)

    # Data: the world (demo or Spider layout), its tokenizer, and annotated tuples. Process 0
    # builds them; the others then reuse its files (shared workdir) or build their own (local disk).
    settings = annotation_settings(config)
    with multihost.main_process_first("prepare data"):
        world = prepare_world(config, workdir)
        train_path = annotate_split(world, config.data.train_split, settings, workdir / "tuples")
        if config.annotate.get("candidate_contrasts"):  # right vs wrong sample of a question (prm_pipeline)
            train_path = pipe_lib.with_candidate_contrasts(world.dir, world.database_dir, config.data.train_split,
                                                           settings, train_path)
        eval_path = annotate_split(world, config.data.eval_split, settings, workdir / "tuples")
    tokenizer = world.tokenizer

    # Model, optimizer and state, created sharded over the mesh.
    mesh = mesh_lib.make_mesh(config.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in config.sharding_rules)
    model = build_model(config, len(tokenizer), mesh, rules)
    graphdef, params = nnx.split(model)
    tx = optim_lib.make_optimizer(config.optim)
    state_sharding = rules_lib.logical_to_sharding(
        jax.eval_shape(lambda p: optim_lib.init_state(p, tx), params), mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: optim_lib.init_state(p, tx), out_shardings=state_sharding)(params)
    del params, model
    train_step, eval_scores, clause_scores = step_lib.jit_steps(graphdef, tx, loss_config(config), state_sharding,
                                                              lm_config(config, tokenizer))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    multihost.log_main("Clause-PRM: %s parameters on mesh %s", f"{n_params:,}", dict(mesh.shape))

    # Input pipeline: this host's rows of every global batch, repeated over epochs.
    pipeline = pipe_lib.prm_pipeline(
        pipe_lib.JsonlSource(train_path), tokenizer, global_batch_size=config.data.batch_size,
        max_len=config.data.max_len, bucket_lengths=config.data.bucket_lengths, seed=config.seed,
        num_epochs=None, process_index=jax.process_index(), process_count=jax.process_count(),
        within_batch_size=config.data.within_batch_size, counterfactual_repeat=config.data.counterfactual_repeat)
    data_iter = pipeline.iterator()
    multihost.log_main("training tuples: %d (%d within-trajectory groups; %d steps per epoch)",
                       pipeline.num_records, pipeline.num_groups, pipeline.steps_per_epoch)

    # Resume from the newest whole checkpoint, data position included.
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", max_to_keep=config.ckpt_keep,
                                         save_interval_steps=config.ckpt_every)
    restored = checkpointer.restore_latest(ckpt_lib.abstract_state(state), data_iterator=data_iter)
    if restored is not None:
        state = restored.state
        multihost.log_main("resumed from step %d", restored.step)
    first_step = int(state.step)

    total = config.optim.total_steps
    evaluator = evaluation.PrmEvaluator(world, tokenizer, eval_path, config, mesh, rules)
    progress = Progress(total, first_step)
    train_metrics = []
    with jax.set_mesh(mesh):
        for step in range(first_step + 1, total + 1):
            host_batch = next(data_iter)
            batch = multihost.host_local_to_global(
                {k: v for k, v in host_batch.items() if k != "record_index"}, mesh, rules)
            state, metrics = train_step(state, batch)
            train_metrics.append(metrics)
            if step % config.log_every == 0 or step == total:
                summary = {f"train/{k}": float(np.mean([jax.device_get(m[k]) for m in train_metrics]))
                           for k in train_metrics[0]}
                train_metrics = []
                summary["train/lr"] = float(optim_lib.learning_rate(config.optim)(step))
                line = progress.update(step)
                summary["train/steps_per_s"] = progress.steps_per_s
                writer.write(step, summary)
                multihost.log_main("%s  loss %.4f  acc %.3f", line, summary["train/loss"], summary["train/accuracy"])
            if int(state.nonfinite) > config.optim.max_consecutive_nonfinite:
                checkpointer.close()
                raise NonFiniteLossError(
                    f"step {step}: {int(state.nonfinite)} consecutive non-finite losses/gradients (limit "
                    f"{config.optim.max_consecutive_nonfinite}); the updates were refused and the last good "
                    f"checkpoint in {workdir / 'checkpoints'} is intact. Lower optim.lr or check the data.")
            if step % config.eval_every == 0 and step != total:
                writer.write(step, evaluator.pairwise(state.params, eval_scores))
            checkpointer.save(step, state, data_iterator=data_iter, config=config.to_dict(),
                              force=step == total)
        checkpointer.wait()

        results = evaluator.full(state.params, eval_scores, clause_scores)
    writer.write(total, {k: v for k, v in results["metrics"].items()})
    writer.close()
    checkpointer.close()
    if main:
        evaluation.write_report(results, workdir)
        plot_curves(read_metrics(workdir / "metrics.jsonl"),
                    ["train/loss", "train/accuracy", "eval/pair_accuracy", "eval/loss"],
                    workdir / "loss_curve.png", title="Clause-PRM training")
    if config.export_hf:
        export_prm_to_hf(nnx.merge(graphdef, state.params), workdir / "hf_export", tokenizer)
    from caper_jax.utils import summary as summary_lib

    summary_lib.prm_run(results, workdir, time.perf_counter() - started, export=config.export_hf)
    return results


def dry_run(config) -> dict:
    """Lower + compile the train step on abstract shapes for the current devices; no weights."""
    from caper_jax.models.presets import model_preset
    from caper_jax.parallel.dry_run import report

    mesh = mesh_lib.make_mesh(config.mesh_shape.to_dict())
    rules = tuple(tuple(r) for r in config.sharding_rules)
    runtime = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype, remat=config.model.remat)
    model_config = model_preset(config.model.preset, **runtime)
    tx = optim_lib.make_optimizer(config.optim)
    graphdef, abstract = rules_lib.abstract_train_state(
        lambda: ClausePRM(model_config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules),
        lambda p: optim_lib.init_state(p, tx), mesh, rules)
    b, length = config.data.batch_size, config.data.max_len
    batch_sharding = lambda nd: multihost.batch_sharding(mesh, nd, rules)
    ids = jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=batch_sharding(2))
    vec = lambda dt: jax.ShapeDtypeStruct((b,), dt, sharding=batch_sharding(1))
    batch = {"chosen_ids": ids, "chosen_mask": ids, "chosen_pos": vec(jnp.int32), "rejected_ids": ids,
             "rejected_mask": ids, "rejected_pos": vec(jnp.int32), "margin": vec(jnp.float32),
             "weight": vec(jnp.float32), "clause_id": vec(jnp.int32)}
    if config.data.within_batch_size:  # group rows, with the narrowest slot width the pipeline makes
        g, slots = config.data.within_batch_size, pipe_lib.GROUP_SLOT_MULTIPLE
        batch |= {"group_ids": jax.ShapeDtypeStruct((g, length), jnp.int32, sharding=batch_sharding(2)),
                  "group_mask": jax.ShapeDtypeStruct((g, length), jnp.int32, sharding=batch_sharding(2)),
                  "group_pos": jax.ShapeDtypeStruct((g, slots), jnp.int32, sharding=batch_sharding(2)),
                  "group_margin": jax.ShapeDtypeStruct((g, slots), jnp.float32, sharding=batch_sharding(2)),
                  "group_weight": jax.ShapeDtypeStruct((g,), jnp.float32, sharding=batch_sharding(1))}
    train_step, _, _ = step_lib.jit_steps(graphdef, tx, loss_config(config), lm_cfg=lm_config(config))
    print(f"Clause-PRM train step: preset {config.model.preset}, global batch {b} pairs x {length} tokens, "
          f"remat {config.model.remat}, params {config.model.param_dtype}, compute {config.model.dtype}")
    return report(train_step, (abstract, batch), mesh, params=abstract.params)
