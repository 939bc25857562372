"""The SFT trainer's settings (configs/sft.py), built once by ``caper_jax.sft.trainer.validate``."""
from __future__ import annotations

from caper_jax.sections import (ModelSettings, OptimSettings, TrainerSettings, WorldSettings, check_bucket_lengths,
                                check_positive, frozen)


@frozen
class SftData(WorldSettings):
    max_len: int                     # prompt + SQL + stop; prompts are cut from the left
    bucket_lengths: tuple[int, ...]
    batch_size: int                  # global, in sequences (a multiple of the process count: trainer.validate)
    schema_values: int               # frequent text values per column in the schema prompt

    def __post_init__(self):
        super().__post_init__()
        check_bucket_lengths(self.bucket_lengths, self.max_len)


@frozen
class SftEval:
    num_examples: int                # held-out slice of eval_split for greedy EX (0: none)
    batch_size: int
    max_prompt_len: int
    max_new_tokens: int
    timeout_s: float

    def __post_init__(self):
        if self.num_examples < 0 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("eval.num_examples must be >= 0, eval.batch_size and eval.max_new_tokens >= 1")


@frozen
class SftSettings(TrainerSettings):
    data: SftData
    model: ModelSettings
    chunk_size: int                  # sequence positions per log-prob chunk (policy/logprobs.py)
    optim: OptimSettings
    eval: SftEval

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, ("chunk_size",))
