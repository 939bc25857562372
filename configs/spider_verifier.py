"""The Clause-PRM as a plug-and-play verifier on real candidates (the paper's third experiment, on Spider).

From nothing (``caper_jax/experiments/spider_verifier.py``, trainer "spider_verifier"; every stage resumes):

    view      a Spider layout under <workdir>/spider: links to ../shared/data/spider's databases and
              tables.json; train.json = Spider's training questions whose database is present (6,904 of
              7,000); dev.json = the dev questions whose database is present (972); a byte-level BPE
              tokenizer trained on the training prompts + SQL only
    sft       a tiny Qwen3.5-architecture policy SFT'd on those training questions
    samples   k samples per training question of that policy (its failures feed counterfactual tuples)
    prm       a Clause-PRM, backbone initialised from the SFT run, trained on the TRAINING split only:
              fault injection on its gold + counterfactual tuples of the policy's failures (+ candidate
              contrasts); evaluated on localisation of the six systems' real dev failures (annotator's
              root clause) against the baselines (policy confidence, sample disagreement across the six
              systems, execution-only, random; first-diff-from-gold as a reference that sees gold)
    pick      the reranker (best-of-k per aggregate or PRM-weighted vote) with the best EX on the
              policy's samples of training questions the PRM never trained on (report.pick_held_back)
              — never chosen on dev
    verify    EX on dev of each system alone, MV@6, every PRM reranker, oracle@6 (caper_jax.eval.verifier)

    bash launch/spider_verifier.sh runs/spider_verifier
    python -m caper_jax.train --config=configs/spider_verifier.py --workdir=runs/spider_verifier    # the same
    bash launch/spider_verifier.sh runs/sv_fast :fast
    python -m caper_jax.train --config=configs/spider_verifier.py:fast --workdir=runs/sv_fast     # the same

Variants (``:arg``): ``:fast`` — every stage at toy size (tests use it; its numbers mean nothing).
"""
import os
import pathlib

from ml_collections import ConfigDict

from configs import eval as eval_config
from configs import prm as prm_config
from configs import sft as sft_config
from configs.common import parse_arg

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
# The tests' override of the Spider folder (tests/conftest.py) applies here too.
SPIDER_DIR = pathlib.Path(os.environ.get("CAPER_SPIDER_DIR", SHARED / "spider"))
SYSTEMS = ("c3sql_chatgpt.sql", "dail_sql_gpt4.sql", "dail_sql_gpt4_sc.sql", "din_sql_codex.csv",
           "din_sql_gpt4.csv", "graphix_t5.sql")


def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, fast=False)
    c = ConfigDict()
    c.trainer = "spider_verifier"
    c.seed = 0

    c.data = ConfigDict()
    c.data.spider_dir = str(SPIDER_DIR)
    c.data.predictions_dir = str(SPIDER_DIR.parent / "spider_predictions")
    c.data.systems = SYSTEMS
    c.data.train_questions = 0                # 0: every training question with a database
    c.data.dev_questions = 0                  # 0: every dev question with a database
    c.data.vocab_size = 4096                  # the tokenizer trained on the training prompts + SQL

    c.samples = ConfigDict()
    c.samples.train_questions = 2000          # SFT-policy samples (k = eval.sampling.k) for counterfactual tuples

    c.report = ConfigDict()
    c.report.pick_questions = 300             # training questions of the reranker pick
    # Their samples and golds are left out of the PRM's training data, so the pick is out of sample.
    c.report.pick_held_back = True

    c.verify = ConfigDict()
    c.verify.semantics = "spider"             # EX semantics of verify / evaluate ex

    c.sft = sft_config.get_config("model=tiny,data=spider")
    # Spider's schemas are long: the prompt keeps more of them than the demo world's 256 tokens.
    c.sft.data.max_len = 768
    c.sft.data.bucket_lengths = (256, 512, 768)
    c.sft.optim.total_steps = 1500
    c.sft.eval.num_examples = 0
    c.sft.export_hf = False

    c.prm = prm_config.get_config("model=tiny,data=spider")
    c.prm.data.max_len = 896
    c.prm.data.bucket_lengths = (384, 640, 896)
    c.prm.optim.total_steps = 600
    c.prm.loss.lm_coef = 0.0                  # the backbone starts from the SFT policy (model.init_from)
    c.prm.annotate.candidate_contrasts = True
    c.prm.export_hf = False

    c.eval = eval_config.get_config("k=4")
    c.eval.sampling.max_prompt_len = 640
    c.eval.sampling.max_new_tokens = 96
    c.eval.prm.max_len = 896

    if arg.fast:
        c.data.train_questions, c.data.dev_questions = 48, 10
        c.data.vocab_size = 512
        c.samples.train_questions = 8
        c.report.pick_questions = 6
        # Short sequences (prompts lose their schema's start) and one bucket each: few, small compiles.
        c.sft.optim.total_steps = 6
        c.sft.data.max_len = 384
        c.sft.data.bucket_lengths = (384,)
        c.sft.data.batch_size = 4                 # small batches: the steps' arithmetic was most of a run
        c.prm.optim.total_steps = 3
        c.prm.data.batch_size, c.prm.data.within_batch_size = 4, 4
        c.prm.annotate.per_query = 1
        c.prm.data.max_len = 448
        c.prm.data.bucket_lengths = (448,)
        c.prm.data.max_eval_tuples = 16
        c.eval.prm.max_len = 448
        c.eval.sampling.k = 2
        c.eval.sampling.max_prompt_len = 320
        c.eval.sampling.max_new_tokens = 24
    return c
