"""GRPO of the text-to-SQL policy with clause-level (CAPER), token-level or sparse rewards.

Built-in default — CPU, no downloads: the demo world, a tiny random policy, the sparse (execution-only)
variant, which needs no PRM:

    python -m caper_jax.train --config=configs/grpo.py --workdir=runs/grpo_demo

The full pipeline on the demo world (SFT policy, then a Clause-PRM, then CAPER GRPO):

    python -m caper_jax.train --config=configs/sft.py --workdir=runs/sft_demo
    python -m caper_jax.train --config=configs/prm.py --workdir=runs/prm_demo
    python -m caper_jax.train --config=configs/grpo.py:variant=clause --workdir=runs/grpo_clause \
        --config.policy.sft_workdir=runs/sft_demo --config.prm.workdir=runs/prm_demo

Variants (``:arg``, comma separated):
    :variant=sparse|token|clause  reward layout (clause = CAPER; token and sparse are the paper's baselines)
    :model=tiny|small|qwen35_9b   policy preset when starting from random weights
    :data=demo|spider             demo world, or Spider/BIRD layout data in --config.data.dir
    :steps=N                      GRPO steps (one rollout of prompts_per_step x group_size each)
    :pod=v5e-256|v5p-64|v5p-128|v6e-64   a Qwen3.5-9B recipe for that Cloud TPU slice (PODS below), e.g.

    python -m caper_jax.train --config=configs/grpo.py:variant=clause,model=qwen35_9b,pod=v5p-64 --compile_for=v5p-64
"""
from ml_collections import ConfigDict

from caper_jax.parallel.rules import DEFAULT_RULES
from configs.common import apply_pod, parse_arg

# Qwen3.5-9B GRPO on Cloud TPU slices: mesh and the prompt widths of Spider (512) and BIRD with evidence (1536),
# 32 prompts x G = 8 per step; each compiled with `--compile_for=<slice>` (every program at both widths) and
# fitting with >= 5 % of HBM free (docs/scale.md).
PODS = {
    "v5e-256": {"mesh_shape": {"data": 1, "fsdp": 256, "tensor": 1}},   # one rollout row per chip
    "v5p-64": {"mesh_shape": {"data": 1, "fsdp": 32, "tensor": 1}},
    "v5p-128": {"mesh_shape": {"data": 1, "fsdp": 64, "tensor": 1}},
    "v6e-64": {"mesh_shape": {"data": 1, "fsdp": 64, "tensor": 1}},
}
_POD_WIDTHS = {"sampling.prompt_widths": (512, 1536), "sampling.max_prompt_len": 1536}
PODS = {name: {**recipe, **_POD_WIDTHS} for name, recipe in PODS.items()}


