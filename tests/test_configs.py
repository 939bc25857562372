"""What the configs' variants set, where a wrong default would cost a pod run rather than fail a test."""
import pytest

from configs import grpo, prm, reproduce, sft


@pytest.mark.parametrize("config_module", [prm, sft, grpo])
def test_the_9b_presets_compute_in_bfloat16_over_fp32_parameters(config_module):
    """configs/prm.py:model=qwen35_9b trained in fp32 unless --config.model.dtype=bfloat16 was given by
    hand, while the SFT and GRPO configs (and the 9B memory plan of docs/scale.md) use bf16 compute."""
    big, tiny = config_module.get_config("model=qwen35_9b"), config_module.get_config("model=tiny")
    assert (big.model.dtype, big.model.param_dtype) == ("bfloat16", "float32")
    assert (tiny.model.dtype, tiny.model.param_dtype) == ("float32", "float32")


def test_the_full_reproduction_runs_every_stage_in_bfloat16():
    config = reproduce.get_config("full")
    assert [config[stage].model.dtype for stage in ("sft", "prm", "grpo")] == ["bfloat16"] * 3
