"""GRPO's prompt widths: a fixed ladder (``sampling.prompt_widths``) instead of every multiple of 64, and
the count of programs a whole run compiles (``caper_jax.rl.dry_run``)."""
from __future__ import annotations

import numpy as np
import pytest

from caper_jax.policy.prompts import check_prompt_widths, prompt_batch, prompt_width
from caper_jax.rl import dry_run as plan_lib
from caper_jax.rl.settings import GrpoSettings
from caper_jax.settings import from_config, replace
from configs.grpo import get_config


class WordTokenizer:
    """One token per word (ids from 5), pad 0: lengths are countable by eye."""
    pad_token_id, eos_token_id = 0, 1

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[5 + len(w) for w in t.split()] for t in texts]}


@pytest.mark.parametrize("widths, message", [
    ((), "strictly ascending"),
    ((512, 256, 1920), "strictly ascending"),
    ((512, 512, 1920), "strictly ascending"),
    ((0, 1920), "strictly ascending"),
    ((512, 1024), "must end at sampling.max_prompt_len=1920"),
])
def test_a_bad_ladder_is_refused(widths, message):
    with pytest.raises(ValueError, match=message):
        check_prompt_widths(widths, 1920)


def test_each_batch_takes_the_smallest_width_that_holds_its_longest_prompt():
    ladder = (4, 8, 12)
    assert [prompt_width(n, ladder) for n in (1, 4, 5, 8, 9, 12)] == [4, 4, 8, 8, 12, 12]
    ids, mask = prompt_batch(["a b c", "a b c d e"], WordTokenizer(), 12, widths=ladder)
    assert ids.shape == mask.shape == (2, 8)
    assert mask.sum(1).tolist() == [3, 5] and mask[0, :5].sum() == 0           # left padding
    assert ids[1, 3:].tolist() == [6] * 5 and ids[0, :5].tolist() == [0] * 5
    long = " ".join(["w"] * 20)                                                   # cut to max_prompt_len
    ids, mask = prompt_batch([long, "a"], WordTokenizer(), 12, widths=ladder)
    assert ids.shape == (2, 12) and mask[0].sum() == 12
    with pytest.raises(ValueError, match="must end"):
        prompt_batch(["a"], WordTokenizer(), 16, widths=ladder)


def test_the_9b_config_ladder_is_valid_and_ends_at_max_prompt_len():
    for arg in ("model=qwen35_9b", "model=tiny"):
        config = get_config(arg)
        assert check_prompt_widths(config.sampling.prompt_widths, config.sampling.max_prompt_len)


def test_programs_a_run_compiles_before_and_after_the_ladder():
    """Steps of 4 prompts whose longest prompt spreads over 100..900 tokens: rounding to 64 meets many
    widths (each one a compile of every program), the ladder at most its own length; the update compiles
    once more per width when steps that do not log skip the entropy."""
    config = get_config("model=qwen35_9b,variant=clause")
    config.rl.prompts_per_step, config.optim.total_steps = 4, 60
    config.prm.workdir = "(a PRM run)"   # the clause variant names one; nothing here reads it
    config = from_config(GrpoSettings, config)
    lengths = np.random.default_rng(0).integers(100, 900, 200).tolist()
    before = plan_lib.widths_over_run(lengths, config, plan_lib.rounded_width(64, 1920))
    after = plan_lib.widths_over_run(lengths, config, lambda n: prompt_width(n, config.sampling.prompt_widths))
    assert len(before) == len(after) == 60
    assert all(b % 64 == 0 and b <= a for b, a in zip(before, after))
    assert set(after) <= set(config.sampling.prompt_widths)
    # The width of a step is that of its longest prompt: recompute step 1 from the trainer's draw.
    from caper_jax.rl.trainer import prompt_iterator

    first = next(prompt_iterator(len(lengths), 4, config.seed))
    assert before[0] == -(-max(lengths[i] for i in first) // 64) * 64
    config = replace(config, {"log_every": 1})
    counts_before = plan_lib.programs_compiled(before, config, entropy_every_step=True)
    counts_after = plan_lib.programs_compiled(after, config)
    assert counts_before == dict.fromkeys(("prefill", "decode", "prm", "reference", "update"), len(set(before)))
    assert counts_after == dict.fromkeys(("prefill", "decode", "prm", "reference", "update"), len(set(after)))
    assert len(set(before)) > 6 and len(set(after)) <= 2
    config = replace(config, {"log_every": 10})   # steps 10, 20, ..., 60 log: one update per (width, logging)
    pairs = {(w, s % 10 == 0) for s, w in enumerate(after, start=1)}
    assert plan_lib.programs_compiled(after, config)["update"] == len(pairs) > len(set(after))
    config = replace(config, {"rl.beta": 0.0, "reward.variant": "sparse", "prm.workdir": ""})
    assert plan_lib.programs_compiled(after, config)["reference"] == plan_lib.programs_compiled(after, config)["prm"] == 0
