"""bench/model.py's two-process measurement: the PyTorch side runs in bench/_torch_worker.py, and the
figures it returns are transformers' own (the loss and the greedy tokens match caper_jax's on the same
checkpoint, as they do in one process: tests/models/test_qwen35_parity.py)."""
import numpy as np
import pytest

from caper_jax.models import from_hf
from tests.helpers import TINY_HF_CONFIGS


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_the_torch_worker_trains_and_decodes_the_checkpoint_caper_jax_loads(tmp_path):
    from bench.model import TorchWorker, bench_decode, bench_train

    config = TINY_HF_CONFIGS["untied"]
    rng = np.random.default_rng(0)
    with TorchWorker(threads=1) as worker:
        assert worker.call("build", path=str(tmp_path), config=config, seed=0) > 0
        jax_model, _ = from_hf(str(tmp_path), dtype="float32")
        ids = rng.integers(0, config["vocab_size"], (2, 24), dtype=np.int32)
        train = bench_train(worker, jax_model, ids, repeats=1)
        assert train["loss_diff"] < 1e-5
        assert train["torch_s"] > 0 and train["torch_cpu_s"] > 0
        prompts = rng.integers(1, config["vocab_size"], (2, 8), dtype=np.int32)
        decode = bench_decode(worker, jax_model, prompts, new_tokens=6, repeats=1)
        assert decode["token_agreement"] == 1.0
        with pytest.raises(RuntimeError, match="unknown command"):
            worker.call("_train_step")
        with pytest.raises(RuntimeError, match="negative dimension"):
            worker.call("gemm", n=-1, repeats=1)   # PyTorch's own error, raised here with its traceback
        assert worker.call("version").startswith("2.")
    assert worker._process.returncode == 0


def test_interleaved_times_each_side_right_after_an_untimed_run_of_its_own():
    from bench.model import interleaved

    calls = []
    torch_seconds = iter([(9.0, 9.0), (1.0, 2.0), (9.0, 9.0), (3.0, 4.0), (9.0, 9.0), (2.0, 3.0)])

    def torch_step():
        calls.append("torch")
        return next(torch_seconds)

    times = interleaved(lambda: calls.append("jax"), torch_step, repeats=3, settle=1)
    assert calls == ["jax", "jax", "torch", "torch"] * 3
    # Only the second run of each pair is timed: the 9 s settling runs are in no median.
    assert (times["torch_s"], times["torch_cpu_s"]) == (2.0, 3.0)
    assert 0 <= times["jax_s"] < 1.0
    calls.clear()
    interleaved(lambda: calls.append("jax"), lambda: calls.append("torch") or (1.0, 1.0), repeats=2, settle=0)
    assert calls == ["jax", "torch"] * 2
