"""Supervised fine-tuning of the Qwen3.5 policy: (question, schema) -> gold SQL + END_OF_SQL.

Built-in default — CPU, no downloads, a few minutes: the demo world, its tokenizer, a tiny random
Qwen3.5-architecture policy (tied embeddings); greedy EX on held-out dev questions at the end:

    python -m caper_jax.train --config=configs/sft.py --workdir=runs/sft_demo

Variants (``:arg``, comma separated):
    :model=tiny|small|qwen35_9b   policy preset (qwen35_9b: pass --config.model.hf_dir for real weights)
    :data=demo|spider             demo world, or Spider/BIRD layout data in --config.data.dir
    :steps=N                      training steps

Qwen3.5-9B on Spider-layout data:

    python -m caper_jax.train --config=configs/sft.py:model=qwen35_9b,data=spider \
        --config.model.hf_dir=/ckpt/Qwen3.5-9B --config.data.dir=/data/spider --workdir=/runs/sft9b

Dry run of that step on the current devices (no weights allocated):

    python -m caper_jax.train --config=configs/sft.py:model=qwen35_9b --dry_run
"""
from ml_collections import ConfigDict

from caper_jax.parallel.rules import DEFAULT_RULES
from configs.common import parse_arg


def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, model="tiny", data="demo", steps=0)
    big = arg.model == "qwen35_9b"
    c = ConfigDict()
    c.trainer = "sft"
    c.seed = 0

    c.data = ConfigDict()
    c.data.kind = arg.data                    # "demo" | "spider"
    c.data.dir = ""                           # Spider/BIRD layout; demo: built under workdir when empty
    c.data.train_split = "train"
    c.data.eval_split = "dev"
    c.data.max_len = 2048 if big else 256     # prompt + SQL + stop; prompts are cut from the left
    # 9B: fitted to Qwen3.5-tokenised Spider and BIRD lengths (docs/tokenizer.md, bench/seq_lengths.py).
    c.data.bucket_lengths = (192, 384, 768, 2048) if big else (128, 192, 256)
    c.data.batch_size = 64 if big else 16     # global, in sequences
    c.data.schema_values = 0                  # frequent text values per column in the schema prompt
    c.data.demo_train_size = 1200
    c.data.demo_dev_size = 300

    c.model = ConfigDict()
    c.model.preset = arg.model                # tiny | small | qwen35_9b
    c.model.hf_dir = ""                       # start from a local HF Qwen3.5 checkpoint
    c.model.tokenizer_dir = ""                # default: hf_dir, or the demo tokenizer
    c.model.dtype = "bfloat16" if big else "float32"
    c.model.param_dtype = "float32"
    c.model.remat = "full" if big else "none"
    c.chunk_size = 128                        # sequence positions per log-prob chunk (policy/logprobs.py)

    c.optim = ConfigDict()
    c.optim.lr = 1e-5 if big else 2e-3
    c.optim.warmup_steps = 20
    c.optim.total_steps = arg.steps or (2000 if big else 300)
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.grad_clip = 1.0
    c.optim.mu_dtype = "float32"              # AdamW moment storage: float32 | bfloat16 (docs/scale.md "Fitting 16 GiB")
    c.optim.nu_dtype = "float32"
    c.optim.max_consecutive_nonfinite = 10

    c.eval = ConfigDict()
    c.eval.num_examples = 500 if big else 64  # held-out slice of eval_split for greedy EX
    c.eval.batch_size = 32 if big else 16
    c.eval.max_prompt_len = 1920 if big else 192
    c.eval.max_new_tokens = 128 if big else 64
    c.eval.timeout_s = 2.0

    c.mesh_shape = ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.sharding_rules = DEFAULT_RULES

    c.log_every = 20
    c.ckpt_every = 100
    c.ckpt_keep = 2
    c.export_hf = True
    # the export's tensors: bfloat16 as the Qwen3.5 release ships (vLLM-CPU's DeltaNet needs it); float32
    # keeps a small model's fp32 parameters bit for bit
    c.export_dtype = "bfloat16" if big else "float32"
    return c
