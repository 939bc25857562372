"""The policy evaluation's settings (configs/eval.py), built once by ``caper_jax.eval.validate.validate``;
the experiments hold one as their ``eval`` stage."""
from __future__ import annotations

from caper_jax.prm.aggregates import AGGREGATES
from caper_jax.sections import MeshSettings, frozen
from caper_jax.sql.semantics import check_semantics


@frozen
class EvalPolicy:
    workdir: str                     # SFT/GRPO trainer workdir: newest whole checkpoint, params only
    hf_dir: str                      # or an HF Qwen3.5 directory (exactly one of the two: validate)
    dtype: str                       # compute dtype; "" = the training config's (HF: float32)


@frozen
class EvalPrm:
    path: str                        # PRM workdir or HF export; "" = no reranking
    batch_size: int                  # queries per PRM forward
    max_len: int                     # 0 = the PRM's training max_len
    aggregates: tuple[str, ...]

    def __post_init__(self):
        unknown = [a for a in self.aggregates if a not in AGGREGATES]
        if unknown or not self.aggregates:
            raise ValueError(f"prm.aggregates={self.aggregates}; expected a non-empty subset of {AGGREGATES}")


@frozen
class EvalData:
    dir: str                         # "" = the policy's training data
    split: str
    num_examples: int                # 0 = every usable example; else a seeded subset
    schema_values: int               # -1 = as the policy was trained
    semantics: str                   # spider | spider_official | bird

    def __post_init__(self):
        check_semantics(self.semantics, what="data.semantics")


@frozen
class EvalSampling:
    k: int                           # samples per question for MV@k and best-of-k (0: greedy only)
    temperature: float
    top_p: float
    top_k: int
    max_prompt_len: int
    max_new_tokens: int
    batch_size: int                  # sequences per sampler call

    def __post_init__(self):
        if self.temperature <= 0 and self.k > 0:
            raise ValueError("sampling.temperature must be > 0 for k samples (greedy decoding is always evaluated)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1] and sampling.top_k={self.top_k} >= 0")


@frozen
class EvalSettings(MeshSettings):
    seed: int                        # example subset and sampling keys
    timeout_s: float                 # per query, sandboxed SQLite
    policy: EvalPolicy
    prm: EvalPrm
    data: EvalData
    sampling: EvalSampling

    def __post_init__(self):
        super().__post_init__()
        s = self.sampling
        if s.k < 0 or s.batch_size < 1 or s.max_new_tokens < 1 or s.max_prompt_len < 1 or self.prm.batch_size < 1:
            raise ValueError("sampling.k must be >= 0; sampling.batch_size, max_new_tokens, max_prompt_len and "
                             "prm.batch_size >= 1")
        if self.data.num_examples < 0 or self.prm.max_len < 0 or self.timeout_s <= 0:
            raise ValueError("data.num_examples and prm.max_len must be >= 0, timeout_s > 0")
