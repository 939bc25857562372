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


@pytest.mark.parametrize("args, message", [
    # The Clause-PRM was trained on tuples, whose schema text never lists values (data.schema_values 0).
    (["--config=configs/grpo.py:variant=clause", "--config.prm.workdir=/nonexistent/prm",
      "--config.data.schema_values=3"],
     "error: invalid config: data.schema_values=3 with reward.variant='clause': the Clause-PRM was trained on "
     "schemas without values"),
    (["--config=configs/grpo.py:variant=token", "--config.prm.workdir=/nonexistent/prm",
      "--config.data.schema_values=1"], "data.schema_values=1 with reward.variant='token'"),
    (["--config=configs/grpo.py", "--config.sampling.max_prompt_len=256"],
     "error: invalid config: sampling.prompt_widths=[64, 128, 192] must end at sampling.max_prompt_len=256"),
    (["--config=configs/grpo.py", "--config.sampling.prompt_widths=(128,64,192)"],
     "sampling.prompt_widths=[128, 64, 192] must be strictly ascending"),
])
def test_grpo_refuses_with_one_line(args, message, tmp_path):
    from tests.helpers import run_train

    result = run_train(*args, tmp_path=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "w").exists()


def test_grpo_without_the_prm_may_show_schema_values():
    """The sparse variant reads no PRM: schema values in its prompts are the policy's business."""
    from caper_jax.rl.trainer import validate

    config = grpo.get_config("variant=sparse")
    config.data.schema_values = 3
    validate(config)
