"""The whole-GRPO-step dry run (caper_jax.rl.dry_run) on the tiny preset, 2 simulated devices:
every program compiles with the real run's placement, and the accounting adds up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import simulated_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _repeated_prompts_prefill_flops(settings) -> float:
    """Matmul FLOPs of the prefill the trainer ran before each prompt was prefilled once: the prompts
    repeated to their G rows, group_size 1 (traced only, no compile)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from caper_jax.loop import dry_run_architecture
    from caper_jax.models import Qwen35ForCausalLM
    from caper_jax.models.sampler import _prefill
    from caper_jax.parallel.dry_run import jaxpr_matmul_flops

    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(dry_run_architecture(settings), rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    rows = settings.rl.prompts_per_step * settings.rl.group_size
    ids = jax.ShapeDtypeStruct((rows, settings.sampling.max_prompt_len), jnp.int32)
    traced = _prefill.trace(graphdef, params, ids, ids, max_len=ids.shape[1] + settings.sampling.max_new_tokens,
                            cache_dtype="float32")
    return jaxpr_matmul_flops(traced.jaxpr.jaxpr)


def _child() -> dict:
    from caper_jax.rl import dry_run as plan_lib
    from caper_jax.parallel.mesh import make_mesh
    from caper_jax.rl.trainer import validate
    from configs.grpo import get_config

    config = get_config("model=tiny,variant=clause")
    config.model.dtype = "bfloat16"   # as the 9B config: the frozen PRM and reference held in bf16
    config.prm.workdir = "(dry run)"
    config.sampling.max_prompt_len, config.sampling.max_new_tokens = 16, 4
    config.sampling.prompt_widths = (16,)   # the ladder ends at max_prompt_len (checked by the settings)
    config.rl.group_size, config.rl.prompts_per_step, config.rl.num_minibatches = 2, 2, 2
    settings = validate(config)
    result = plan_lib.plan(settings, make_mesh((1, -1, 1)), print_fn=None)
    out = {k: v for k, v in result.items() if k != "programs"}
    out["repeated_prompts_prefill_flops"] = _repeated_prompts_prefill_flops(settings)
    out["programs"] = {k: v.as_dict() for k, v in result["programs"].items()}
    out["update_epochs"] = config.rl.update_epochs
    return out


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_grpo_step_programs_and_resident_memory():
    env = simulated_devices_env(2)
    proc = subprocess.run([sys.executable, "-m", "tests.rl.test_dry_run", "child"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    programs, persistent = result["programs"], result["persistent"]
    assert list(programs) == ["prefill", "decode", "prm", "reference", "update"]
    assert result["rows"] == 4 and result["minibatch_rows"] == 2 and result["devices"] == 2
    # fp32 AdamW: two moments per parameter (plus a few counters); the reference is a copy of the policy.
    assert 2 * persistent["policy_params"] <= persistent["optimizer_state"] < 2 * persistent["policy_params"] + 64
    # The reference and the PRM keep their matmul weights in the bf16 compute dtype (frozen_params): a little
    # over half the fp32 policy's bytes (norms, A_log, dt_bias, the LM head / score head stay fp32).
    assert 0.5 * persistent["policy_params"] < persistent["reference_params"] < 0.75 * persistent["policy_params"]
    assert 0 < persistent["prm_params"] < 0.6 * persistent["policy_params"]
    uses = {"prefill": {"policy_params"}, "decode": {"policy_params"}, "prm": {"prm_params"},
            "reference": {"reference_params"}, "update": {"policy_params", "optimizer_state"}}
    for name, figures in programs.items():
        others = sum(v for k, v in persistent.items() if k not in uses[name])
        assert figures["resident_bytes"] == figures["memory"]["peak_bytes"] + others, name
        assert figures["matmul_flops"] > 0, name
    # Each of the 2 prompts prefilled once, its cache repeated to its G = 2 rows: half the FLOPs of
    # prefilling the 4 repeated rows (matmul FLOPs are linear in rows).
    assert programs["prefill"]["tokens"] == 2 * 16 and programs["prefill"]["rows"] == 4
    assert programs["prefill"]["matmul_flops"] * 2 == result["repeated_prompts_prefill_flops"]
    assert programs["decode"]["tokens"] == 4 * 3
    assert programs["prm"]["tokens"] == programs["reference"]["tokens"] == 4 * 20
    # The PRM program's output: the 4 completions' scores only, [4, 4] fp32 (not [4, 20]).
    assert programs["prm"]["memory"]["output_bytes"] <= 4 * 4 * 4
    assert programs["update"]["rows"] == 2 and programs["update"]["calls"] == 2 * result["update_epochs"]
    # The decode loop's FLOPs are one token step x 3 trips: below the 20-token forward of the reference.
    assert programs["decode"]["matmul_flops"] < programs["reference"]["matmul_flops"]
    assert programs["decode"]["memory"]["alias_bytes"] > 0           # the cache is donated and updated in place
    assert programs["update"]["memory"]["alias_bytes"] > 0           # the train state too


if __name__ == "__main__":
    print(json.dumps({"child": _child}[sys.argv[1]](), default=str))