def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, variant="sparse", model="tiny", data="demo", steps=0, pod="")
    big = arg.model == "qwen35_9b"
    c = ConfigDict()
    c.trainer = "grpo"
    c.seed = 0

    c.data = ConfigDict()
    c.data.kind = arg.data
    c.data.dir = ""
    c.data.train_split = "train"
    c.data.eval_split = "dev"
    c.data.schema_values = 0
    c.data.demo_train_size = 1200
    c.data.demo_dev_size = 300

    c.model = ConfigDict()                    # the starting policy when not policy.sft_workdir, + runtime
    c.model.preset = arg.model                # random init of this preset (tests, smoke runs) ...
    c.model.hf_dir = ""                       # ... or an HF Qwen3.5 directory (also the default tokenizer)
    c.model.tokenizer_dir = ""
    c.model.dtype = "bfloat16" if big else "float32"   # compute: the policy, its frozen reference AND the frozen PRM
    c.model.param_dtype = "float32"
    c.model.remat = "full" if big else "none"
    c.chunk_size = 128

    c.policy = ConfigDict()
    c.policy.sft_workdir = ""                 # SFT trainer workdir: start from its orbax checkpoint
    c.policy.ckpt = 0                         # checkpoint step of sft_workdir; 0 = newest that verifies

    c.prm = ConfigDict()
    c.prm.workdir = ""                        # PRM trainer workdir (its orbax checkpoint); token/clause only
    c.prm.ckpt = 0                            # checkpoint step; 0 = newest that verifies

    c.reward = ConfigDict()
    c.reward.variant = arg.variant            # sparse | token | clause
    c.reward.correct = 1.0                    # execution reward: result equals gold
    c.reward.wrong = 0.0                      # runs, wrong result
    c.reward.failure = 0.0                    # error, empty or unparseable SQL
    c.reward.format_penalty = 0.0             # extra penalty for unparseable SQL
    c.reward.prm_weight = 1.0                 # PRM score scale vs the execution reward
    c.reward.semantics = "spider"             # result comparison (spider | bird) of the rewards AND the final EX
    c.reward.timeout_s = 2.0                  # per query, sandboxed SQLite: rollouts AND the final EX
    c.reward.max_rows = 10_000                # likewise

    c.sampling = ConfigDict()
    c.sampling.temperature = 1.0
    c.sampling.top_p = 1.0
    c.sampling.top_k = 0
    # Both cut the rollouts AND the end-of-run greedy EX (eval.num_examples).
    c.sampling.max_new_tokens = 128 if big else 64
    c.sampling.max_prompt_len = 1920 if big else 192
    # Prompt widths the sampler pads a step's prompts to (the smallest that holds the longest; the last
    # is max_prompt_len): each width is one compiled shape of every program of the step. 9B: Spider's
    # prompts fit 512 (dev: p95 387, max 409 tokens), BIRD's with evidence 1536 (dev: p95 1228, max 1342);
    # docs/scale.md "The first hour".
    c.sampling.prompt_widths = (512, 1024, 1536, 1920) if big else (64, 128, 192)

    c.rl = ConfigDict()
    c.rl.group_size = 8                       # G completions per prompt
    c.rl.prompts_per_step = 32 if big else 4
    c.rl.update_epochs = 2                    # optimisation passes over each rollout (mu)
    c.rl.num_minibatches = 1                  # optimizer steps per pass
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.beta = 0.04                          # KL to the reference; 0 skips the reference forward
    c.rl.gamma = 1.0
    c.rl.agg = "token-mean"
    c.rl.scale_by_std = True                  # divide the centred rewards by their std (False: Dr. GRPO)
    c.rl.std_ddof = 0                         # that std: 0 population, 1 sample (TRL, tunix); docs/grpo.md
    c.rl.std_eps = 1e-6                       # added to it (TRL: 1e-4); only stops 0/0 in equal-reward groups
    c.rl.std_scope = "group"                  # group | batch (TRL's scale_rewards="batch"); docs/grpo.md
    c.rl.kl_bias_correction = False           # beta's k3 term x the ratio (TRL's default True); docs/grpo.md
    # The sampler/trainer mismatch (docs/grpo.md): old_logp from the trainer's own forward before the first
    # update (one policy forward more per step), and a truncated importance weight min(trainer/sampler, cap)
    # on the policy term (0 = off; needs the recomputation). verl: rollout_is; TRL: vllm_importance_sampling_*.
    c.rl.recompute_old_logp = False
    c.rl.tis_cap = 0.0

    c.optim = ConfigDict()
    c.optim.lr = 1e-6 if big else 1e-4
    c.optim.warmup_steps = 5
    c.optim.total_steps = arg.steps or (500 if big else 40)
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.grad_clip = 1.0
    c.optim.mu_dtype = "float32"              # AdamW moment storage: float32 | bfloat16 (docs/scale.md "Fitting 16 GiB")
    c.optim.nu_dtype = "float32"
    c.optim.max_consecutive_nonfinite = 10

    c.eval = ConfigDict()
    c.eval.num_examples = 500 if big else 64
    c.eval.batch_size = 32 if big else 16

    c.mesh_shape = ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.sharding_rules = DEFAULT_RULES

    c.log_every = 1
    c.ckpt_every = 10
    c.ckpt_keep = 2
    c.export_hf = True
    # the export's tensors: bfloat16 as the Qwen3.5 release ships (vLLM-CPU's DeltaNet needs it); float32
    # keeps a small model's fp32 parameters bit for bit
    c.export_dtype = "bfloat16" if big else "float32"
    apply_pod(c, PODS, arg.pod, arg.model)
    return c
