"""The experiments' settings (configs/reproduce.py, configs/spider_verifier.py): their own fields and each
stage's whole trainer settings (``SftSettings``, ``PrmSettings``, ``GrpoSettings``, ``EvalSettings``), which
the pipelines wire to each other's outputs with ``caper_jax.settings.replace``."""
from __future__ import annotations

from caper_jax.eval.settings import EvalSettings
from caper_jax.prm.settings import PrmSettings
from caper_jax.rl.rewards import VARIANTS
from caper_jax.rl.settings import GrpoSettings
from caper_jax.sections import frozen
from caper_jax.settings import Settings, one_of
from caper_jax.sft.settings import SftSettings

PRM_INITS = ("sft", "random")


def rerankers(eval_settings: EvalSettings) -> tuple[str, ...]:
    """Every PRM reranker the evaluation reports: best-of-k per aggregate, then the weighted vote per aggregate."""
    aggregates = eval_settings.prm.aggregates
    return aggregates + tuple(f"vote_{how}" for how in aggregates)


@frozen
class Samples:
    train_questions: int             # training questions the SFT policy samples k times (the PRM's trajectories)


def check_pick_held_back(report, samples: Samples) -> None:
    """Holding the pick questions back must leave the PRM some sampled training question (both pipelines)."""
    if report.pick_held_back and report.pick_questions >= samples.train_questions:
        raise ValueError(f"report.pick_held_back leaves the PRM no sampled question: report.pick_questions="
                         f"{report.pick_questions} >= samples.train_questions={samples.train_questions}")


@frozen
class ReproduceData:
    kind: str                        # demo | spider
    dir: str                         # Spider/BIRD layout (:full); demo: built in <workdir>/world


@frozen
class ReproduceReport:
    rerank: str                      # "train": picked on training questions; or a reranker's name
    pick_questions: int
    pick_held_back: bool             # the pick questions are left out of the PRM's training data


@frozen
class ReproduceSettings(Settings):
    trainer: str
    seed: int                        # world, SFT, samples, PRM and the evaluation's sampling keys
    seeds: tuple[int, ...]           # GRPO seeds, one run per (variant, seed)
    variants: tuple[str, ...]
    data: ReproduceData
    samples: Samples
    report: ReproduceReport
    prm_init: str                    # sft | random: the PRM's backbone
    sft: SftSettings
    prm: PrmSettings
    grpo: GrpoSettings
    eval: EvalSettings

    def __post_init__(self):
        if not self.variants or any(v not in VARIANTS for v in self.variants):
            raise ValueError(f"variants={self.variants}; expected a non-empty subset of {VARIANTS}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds} must be non-empty and distinct")
        one_of(self.data.kind, ("demo", "spider"), "data.kind")
        if self.data.kind == "spider" and not self.data.dir:
            raise ValueError("data.kind='spider' needs --config.data.dir=<Spider/BIRD layout directory>")
        if self.samples.train_questions < 1:
            raise ValueError(f"samples.train_questions must be >= 1, got {self.samples.train_questions}")
        if self.eval.sampling.k < 2:
            raise ValueError(f"eval.sampling.k must be >= 2 (MV@k and best-of-k), got {self.eval.sampling.k}")
        selectors = rerankers(self.eval)
        if self.report.rerank != "train" and self.report.rerank not in selectors:
            raise ValueError(f"report.rerank={self.report.rerank!r} is not in {('train', *selectors)} "
                             "('train': the reranker that is best on the training pool)")
        if self.report.pick_questions < 1:
            raise ValueError(f"report.pick_questions must be >= 1, got {self.report.pick_questions}")
        check_pick_held_back(self.report, self.samples)
        one_of(self.prm_init, PRM_INITS, "prm_init")


@frozen
class VerifierData:
    spider_dir: str
    predictions_dir: str
    systems: tuple[str, ...]         # the published systems' prediction files in predictions_dir
    train_questions: int             # 0: every training question with a database
    dev_questions: int               # 0: every dev question with a database
    vocab_size: int                  # the tokenizer trained on the training prompts + SQL

    def __post_init__(self):
        if self.train_questions < 0 or self.dev_questions < 0:
            raise ValueError("data.train_questions and data.dev_questions must be >= 0 (0: all)")


@frozen
class VerifierReport:
    pick_questions: int
    pick_held_back: bool


@frozen
class Verify:
    semantics: str                   # EX semantics of verify / evaluate ex


@frozen
class SpiderVerifierSettings(Settings):
    trainer: str
    seed: int
    data: VerifierData
    samples: Samples
    report: VerifierReport
    verify: Verify
    sft: SftSettings
    prm: PrmSettings
    eval: EvalSettings

    def __post_init__(self):
        if self.samples.train_questions < 1 or self.report.pick_questions < 1:
            raise ValueError("samples.train_questions and report.pick_questions must be >= 1")
        check_pick_held_back(self.report, self.samples)
        if self.eval.sampling.k < 2:
            raise ValueError(f"eval.sampling.k must be >= 2 (a vote on the training pool), got {self.eval.sampling.k}")
