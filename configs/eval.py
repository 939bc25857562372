"""Policy evaluation: greedy EX, MV@k and Clause-PRM-reranked best-of-k (min / mean / last).

Demo world, after training an SFT policy and a Clause-PRM with the built-in configs (CPU, no downloads):

    python -m caper_jax.train --config=configs/sft.py --workdir=runs/sft_demo
    python -m caper_jax.train --config=configs/prm.py --workdir=runs/prm_demo
    python -m caper_jax.evaluate --config=configs/eval.py --workdir=runs/eval_demo \
        --config.policy.workdir=runs/sft_demo --config.prm.path=runs/prm_demo

Variants (``:arg``, comma separated): ``k=N`` samples per question, ``n=N`` examples (0 = the whole
split), ``big`` (9B-scale batch and lengths). A GRPO workdir, or an HF directory
(``--config.policy.hf_dir``), works the same; ``--config.prm.path`` also takes an HF export.
Spider/BIRD layout data:

    python -m caper_jax.evaluate --config=configs/eval.py:big,k=8 --workdir=/runs/eval9b \
        --config.policy.workdir=/runs/grpo9b --config.prm.path=/runs/prm9b/hf_export \
        --config.data.dir=/data/spider

Writes ``results.json``, ``results.md`` (one EX table) and ``predictions.jsonl`` to the workdir.
"""
from ml_collections import ConfigDict

from caper_jax.parallel.rules import DEFAULT_RULES
from configs.common import parse_arg


def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, k=8, n=0, big=False)
    c = ConfigDict()
    c.seed = 0                                # example subset and sampling keys
    c.timeout_s = 30.0                        # per query, sandboxed SQLite (BIRD's limit)

    c.policy = ConfigDict()
    c.policy.workdir = ""                     # SFT/GRPO trainer workdir: newest whole checkpoint, params only
    c.policy.hf_dir = ""                      # or an HF Qwen3.5 directory (with tokenizer files)
    c.policy.dtype = ""                       # compute dtype; "" = the training config's (HF: float32)

    c.prm = ConfigDict()
    c.prm.path = ""                           # PRM workdir or HF export; "" = no reranking
    c.prm.batch_size = 32 if arg.big else 16  # queries per PRM forward
    c.prm.max_len = 0                         # 0 = the PRM's training max_len (HF export: 1024)
    c.prm.aggregates = ("min", "mean", "last")

    c.data = ConfigDict()
    c.data.dir = ""                           # "" = the policy's training data (demo: <workdir>/demo_world)
    c.data.split = "dev"
    c.data.num_examples = arg.n               # 0 = every usable example; else a seeded subset
    c.data.schema_values = -1                 # -1 = as the policy was trained (data.schema_values)
    c.data.semantics = "spider"               # spider | spider_official (DISTINCT removed, as papers) | bird

    c.sampling = ConfigDict()
    c.sampling.k = arg.k                      # samples per question for MV@k and best-of-k (0: greedy only)
    c.sampling.temperature = 1.0
    c.sampling.top_p = 1.0
    c.sampling.top_k = 0
    c.sampling.max_prompt_len = 1920 if arg.big else 192
    c.sampling.max_new_tokens = 128 if arg.big else 64
    c.sampling.batch_size = 64 if arg.big else 16   # sequences per sampler call (fixed: one compile)

    c.mesh_shape = ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.sharding_rules = DEFAULT_RULES
    return c
