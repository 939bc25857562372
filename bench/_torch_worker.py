"""bench/model.py's PyTorch side, in a process of its own (it never imports JAX).

Why a second process: the JAX side should run as a trainer does, in a process that never imported
PyTorch and whose heap only JAX uses. (The one-process bench's JAX steps were slower than a JAX-only
process's for another reason, which a second process alone does not remove: the first step after
the other library's step pays 2-3x the system time for the same page faults; bench/model.py's
``interleaved`` times each side after an untimed run of its own. BENCHMARKS.md has the figures.)
The parent alternates the two sides' runs so that both see the same machine.

Protocol: the parent writes pickled ``(command, kwargs)`` to this process's input pipe and reads one
pickled ``("ok", result)`` or ``("error", traceback)`` per command. Every timed command times itself
here, so the pipe's latency is in neither side's figure.

    python -m bench._torch_worker IN_FD OUT_FD THREADS     # started by bench/model.py's TorchWorker
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback

import numpy as np
import torch

from bench._common import median_time, wall_and_cpu_s


class TorchSide:
    """The PyTorch model and every PyTorch measurement bench/model.py makes."""

    def __init__(self) -> None:
        self.model = None
        self.train_ids = None
        self.decode_args = None

    def version(self) -> str:
        return torch.__version__

    def build(self, path: str, config: dict, seed: int) -> int:
        """Builds transformers' Qwen3.5 with random weights, saves it to ``path``; returns its size."""
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        torch.manual_seed(seed)
        self.model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()
        self.model.save_pretrained(path)
        return sum(p.numel() for p in self.model.parameters())

    def gemm(self, n: int, repeats: int) -> float:
        t = torch.randn(n, n)
        torch.matmul(t, t)
        return 2.0 * n**3 / median_time(lambda: torch.matmul(t, t), repeats) / 1e9

    def stream(self, nbytes: int, repeats: int) -> float:
        t = torch.ones(nbytes // 4)
        t.sum()
        return nbytes / median_time(t.sum, repeats) / 1e9

    def gemv(self, batch: int, k: int, n: int, repeats: int) -> float:
        x, w = torch.ones(batch, k), torch.ones(k, n)
        torch.matmul(x, w)
        return k * n * 4 / median_time(lambda: torch.matmul(x, w), repeats) / 1e9

    def train_prepare(self, ids: np.ndarray) -> float:
        """Puts the model in train mode for ``ids``; runs (and returns the loss of) one warm-up step."""
        self.model.train()
        self.train_ids = torch.from_numpy(ids).long()
        return self._train_step()

    def train_step(self) -> tuple[float, float]:
        return wall_and_cpu_s(self._train_step)

    def train_finish(self) -> None:
        self.model.eval()

    def _train_step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.train_ids, labels=self.train_ids).loss
        loss.backward()
        return float(loss.detach())

    def decode_prepare(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        """Greedy-decodes ``prompts`` once (the warm-up); returns the new tokens."""
        ids = torch.from_numpy(prompts).long()
        self.decode_args = dict(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )
        return self._generate()[:, prompts.shape[1]:].numpy()

    def decode(self) -> tuple[float, float]:
        return wall_and_cpu_s(self._generate)

    @torch.no_grad()
    def _generate(self):
        return self.model.generate(**self.decode_args)


def serve(inbox, outbox) -> None:
    side = TorchSide()
    while True:
        try:
            command, kwargs = pickle.load(inbox)
        except EOFError:                     # the parent went away
            return
        if command == "stop":
            return
        try:
            if command.startswith("_") or not hasattr(side, command):
                raise ValueError(f"unknown command {command!r}")
            reply = ("ok", getattr(side, command)(**kwargs))
        except Exception:                    # sent back: the parent raises it with this traceback
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, outbox)
        outbox.flush()


if __name__ == "__main__":
    in_fd, out_fd, threads = map(int, sys.argv[1:4])
    torch.set_num_threads(threads)
    with os.fdopen(in_fd, "rb") as inbox, os.fdopen(out_fd, "wb") as outbox:
        serve(inbox, outbox)
