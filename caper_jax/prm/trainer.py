"""The Clause-PRM training loop: annotate -> train -> evaluate -> checkpoint -> export.

Reads top to bottom like big_vision's train.py. Everything heavy lives elsewhere: annotation in
``caper_jax.sql`` (streamed through Grain by ``caper_jax.data.annotation_source``), batches in
``caper_jax.data.prm_training_batches``, the jitted step in ``caper_jax.prm.step``, sharding in
``caper_jax.parallel``, checkpoints in ``caper_jax.checkpoint``, the loop around the step (logging,
periodic evaluation, resume, checkpoint saves) in ``caper_jax.loop``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

from caper_jax import loop, runs
from caper_jax.data.candidate_contrasts import with_candidate_contrasts
from caper_jax.data.prm_records import JsonlSource
from caper_jax.data.prm_training_batches import GROUP_SLOT_MULTIPLE, prm_pipeline
from caper_jax.data.data_world import DataWorld, prepare_world
from caper_jax.data.spider import split_files
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.presets import model_preset
from caper_jax.parallel import dry_run as dry_run_lib
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.prm import heldout
from caper_jax.prm.export import export_prm_to_hf, load_prm_backbone
from caper_jax.prm.loss import LmAuxConfig
from caper_jax.prm.model import ClausePRM, backbone_config
from caper_jax.prm import step as step_lib
from caper_jax.prm.settings import PrmSettings
from caper_jax.sections import check_devices, check_world
from caper_jax.settings import from_config
from caper_jax.utils import optim as optim_lib
from caper_jax.utils import summary as summary_lib
from caper_jax.sql.tuples import TUPLE_FORMAT, AnnotationSettings
from caper_jax.utils.errors import CheckpointError

log = logging.getLogger("caper_jax")


def lm_config(settings: PrmSettings, tokenizer=None) -> LmAuxConfig:
    """The auxiliary SQL language-modelling term; the SQL follows the prompt's last <|im_start|>.

    Without a tokenizer (the dry run) the marker is token 0: same program, same cost.
    """
    marker = -1
    if settings.loss.lm_coef:
        marker = 0 if tokenizer is None else tokenizer.convert_tokens_to_ids("<|im_start|>")
        if marker is None or (tokenizer is not None and marker == tokenizer.unk_token_id):
            raise ValueError("loss.lm_coef > 0 needs a tokenizer with the <|im_start|> token the prompt uses")
    return LmAuxConfig(coef=settings.loss.lm_coef, marker_id=marker)


def annotate_split(world: DataWorld, split: str, settings: AnnotationSettings, cache_dir: pathlib.Path
                   ) -> pathlib.Path:
    """Preference tuples of a split as JSONL, cached under a key of (data, split, settings).

    Annotation is deterministic (each trajectory seeds its own randomness), so every process of a
    multi-host job may build the same file; the atomic rename makes concurrent builds harmless.
    """
    from caper_jax.data.annotation_source import annotated_dataset, trajectory_dataset  # Grain, TFDS: a run
    from caper_jax.data.tfds_caper import read_tables  # that annotates its own tuples loads them

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


# Clause positions per query in the compiled scoring program: the scoring batches' narrowest width
# (caper_jax.data.prm_scoring_batches rounds K up to a multiple of 8), which holds every query of <= 8 clauses.
CLAUSE_SLOTS = 8


def validate(config) -> PrmSettings:
    """The config built into ``PrmSettings`` (every value checked there), then ``check_job``; before any data,
    annotation or model work."""
    settings = from_config(PrmSettings, config)
    check_job(settings)
    return settings


def check_job(settings: PrmSettings) -> None:
    """What the settings alone cannot say: the world's folder and tokenizer are named, the mesh fits the
    devices, the within-trajectory groups split over the processes, the ``model.init_from`` run fits."""
    check_world(settings.data, settings.model)
    check_devices(settings)
    if settings.data.within_batch_size % jax.process_count():
        raise ValueError(f"data.within_batch_size={settings.data.within_batch_size} must be >= 0 and a "
                         f"multiple of the process count {jax.process_count()}")
    if settings.model.init_from:
        check_init_from(settings)


def check_init_from(settings: PrmSettings, run: runs.RunInfo | None = None, vocab_size: int | None = None) -> None:
    """The run named by ``model.init_from`` exists and fits this PRM: one clear ``CheckpointError``.

    ``validate`` calls it before any data, annotation or training work, and it reads the run's
    description here; ``build_model`` passes the ``run`` it loaded and the tokenizer's length ``vocab_size``.
    """
    source = settings.model.init_from
    if settings.model.hf_dir:
        raise CheckpointError(f"model.init_from={source!r} and model.hf_dir={settings.model.hf_dir!r}: set one")
    if run is None:
        try:
            run = runs.read_run(source, trainers=runs.POLICY_TRAINERS)
        except CheckpointError as error:
            raise CheckpointError(f"model.init_from={source!r}: {error}") from error
    # The run's architecture is its record, which build_model builds whatever the presets say (a GRPO
    # run's config keeps an unused default preset when its SFT run came from HF weights).
    expected = {"param_dtype": run.model_config.param_dtype}
    mismatched = {k: (v, getattr(settings.model, k)) for k, v in expected.items() if v != getattr(settings.model, k)}
    if mismatched:
        raise CheckpointError(f"model.init_from={source!r}: the run's model differs from this PRM's "
                              f"(stored, here): {mismatched}")
    if vocab_size is not None:
        runs.check_vocab(f"model.init_from={source!r}", run.model_config.vocab_size, vocab_size)


def build_model(settings: PrmSettings, vocab_size: int, mesh, rules) -> ClausePRM:
    """A ClausePRM created directly in its sharded layout: random init, HF weights, or (``model.init_from``)
    the backbone of an SFT/GRPO run — the policy as the stand-in for pretraining; the score head is new."""
    runtime = dict(dtype=settings.model.dtype, param_dtype=settings.model.param_dtype, remat=settings.model.remat)
    if settings.model.init_from:
        # The newest whole checkpoint's params, read onto their shardings.
        try:
            run = runs.load_run(settings.model.init_from, module=Qwen35ForCausalLM, mesh=mesh, rules=rules,
                                trainers=runs.POLICY_TRAINERS, dtype=settings.model.dtype)
        except CheckpointError as error:
            raise CheckpointError(f"model.init_from={settings.model.init_from!r}: {error}") from error
        check_init_from(settings, run, vocab_size)
        backbone = run.model
        if not backbone.config.tie_word_embeddings:
            del backbone.lm_head   # the PRM reads no vocabulary logits (as load_prm_backbone)
        arch = backbone.config.replace(remat=settings.model.remat)
        backbone.config = backbone_config(arch)
        return ClausePRM(arch, rngs=nnx.Rngs(settings.seed), backbone=backbone)
    if settings.model.hf_dir:
        return load_prm_backbone(settings.model.hf_dir, mesh, rules, seed=settings.seed, **runtime)
    model_config = model_preset(settings.model.preset, vocab_size=vocab_size, **runtime)
    # mesh/rules reach the model's activation constraints; without them GSPMD replicated the
    # activations (measured: per-device temp of the 8-way step 3574 MiB vs 549 MiB with them).
    return rules_lib.create_sharded(
        lambda: ClausePRM(model_config, rngs=nnx.Rngs(settings.seed), mesh=mesh, rules=rules), mesh, rules)


def write_outputs(settings: PrmSettings, workdir: pathlib.Path, results: dict, model: ClausePRM, tokenizer, *,
                  main: bool) -> None:
    """The HF export (``export_hf``, every process), then the report (process 0). The report's
    results.json comes last: it marks the run done (``caper_jax.experiments.stages.completion``), so a run stopped
    during the export is not taken for a finished one."""
    if settings.export_hf:
        export_prm_to_hf(model, workdir / "hf_export", tokenizer, dtype=settings.export_dtype)
    if main:
        heldout.write_report(results, workdir)


def run(settings: PrmSettings, workdir: str) -> dict:
    run = loop.TrainingRun.start(settings, workdir)
    workdir = run.workdir

    # Data: the world (demo or Spider layout), its tokenizer, and annotated tuples. Process 0
    # builds them; the others then reuse its files (shared workdir) or build their own (local disk).
    annotation = settings.annotation
    with multihost.main_process_first("prepare data"):
        world = prepare_world(settings, workdir)
        train_path = annotate_split(world, settings.data.train_split, annotation, workdir / "tuples")
        if settings.annotate.candidate_contrasts:  # right vs wrong sample of a question (candidate_contrasts)
            train_path = with_candidate_contrasts(world.dir, world.database_dir, settings.data.train_split,
                                                  annotation, train_path)
        eval_path = annotate_split(world, settings.data.eval_split, annotation, workdir / "tuples")
    tokenizer = world.tokenizer

    # Model, optimizer and state, created sharded over the mesh.
    mesh, rules = run.use_mesh()
    model = build_model(settings, len(tokenizer), mesh, rules)
    tx = optim_lib.make_optimizer(settings.optim)
    graphdef, state, state_sharding = loop.create_state(model, tx, mesh, rules)
    run_record = runs.record(model.config, world.tokenizer_dir)   # saved with every checkpoint
    del model
    train_step, eval_scores, clause_scores = step_lib.jit_steps(graphdef, tx, settings.pair_loss, state_sharding,
                                                              lm_config(settings, tokenizer))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    multihost.log_main("Clause-PRM: %s parameters on mesh %s", f"{n_params:,}", dict(mesh.shape))

    # Input pipeline: this host's rows of every global batch, repeated over epochs.
    pipeline = prm_pipeline(
        JsonlSource(train_path), tokenizer, global_batch_size=settings.data.batch_size,
        max_len=settings.data.max_len, bucket_lengths=settings.data.bucket_lengths, seed=settings.seed,
        num_epochs=None, process_index=jax.process_index(), process_count=jax.process_count(),
        within_batch_size=settings.data.within_batch_size, counterfactual_repeat=settings.data.counterfactual_repeat)
    data_iter = pipeline.iterator()
    multihost.log_main("training tuples: %d (%d within-trajectory groups; %d steps per epoch)",
                       pipeline.num_records, pipeline.num_groups, pipeline.steps_per_epoch)

    # Resume from the newest whole checkpoint, data position included.
    state = run.resume(state, data_iter, run_record=run_record)

    def step(state, _):
        host_batch = next(data_iter)
        batch = multihost.host_local_to_global(
            {k: v for k, v in host_batch.items() if k != "record_index"}, mesh, rules)
        return train_step(state, batch)

    evaluator = heldout.PrmEvaluator(world, tokenizer, eval_path, settings, mesh, rules)
    state = run.train(state, step, log_line=lambda s: f"  loss {s['train/loss']:.4f}  acc {s['train/accuracy']:.3f}",
                      evaluate=lambda state: evaluator.pairwise(state.params, eval_scores),
                      eval_every=settings.eval_every)
    with jax.set_mesh(mesh):
        results = evaluator.full(state.params, eval_scores, clause_scores)
    run.finish(results["metrics"], curves=["train/loss", "train/accuracy", "eval/pair_accuracy", "eval/loss"],
               png="loss_curve.png", title="Clause-PRM training")
    write_outputs(settings, workdir, results, nnx.merge(graphdef, state.params), tokenizer, main=run.main)
    summary_lib.prm_run(results, workdir, run.elapsed(), export=settings.export_hf)
    return results


def dry_run(settings: PrmSettings, run: loop.AbstractRun | None = None) -> dict:
    """Lower + compile the train step on abstract shapes for the current devices; no weights."""
    b, length = settings.data.batch_size, settings.data.max_len

    def batch(struct):
        ids, vec = struct((b, length), jnp.int32), lambda dt: struct((b,), dt)
        batch = {"chosen_ids": ids, "chosen_mask": ids, "chosen_pos": vec(jnp.int32), "rejected_ids": ids,
                 "rejected_mask": ids, "rejected_pos": vec(jnp.int32), "margin": vec(jnp.float32),
                 "weight": vec(jnp.float32), "lm_weight": vec(jnp.float32), "clause_id": vec(jnp.int32)}
        if settings.data.within_batch_size:  # group rows, with the narrowest slot width the pipeline makes
            g, slots = settings.data.within_batch_size, GROUP_SLOT_MULTIPLE
            batch |= {"group_ids": struct((g, length), jnp.int32), "group_mask": struct((g, length), jnp.int32),
                      "group_pos": struct((g, slots), jnp.int32), "group_margin": struct((g, slots), jnp.float32),
                      "group_weight": struct((g,), jnp.float32)}
        return batch

    def train_step(graphdef, tx):
        return step_lib.jit_steps(graphdef, tx, settings.pair_loss, lm_cfg=lm_config(settings))[0]

    groups = f" + {settings.data.within_batch_size} within-trajectory groups" if settings.data.within_batch_size else ""
    vocab = loop.dry_run_architecture(settings).vocab_size
    return loop.dry_run(
        settings, ClausePRM, train_step, batch,
        f"Clause-PRM train step: preset {settings.model.preset} (vocabulary {vocab}, the preset's: a run uses its "
        f"tokenizer's), global batch {b} pairs{groups} x {length} tokens, remat {settings.model.remat}, "
        f"params {settings.model.param_dtype}, compute {settings.model.dtype}", run=run)


def compile_programs(settings: PrmSettings) -> dict[str, dict]:
    """Every device program a PRM run compiles, on abstract shapes for the target's devices (``--compile_for``):
    the train step, and the clause-scoring forward (evaluation, the verifier, GRPO's dense rewards) at
    ``data.eval_batch_size`` queries of ``data.max_len`` tokens while the optimizer state stays resident."""
    run = loop.abstract_run(settings, ClausePRM)
    train = dry_run(settings, run)
    rows, length = settings.data.eval_batch_size, settings.data.max_len
    print(f"Clause scoring: {rows} queries x {length} tokens, {CLAUSE_SLOTS} clause positions each")
    scoring = dry_run_lib.report(
        jax.jit(functools.partial(step_lib.clause_scores, graphdef=run.graphdef)),
        (run.state.params, run.struct((rows, length), jnp.int32), run.struct((rows, length), jnp.int32),
         run.struct((rows, CLAUSE_SLOTS), jnp.int32)), run.mesh)
    return {"train_step": {**train, "calls": 1, "resident_bytes": train["memory"]["peak_bytes"]},
            "clause_scores": {**scoring, "calls": 0,
                              "resident_bytes": scoring["memory"]["peak_bytes"] + run.optimizer_bytes()}}
