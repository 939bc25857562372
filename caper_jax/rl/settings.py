"""The GRPO trainer's settings (configs/grpo.py), built once by ``caper_jax.rl.trainer.validate``."""
from __future__ import annotations

from caper_jax.models.sampler import SamplingConfig
from caper_jax.policy.prompts import check_prompt_widths
from caper_jax.rl.advantages import STD_SCOPES
from caper_jax.rl.losses import AGGREGATIONS
from caper_jax.rl.rewards import reward_variant
from caper_jax.sections import ModelSettings, OptimSettings, TrainerSettings, WorldSettings, check_positive, frozen
from caper_jax.settings import one_of


@frozen
class GrpoData(WorldSettings):
    schema_values: int               # frequent text values per column in the prompt's schema


@frozen
class GrpoPolicy:
    sft_workdir: str                 # start from this SFT run's checkpoint ("" = model.hf_dir or a random preset)
    ckpt: int                        # its step; 0 = the newest that verifies


@frozen
class GrpoPrm:
    workdir: str                     # the PRM run scoring token/clause rewards ("" for sparse)
    ckpt: int                        # its step; 0 = the newest that verifies


@frozen
class GrpoReward:
    variant: str                     # sparse | token | clause
    correct: float                   # execution reward: result equals gold
    wrong: float                     # runs, wrong result
    failure: float                   # error, empty or unparseable SQL
    format_penalty: float            # extra penalty for unparseable SQL
    prm_weight: float                # PRM score scale vs the execution reward
    semantics: str                   # result comparison: spider | bird
    timeout_s: float
    max_rows: int

    def __post_init__(self):
        try:
            reward_variant(self.variant)
        except ValueError as error:
            raise ValueError(f"reward.variant: {error}") from None
        one_of(self.semantics, ("spider", "bird"), "reward.semantics")

    @property
    def uses_prm(self) -> bool:
        return reward_variant(self.variant).uses_prm


@frozen
class GrpoSampling:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_prompt_len: int
    prompt_widths: tuple[int, ...]   # the widths a step's prompts are padded to; the last is max_prompt_len

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for GRPO (greedy samples give no group signal)")
        SamplingConfig(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        check_prompt_widths(self.prompt_widths, self.max_prompt_len)


@frozen
class GrpoRl:
    group_size: int                  # G completions per prompt
    prompts_per_step: int
    update_epochs: int               # optimisation passes over each rollout (mu)
    num_minibatches: int             # optimizer steps per pass
    eps_low: float
    eps_high: float
    beta: float                      # KL to the reference; 0 skips the reference forward
    gamma: float
    agg: str
    scale_by_std: bool
    std_ddof: int                    # the std of the advantages' normalisation: 0 population, 1 sample
    std_eps: float                   # added to that std
    std_scope: str                   # that std pooled over the group's units or the batch's
    kl_bias_correction: bool         # k3 KL term multiplied by the ratio (TRL's use_bias_correction_kl)
    recompute_old_logp: bool         # old_logp from the first update's own forward, not the sampler (docs/grpo.md)
    tis_cap: float                   # truncated importance weight min(exp(old - sampler), cap); 0 = off

    def __post_init__(self):
        one_of(self.agg, AGGREGATIONS, "rl.agg")
        one_of(self.std_scope, STD_SCOPES, "rl.std_scope")
        if self.std_ddof not in (0, 1) or not self.std_eps > 0:
            raise ValueError(f"need rl.std_ddof 0 or 1 (got {self.std_ddof}) and rl.std_eps > 0 "
                             f"(got {self.std_eps})")
        if self.group_size < 2:
            raise ValueError(f"rl.group_size={self.group_size} must be >= 2 (advantages are group-relative)")
        rows = self.prompts_per_step * self.group_size
        if self.prompts_per_step < 1 or rows % self.num_minibatches:
            raise ValueError(f"prompts_per_step x group_size = {rows} rollouts must split into "
                             f"rl.num_minibatches={self.num_minibatches} equal minibatches")
        if self.update_epochs < 1 or self.beta < 0 or not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError("need rl.update_epochs >= 1, rl.beta >= 0, 0 <= rl.eps_low < 1, rl.eps_high >= 0")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"rl.gamma={self.gamma} must be in (0, 1]")
        if self.recompute_old_logp and self.num_minibatches != 1:
            # The first update's own forward gives the old log-probs: it must see the whole rollout.
            raise ValueError(f"rl.recompute_old_logp needs rl.num_minibatches=1 (got {self.num_minibatches})")
        if self.tis_cap < 0 or (self.tis_cap and not self.recompute_old_logp):
            # Without the recomputation old_logp is the sampler's own: the weight would be exp(0) = 1.
            raise ValueError(f"rl.tis_cap={self.tis_cap} must be >= 0 (0 = off), and > 0 needs rl.recompute_old_logp="
                             f"True (the weight is the trainer's old log-prob over the sampler's)")


@frozen
class GrpoEval:
    num_examples: int                # held-out greedy EX at the end (0: none)
    batch_size: int


@frozen
class GrpoSettings(TrainerSettings):
    data: GrpoData
    model: ModelSettings             # the starting policy when not policy.sft_workdir, and the runtime
    chunk_size: int
    policy: GrpoPolicy
    prm: GrpoPrm
    reward: GrpoReward
    sampling: GrpoSampling
    rl: GrpoRl
    optim: OptimSettings
    eval: GrpoEval

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, ("chunk_size",))
        if self.reward.uses_prm and not self.prm.workdir:
            raise ValueError(f"reward.variant={self.reward.variant!r} needs prm.workdir (a PRM trainer workdir)")
        if self.policy.sft_workdir and self.model.hf_dir:
            raise ValueError("set at most one of policy.sft_workdir and model.hf_dir (the starting policy)")
        if self.data.schema_values and self.reward.uses_prm:
            # The PRM scores the policy's prompt + SQL as it was trained: on tuples, whose schema text never
            # lists values (the annotator serialises schemas with 0). Another schema text is off its data.
            raise ValueError(f"data.schema_values={self.data.schema_values} with reward.variant="
                             f"{self.reward.variant!r}: the Clause-PRM was trained on schemas without values "
                             f"(its tuples always use 0); set data.schema_values=0 or use reward.variant=sparse")

