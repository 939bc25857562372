"""``python -m caper_jax.train`` for tests/parallel/test_multiprocess.py, with two observation hooks.

The run itself is the real entry point (same flags, same trainer). The hooks only watch or stall it:

* every process prints one line ``MP_WORKER {"process": i, "resumed_step": s}`` after the resume
  decision (``s`` = -1 when it started fresh), so the test can check that all hosts agree;
* ``CAPER_TEST_HANG=P:N`` makes process ``P`` stop before feeding the batch of its N-th step
  and wait (after writing ``<workdir>/hung_<process>``), like a host that froze, so the test can
  SIGKILL it at a known point instead of racing a fast training loop.
"""
from __future__ import annotations

import json
import os
import pathlib
import time

from absl import app, flags

from caper_jax import checkpoint as ckpt_lib
from caper_jax import train
from caper_jax.parallel import multihost


def _report_resume() -> None:
    restore_latest = ckpt_lib.Checkpointer.restore_latest

    def wrapped(self, *args, **kwargs):
        restored = restore_latest(self, *args, **kwargs)
        import jax

        step = -1 if restored is None else restored.step
        print("MP_WORKER " + json.dumps({"process": jax.process_index(), "resumed_step": step}), flush=True)
        return restored

    ckpt_lib.Checkpointer.restore_latest = wrapped


def _hang_at(step: int) -> None:
    to_global = multihost.host_local_to_global
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == step:
            import jax

            workdir = pathlib.Path(flags.FLAGS.workdir)
            (workdir / f"hung_{jax.process_index()}").write_text(str(step))
            print(f"MP_WORKER hanging before step {step}", flush=True)
            time.sleep(3600)
        return to_global(*args, **kwargs)

    multihost.host_local_to_global = wrapped


if __name__ == "__main__":
    _report_resume()
    hang_process, _, hang_step = os.environ.get("CAPER_TEST_HANG", "").partition(":")
    if hang_process and hang_process == os.environ.get("JAX_PROCESS_ID"):
        _hang_at(int(hang_step))
    app.run(train.main, flags_parser=train.parse_flags)
