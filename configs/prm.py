"""Clause-PRM training (CAPER stage 2).

Built-in default — CPU, no downloads: builds the demo world, annotates it, trains a tiny random
Qwen3.5-architecture PRM with the demo tokenizer, evaluates localisation, checkpoints and exports:

    python -m caper_jax.train --config=configs/prm.py --workdir=runs/prm_demo

Variants (``:arg``, comma separated):
    :model=tiny|small|qwen35_9b   backbone preset (qwen35_9b needs --config.model.hf_dir for real weights)
    :data=demo|spider             demo world, or Spider/BIRD layout data in --config.data.dir
    :steps=N                      training steps
    :pod=v5e-256|v5p-64|v5p-128|v6e-64   a Qwen3.5-9B recipe for that Cloud TPU slice (PODS below)

The paper's recipe, Qwen3.5-9B on Spider/BIRD-layout data (see README "Running at scale"):

    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b,data=spider \
        --config.model.hf_dir=/ckpt/Qwen3.5-9B --config.data.dir=/data/spider --workdir=/gcs/BUCKET/caper/prm9b

Dry run of that step on the current devices (no weights allocated), and every program of it compiled by the TPU
compiler for a slice's recipe (libtpu, no TPU needed):

    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b --dry_run
    python -m caper_jax.train --config=configs/prm.py:model=qwen35_9b,pod=v5e-256 --compile_for=v5e-256
"""
from ml_collections import ConfigDict

from caper_jax.parallel.rules import DEFAULT_RULES
from caper_jax.sql.tuples import AnnotationSettings
from configs.common import apply_pod, parse_arg

# Qwen3.5-9B on Cloud TPU slices: mesh, pairs per step (2 sequences each) and the scoring batch (a multiple of
# the batch shards), each compiled with `--compile_for=<slice>` and fitting with >= 5 % of HBM free
# (docs/scale.md has the figures). Tokens per chip: v5e 2,048, v5p 8,192, v6e 4,096. v5e-256: a pair per
# (data, fsdp) slot, its heads and MLP split over a tensor pair; (16, 16, 1) needs >= 256 pairs (the chosen
# and the rejected rows are each split over data x fsdp), 2 sequences per chip: 16.66 GiB, over the chip.
PODS = {
    "v5e-256": {"mesh_shape": {"data": 8, "fsdp": 16, "tensor": 2}, "data.batch_size": 128,
                "data.eval_batch_size": 128},
    "v5p-64": {"mesh_shape": {"data": 1, "fsdp": 32, "tensor": 1}, "data.batch_size": 64,
               "data.eval_batch_size": 64},
    "v5p-128": {"mesh_shape": {"data": 2, "fsdp": 32, "tensor": 1}, "data.batch_size": 128,
                "data.eval_batch_size": 128},
    "v6e-64": {"mesh_shape": {"data": 1, "fsdp": 64, "tensor": 1}, "data.batch_size": 64,
               "data.eval_batch_size": 64},
}

