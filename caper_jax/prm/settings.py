"""The Clause-PRM trainer's settings (configs/prm.py), built once by ``caper_jax.prm.trainer.validate``."""
from __future__ import annotations

from caper_jax.prm.loss import LmAuxConfig, PairLossConfig
from caper_jax.sections import (ModelSettings, OptimSettings, TrainerSettings, WorldSettings, check_bucket_lengths,
                                check_positive, frozen)
from caper_jax.settings import one_of
from caper_jax.sql.tuples import AnnotationSettings


@frozen
class PrmData(WorldSettings):
    max_len: int
    bucket_lengths: tuple[int, ...]
    batch_size: int                  # global, in pairs
    within_batch_size: int           # within-trajectory groups per global batch (0: plain pairs)
    counterfactual_repeat: int
    eval_batch_size: int
    max_eval_tuples: int

    def __post_init__(self):
        super().__post_init__()
        check_bucket_lengths(self.bucket_lengths, self.max_len)
        if self.batch_size < 1 or self.eval_batch_size < 1:
            # Caught here, not after minutes of annotation.
            raise ValueError(f"data.batch_size={self.batch_size} and data.eval_batch_size="
                             f"{self.eval_batch_size} must be >= 1")
        if self.within_batch_size < 0:   # a multiple of the process count too: trainer.validate
            raise ValueError(f"data.within_batch_size={self.within_batch_size} must be >= 0")
        if self.counterfactual_repeat < 1:
            raise ValueError(f"data.counterfactual_repeat={self.counterfactual_repeat} must be >= 1")


@frozen
class PrmAnnotate:
    """configs/prm.py's ``annotate``: what ``AnnotationSettings`` takes, plus candidate contrasts."""
    per_query: int
    compound: int
    site_balance: str
    # The annotator's penalty at v* AND the pair loss's weight scale delta / alpha
    # (``PrmSettings.pair_loss`` passes it as ``PairLossConfig.annotation_alpha``): one setting, two uses.
    alpha: float
    sigma: float
    margin_floor: float
    within_trajectory: bool
    candidate_contrasts: bool
    max_vm_steps: int
    timeout_s: float
    suspect_tuples: bool
    semantics: str

    def __post_init__(self):
        one_of(self.semantics, ("spider", "bird"), "annotate.semantics")
        self.annotation(seed=0)   # alpha, sigma, floor, per_query, compound, site_balance

    def annotation(self, *, seed: int) -> AnnotationSettings:
        return AnnotationSettings(alpha=self.alpha, sigma=self.sigma, margin_floor=self.margin_floor,
                                  per_query=self.per_query, compound=self.compound, site_balance=self.site_balance,
                                  max_vm_steps=self.max_vm_steps, timeout_s=self.timeout_s,
                                  semantics=self.semantics, within_trajectory=self.within_trajectory, seed=seed,
                                  suspect_tuples=self.suspect_tuples)


@frozen
class PrmModel(ModelSettings):
    init_from: str                   # an SFT/GRPO run whose backbone the PRM starts from ("" = none)


@frozen
class PrmLoss:
    form: str                        # weighted | offset
    margin_weight: str               # linear | none
    offset_scale: float
    center_coef: float
    lm_coef: float                   # next-token loss on the chosen SQL (0: off)

    def __post_init__(self):
        LmAuxConfig(coef=self.lm_coef, marker_id=0)   # lm_coef >= 0


@frozen
class PrmSettings(TrainerSettings):
    data: PrmData
    annotate: PrmAnnotate
    model: PrmModel
    loss: PrmLoss
    optim: OptimSettings
    eval_every: int

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, ("eval_every",))
        self.pair_loss   # form / margin_weight / alpha

    @property
    def pair_loss(self) -> PairLossConfig:
        return PairLossConfig(form=self.loss.form, margin_weight=self.loss.margin_weight,
                              annotation_alpha=self.annotate.alpha, offset_scale=self.loss.offset_scale,
                              center_coef=self.loss.center_coef)

    @property
    def annotation(self) -> AnnotationSettings:
        return self.annotate.annotation(seed=self.seed)
