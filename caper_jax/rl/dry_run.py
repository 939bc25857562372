"""Dry run of one whole GRPO step: every program it runs, lowered and compiled on abstract inputs.

One step of ``caper_jax.rl.trainer.run`` runs these device programs (``caper_jax.rl.step``), in this order
(the host-side decoding, clause splitting and SQL execution in between allocate nothing on the devices):

  1. ``prefill``   sampler ``_prefill``: the policy reads each left-padded prompt once (tokens =
                   prompts × prompt length) and creates the KV / conv / recurrent caches for prompt +
                   new tokens, repeated to the rows = prompts × G the decode samples (``group_size``);
  2. ``decode``    sampler ``_decode``: the ``while_loop`` of decode steps, cache donated (its FLOPs
                   are counted for ``max_new_tokens - 1`` trips: every row running to the end);
  3. ``prm``       ``prm_token_scores``: the frozen Clause-PRM over prompt + completion, one forward;
  4. ``reference`` ``jit_completion_logprobs``: the frozen reference policy's log-probs (beta > 0);
  5. ``update``    ``jit_update``: forward + backward + AdamW on one minibatch, state donated; it runs
                   ``update_epochs × num_minibatches`` times per step.

Placement is the real run's: the same jitted functions, params sharded by the settings' rules,
prompts replicated (the trainer hands the sampler host arrays), caches as the compiled prefill lays
them out, the scoring / update batches split over ``data × fsdp`` (``multihost.replicated_batch`` in the trainer).

What is resident while a program runs: its own peak (``argument + output − alias + temp``,
``caper_jax.parallel.dry_run.report``) plus the step's persistent buffers that are not its arguments —
the policy's optimizer state (the update holds it as an argument; the sampler does not), the reference params
(beta > 0) and the Clause-PRM params (variant ≠ sparse), both held as the trainer holds them
(``frozen_params``: matmul weights in the compute dtype). Rollout arrays carried between programs
(tokens, masks, log-probs, advantages: a few MB) are left out.

``plan(settings, mesh)`` compiles the five programs once and returns their figures; ``fit`` extrapolates
a program's memory linearly in rows per device between two compiled batch sizes. ``programs_compiled``
counts the distinct programs a whole run compiles: one of each per prompt width a step meets
(``sampling.prompt_widths``), and the update once more per width for the steps that do not log.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from caper_jax.loop import dry_run_architecture
from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.frozen import frozen_params
from caper_jax.models.sampler import SamplingConfig, _decode, _prefill, prefill_group_size
from caper_jax.parallel import multihost
from caper_jax.parallel import rules as rules_lib
from caper_jax.parallel.dry_run import GiB, device_bytes, report
from caper_jax.prm.model import ClausePRM
from caper_jax.rl import step as rl_step
from caper_jax.rl.trainer import is_logging_step, prompt_iterator
from caper_jax.utils.optim import init_state, make_optimizer

PROGRAMS = ("prefill", "decode", "prm", "reference", "update")


@dataclasses.dataclass
class ProgramFigures:
    name: str
    rows: int                      # sequences the program processes per call (global)
    tokens: int                    # tokens per call (global): new positions computed
    calls: int                     # calls per GRPO step
    matmul_flops: float            # per call, global
    memory: dict[str, int]         # per device (parallel.dry_run.report)
    resident_bytes: int            # per device, this program's peak + persistent buffers not its arguments
    compile_s: float
    collective_bytes: dict[str, int]   # per call, per device, by kind (parallel.hlo_collectives)
    trips: float = 1.0             # times its loop body runs per call (the decode loop's tokens)
    largest_buffers: list = dataclasses.field(default_factory=list)   # per device (parallel.dry_run.report)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def _split(mesh, rules, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=multihost.batch_sharding(mesh, len(shape), rules))


def _with_shardings(structs: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), structs, shardings)


def plan(settings, mesh, *, programs: tuple[str, ...] = PROGRAMS, print_fn=print,
         update_entropy: bool = True, prompt_width: int | None = None) -> dict[str, Any]:
    """Compiles the GRPO step's programs for ``settings`` (``GrpoSettings``) on ``mesh``; no weights.
    ``update_entropy``: the update of a logging step (with the policy's entropy) or of the others.
    ``prompt_width``: the prompts' padded width (one of ``sampling.prompt_widths``; default the widest).

    Returns ``{"programs": {name: ProgramFigures}, "persistent": {name: bytes per device}, "config": ...}``.
    """
    rules = settings.sharding_rules
    arch = dry_run_architecture(settings)
    tx = make_optimizer(settings.optim, rl_step.updates_per_step(settings))
    graphdef, state = rules_lib.abstract_train_state(
        lambda: Qwen35ForCausalLM(arch, rngs=nnx.Rngs(0), mesh=mesh, rules=rules),
        lambda p: init_state(p, tx), mesh, rules)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    use_ref = settings.rl.beta > 0
    use_prm = settings.reward.uses_prm
    prm_graphdef = prm_params = None
    if use_prm:  # load_prm builds the PRM run's recorded architecture, which a dry run (reading no run)
        # takes to be the policy's preset; this run's compute dtype, no remat, held as load_prm holds it
        prm_arch = dry_run_architecture(settings, remat="none")
        prm_graphdef, prm_params = rules_lib.abstract_state(
            lambda: ClausePRM(prm_arch, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules)
        prm_params = frozen_params(prm_params, arch.dtype, reads_head=False, tied=True)
    ref_params = (frozen_params(state.params, arch.dtype, reads_head=True, tied=arch.tie_word_embeddings)
                  if use_ref else None)   # as the trainer's reference_params
    persistent = {
        "policy_params": device_bytes(state.params),
        "optimizer_state": device_bytes(state) - device_bytes(state.params),
        "reference_params": device_bytes(ref_params) if use_ref else 0,
        "prm_params": device_bytes(prm_params) if use_prm else 0,
    }

    group, prompts = settings.rl.group_size, settings.rl.prompts_per_step
    rows = prompts * group
    prompt_len, new = prompt_width or settings.sampling.max_prompt_len, settings.sampling.max_new_tokens
    full = prompt_len + new
    minibatch = rows // settings.rl.num_minibatches
    # The accelerator's decode program: scanned layers read in place, no per-group weight copies (the
    # simulated devices here are CPUs, whose default would add them).
    sampling = SamplingConfig(new, settings.sampling.temperature, settings.sampling.top_k, settings.sampling.top_p,
                              stop_tokens=(0,), pad_id=0, copy_layer_weights=False)
    figures: dict[str, ProgramFigures] = {}

    def run(name, fn, args, *, uses, tokens, n_rows, calls=1, static=None, donate=(), trips=1.0):
        if print_fn is not None:
            print_fn(f"--- {name}: {n_rows} rows, {tokens:,} tokens per call, {calls} call(s) per step")
        result = report(fn, args, mesh, params=None, donate_argnums=donate, print_fn=print_fn,
                        static_kwargs=static, while_trips=trips)
        others = sum(v for k, v in persistent.items() if k not in uses)
        figures[name] = ProgramFigures(name, n_rows, tokens, calls, result["matmul_flops"], result["memory"],
                                       result["memory"]["peak_bytes"] + others, result["compile_s"],
                                       result["collective_bytes"], trips, result["largest_buffers"])
        return result

    # The trainer prefills each distinct prompt once (prompts × prompt_len positions computed) and the
    # program repeats the cache to the rows the decode samples; its rows are those (its memory, the
    # cache it returns, grows with them, and ``fit`` puts every program on one axis of rollout rows).
    shared = prefill_group_size(prompts, group, multihost.batch_multiple(mesh, rules))   # as the trainer
    prefilled = prompts * (group // shared)
    ids_p = _replicated(mesh, (prefilled, prompt_len), jnp.int32)
    prefill_static = {"max_len": full, "cache_dtype": sampling.cache_dtype, "group_size": shared}
    if "prefill" in programs or "decode" in programs:
        pre = run("prefill", _prefill, (graphdef, state.params, ids_p, ids_p), uses=("policy_params",),
                  tokens=prefilled * prompt_len, n_rows=rows, static=prefill_static)
        if "decode" in programs:
            logits_s, cache_s = pre["output_shardings"]
            first_logits = jax.ShapeDtypeStruct((rows, arch.vocab_size), jnp.float32, sharding=logits_s)
            cache = _with_shardings(jax.eval_shape(
                lambda p, i, m: _prefill(graphdef, p, i, m, **prefill_static)[1], state.params, ids_p, ids_p), cache_s)
            keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
            keys = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
            run("decode", _decode, (graphdef, state.params, first_logits, cache, keys), uses=("policy_params",),
                tokens=rows * (new - 1), n_rows=rows, static={"config": sampling}, trips=new - 1)
    ids = _split(mesh, rules, (rows, full), jnp.int32)
    if "prm" in programs and use_prm:
        run("prm", rl_step.prm_token_scores, (prm_params, ids, ids), uses=("prm_params",), tokens=rows * full,
            n_rows=rows, static={"graphdef": prm_graphdef, "last": new})
    if "reference" in programs and use_ref:
        run("reference", rl_step.jit_completion_logprobs, (ref_params, ids, ids), uses=("reference_params",),
            tokens=rows * full, n_rows=rows,
            static={"graphdef": graphdef, "completion_len": new, "temperature": float(settings.sampling.temperature),
                    "chunk_size": settings.chunk_size})
    if "update" in programs:
        mb = {"input_ids": _split(mesh, rules, (minibatch, full), jnp.int32),
              "attention_mask": _split(mesh, rules, (minibatch, full), jnp.int32),
              "completion_mask": _split(mesh, rules, (minibatch, new), jnp.int32),
              "old_logp": _split(mesh, rules, (minibatch, new), jnp.float32),
              "advantages": _split(mesh, rules, (minibatch, new), jnp.float32)}
        if use_ref:
            mb["ref_logp"] = _split(mesh, rules, (minibatch, new), jnp.float32)
        run("update", rl_step.jit_update(graphdef, tx, settings, state_sharding, with_entropy=update_entropy),
            (state, mb),
            uses=("policy_params", "optimizer_state"), tokens=minibatch * full, n_rows=minibatch,
            calls=settings.rl.update_epochs * settings.rl.num_minibatches)
    return {"programs": figures, "persistent": persistent, "devices": mesh.size, "mesh": dict(mesh.shape),
            "rows": rows, "minibatch_rows": minibatch, "prompt_len": prompt_len, "new_tokens": new,
            "params": sum(x.size for x in jax.tree.leaves(state.params))}


def widths_over_run(lengths, settings, width_of) -> list[int]:
    """The prompt width of every step of a run of ``config`` (``optim.total_steps`` steps of
    ``rl.prompts_per_step`` prompts drawn as the trainer draws them) whose prompts have ``lengths``
    tokens: ``width_of(longest prompt of the step, cut to max_prompt_len)``."""
    cap = settings.sampling.max_prompt_len
    draws = prompt_iterator(len(lengths), settings.rl.prompts_per_step, settings.seed)
    return [width_of(min(cap, max(int(lengths[i]) for i in next(draws)))) for _ in range(settings.optim.total_steps)]


def rounded_width(multiple: int, max_prompt_len: int):
    """The width rule before the ladder: the longest prompt rounded up to ``multiple``, at most
    ``max_prompt_len`` (kept to report a run's program count before -> after)."""
    return lambda longest: min(max_prompt_len, -(-longest // multiple) * multiple)


def programs_compiled(widths: list[int], settings, *, entropy_every_step: bool = False) -> dict[str, int]:
    """Distinct device programs a run compiles, per kind, given each step's prompt width: the sampler's
    prefill and decode, the PRM and the reference once per width; the update once per width and
    entropy variant (logging steps compute the entropy, the others do not; ``entropy_every_step``: every
    update computed it, as before ``is_logging_step``)."""
    per_width = len(set(widths))
    variants = {(w, True if entropy_every_step else is_logging_step(settings, step))
                for step, w in enumerate(widths, start=1)}
    return {"prefill": per_width, "decode": per_width,
            "prm": per_width if settings.reward.uses_prm else 0,
            "reference": per_width if settings.rl.beta > 0 else 0, "update": len(variants)}


def fit(small: dict[str, Any], large: dict[str, Any], name: str) -> tuple[float, float]:
    """(bytes at 0 rows/device, bytes per row/device) of program ``name``'s resident memory, from two
    plans of the same mesh at different batch sizes (a line through the two points)."""
    a, b = small["programs"][name], large["programs"][name]
    ra, rb = a.rows / small["devices"], b.rows / large["devices"]
    slope = (b.resident_bytes - a.resident_bytes) / (rb - ra)
    return a.resident_bytes - slope * ra, slope


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"{'program':<10} {'rows':>5} {'tokens/call':>12} {'calls':>5} {'matmul FLOPs/call':>18} "
             f"{'argument':>9} {'temp':>8} {'peak':>8} {'resident':>9}   (GiB per device)"]
    for f in result["programs"].values():
        m = f.memory
        lines.append(f"{f.name:<10} {f.rows:>5} {f.tokens:>12,} {f.calls:>5} {f.matmul_flops:>18.3e} "
                     f"{m['argument_bytes'] / GiB:>9.2f} {m['temp_bytes'] / GiB:>8.2f} {m['peak_bytes'] / GiB:>8.2f} "
                     f"{f.resident_bytes / GiB:>9.2f}")
    persistent = ", ".join(f"{k} {v / GiB:.2f}" for k, v in result["persistent"].items())
    lines.append(f"persistent per device (GiB): {persistent}")
    worst = max(result["programs"].values(), key=lambda f: f.resident_bytes)
    lines.append(f"most resident at once: {worst.resident_bytes / GiB:.2f} GiB per device, during {worst.name}")
    return lines