def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, model="tiny", data="demo", steps=0, pod="")
    c = ConfigDict()
    c.trainer = "prm"
    c.seed = 0

    c.data = ConfigDict()
    c.data.kind = arg.data                    # "demo" | "spider"
    c.data.dir = ""                           # Spider/BIRD layout; demo: built under workdir when empty
    c.data.train_split = "train"
    c.data.eval_split = "dev"
    c.data.max_len = 384 if arg.model != "qwen35_9b" else 2048
    # 9B: fitted to Qwen3.5-tokenised Spider and BIRD lengths (docs/tokenizer.md, bench/seq_lengths.py).
    c.data.bucket_lengths = (128, 192, 384) if arg.model != "qwen35_9b" else (192, 384, 768, 2048)
    c.data.batch_size = {"tiny": 8, "small": 16}.get(arg.model, 64)   # global, in pairs
    # Within-trajectory tuples of one negative query share ONE forward pass of that query (same loss,
    # fewer sequences; docs/pipeline.md "Within-trajectory groups"): this many negatives per global
    # batch, next to batch_size pairs of the other tuples. 0: within tuples are ordinary pairs.
    # tiny: 8 pairs + 16 groups = 32 sequences per step, as 16 plain pairs, but ~45 pairs instead of 16.
    c.data.within_batch_size = 16 if arg.model == "tiny" else 0
    # Tuples from counterfactual repair of real predictions (provenance counterfactual, within:counterfactual)
    # appear this many times per epoch; fault-injection tuples once (docs/pipeline.md).
    c.data.counterfactual_repeat = 3 if arg.data == "demo" else 1
    c.data.eval_batch_size = 32
    c.data.max_eval_tuples = 512
    c.data.demo_train_size = 1200           # demo world questions (train); dev is built alongside
    c.data.demo_dev_size = 300

    # The annotator's recipe: each default lives once, in caper_jax.sql.tuples.AnnotationSettings
    # (configs/annotate.py says why each value); only this config's own choices are written here.
    recipe = AnnotationSettings()
    c.annotate = ConfigDict()
    c.annotate.per_query = recipe.per_query   # fault-injection negatives per gold query
    c.annotate.compound = recipe.compound     # of those, also given a second fault in a later clause
    c.annotate.site_balance = recipe.site_balance   # edit sites tried round-robin over clauses (or: kind)
    c.annotate.alpha = recipe.alpha           # penalty at v*; also the loss's margin scale (PairLossConfig.annotation_alpha)
    c.annotate.sigma = recipe.sigma
    c.annotate.margin_floor = recipe.margin_floor
    c.annotate.within_trajectory = recipe.within_trajectory   # each negative's clauses vs its root (docs/annotation.md)
    # Also pair a right and a wrong prediction of one question at the wrong one's root clause (training
    # split only; caper_jax.data.candidate_contrasts): what reranking asks of the PRM.
    c.annotate.candidate_contrasts = False
    # Per query: a budget of SQLite VM instructions, so labels do not depend on the machine's load,
    # and a wall-clock backstop.
    c.annotate.max_vm_steps = recipe.max_vm_steps
    c.annotate.timeout_s = recipe.timeout_s
    c.annotate.suspect_tuples = recipe.suspect_tuples   # tuples from suspect failures (tie, type, gold_literal_case)
    # Result equivalence when annotating: spider (bags, ordered iff ORDER BY) | bird (set equality, as
    # BIRD's evaluator; set it with BIRD data, as configs/annotate.py:bird does).
    c.annotate.semantics = recipe.semantics

    c.model = ConfigDict()
    c.model.preset = arg.model                # tiny | small | qwen35_9b
    c.model.hf_dir = ""                       # load backbone weights from a local HF directory
    # Backbone from an SFT (or GRPO) run's newest checkpoint: the policy is the stand-in for the paper's
    # pretrained LLM (its recorded architecture, a vocabulary that covers the tokenizer, the same
    # param_dtype; tied embeddings); the score head starts fresh.
    c.model.init_from = ""
    c.model.tokenizer_dir = ""                # default: hf_dir, or the demo tokenizer
    # Compute dtype: 9B computes in bfloat16 over fp32 parameters (as configs/sft.py and grpo.py do), the
    # setting its memory plan in docs/scale.md assumes; the small presets stay in fp32.
    c.model.dtype = "bfloat16" if arg.model == "qwen35_9b" else "float32"
    c.model.param_dtype = "float32"
    c.model.remat = "none" if arg.model != "qwen35_9b" else "layers"   # 9B: fits 16-way FSDP on 16 GiB (docs/scale.md)

    c.loss = ConfigDict()
    c.loss.form = "weighted"                  # weighted | offset
    c.loss.margin_weight = "linear"           # linear | none
    c.loss.offset_scale = 1.0
    c.loss.center_coef = 0.01
    # Next-token loss on the chosen sides' SQL, added to the pair loss (caper_jax/prm/loss.py): a
    # random backbone learns the question -> SQL mapping a pretrained one brings. 0 for real checkpoints.
    c.loss.lm_coef = 1.0 if arg.model == "tiny" else 0.0

    c.optim = ConfigDict()
    c.optim.lr = 1e-3 if arg.model == "tiny" else 1e-5
    c.optim.warmup_steps = 30
    c.optim.total_steps = arg.steps or (450 if arg.model == "tiny" else 2000)
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.grad_clip = 1.0
    c.optim.mu_dtype = "float32"              # AdamW moment storage: float32 | bfloat16 (docs/scale.md "Fitting 16 GiB")
    c.optim.nu_dtype = "float32"
    c.optim.max_consecutive_nonfinite = 10    # refuse non-finite updates; stop after this many in a row

    # Mesh axes data x fsdp x tensor (-1: all remaining devices) and the logical-axis rules that map
    # parameter/activation axis names onto them (caper_jax/parallel/rules.py documents the names).
    c.mesh_shape = ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.sharding_rules = DEFAULT_RULES

    c.log_every = 20
    c.eval_every = 100
    c.ckpt_every = 100
    c.ckpt_keep = 2
    c.export_hf = True
    # the export's tensors: bfloat16 as the Qwen3.5 release ships (vLLM-CPU's DeltaNet needs it); float32
    # keeps a small model's fp32 parameters bit for bit
    c.export_dtype = "bfloat16" if arg.model == "qwen35_9b" else "float32"
    apply_pod(c, PODS, arg.pod, arg.model)
    return c
