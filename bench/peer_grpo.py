"""caper_jax's GRPO loss and advantages against TRL 1.16's and tunix 0.1.7's own functions, same inputs.

What is called on each side (no formula is re-typed from the peers):

* caper_jax: ``caper_jax.rl.losses.grpo_loss`` and ``caper_jax.rl.advantages.clause_advantages`` (one
  unit per row: outcome GRPO), with the conventions set to the peer's through their arguments, which
  are the trainer's settings ``rl.agg``, ``rl.kl_bias_correction``, ``rl.std_ddof``, ``rl.std_eps``,
  ``rl.std_scope`` (docs/grpo.md "TRL and tunix").
* TRL: ``GRPOTrainer._compute_loss`` of a GRPOTrainer built around a random 1-layer Llama (no download),
  saved to a temporary folder (TRL loads its reference model from the policy's path), its
  ``_get_per_token_logps_and_entropies`` replaced by one that returns the given log-probs as a
  leaf tensor, so the gradient read is d loss / d log-probs. TRL's advantages are inline code in
  ``_generate_and_score_completions`` (no function to call): they are formed here as those lines do,
  with TRL's own ``trl.trainer.utils.nanstd`` and its 1e-4.
* tunix: ``tunix.rl.algo_core.grpo_loss_fn`` on an ``nnx.Module`` whose one parameter is the log-prob
  array, ``tunix.rl.common.compute_per_token_logps`` replaced by one that returns that parameter (so
  ``jax.grad`` over the module's state is d loss / d log-probs), ``kl_loss_mode="low_var_kl"`` (k3; the
  GRPOConfig default is ``"kl"``, logp − ref); and ``tunix.rl.algo_core.compute_advantages``.

Inputs: 2 groups × G = 4 rows, 12 completion tokens, random log-probs (old and reference within
±0.3 of them, so some ratios leave the clip range), random token advantages, ragged masks; β = 0.04,
ε_low 0.2, ε_high 0.28. Three input sets: every row has tokens; one row fully masked; NaN log-probs at
padded positions. It prints max |Δ| of the loss and of its gradient with respect to the log-probs per
mode, and max |Δ| of the advantages per convention.

Install (its own venv: TRL and tunix each pull a transformers that is not the project's; caper_jax's
GRPO core needs only jax, and tunix 0.1.7 brings the project's jax 0.10.2, checked at start, so
caper_jax runs in the same process from the repository on sys.path, not installed):

    python3.11 -m venv /work/venvs/peers
    /work/venvs/peers/bin/pip install trl==1.16.0 google-tunix==0.1.7 torch==2.13.0   # torch: the CPU wheel
    JAX_PLATFORMS=cpu /work/venvs/peers/bin/python bench/peer_grpo.py

Never an unpinned torch (a multi-GB CUDA build). Takes about a minute on 2 cores; its figures are
deviations, not speeds, but the load average is printed with them.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from caper_jax.rl.advantages import clause_advantages  # noqa: E402
from caper_jax.rl.losses import AGGREGATIONS, grpo_loss  # noqa: E402

BATCH, GROUP, LENGTH = 8, 4, 12
BETA, EPS_LOW, EPS_HIGH = 0.04, 0.2, 0.28

# caper_jax's agg -> (TRL loss_type(s), tunix loss_agg_mode(s)) that compute the same reduction
# (docs/grpo.md's table says where empty rows make them differ).
PEERS = {
    "token-mean": (("bnpo", "dapo"), ("token-mean",)),
    "sequence-mean-token-mean": (("grpo",), ("sequence-mean-token-mean",)),
    "sequence-mean-token-sum": (("luspo",), ("seq-mean-token-sum", "sequence-mean-token-sum-norm")),
    "sequence-mean-token-sum-norm": (("dr_grpo",), ("sequence-mean-token-scale",)),
}


def check_jax_pin():
    """The project's jax pin (requirements.txt) must be the jax of this venv, or the figures are not
    caper_jax's as it runs."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pin = re.search(r"^jax==([\w.]+)", f.read(), re.M)
    if pin and pin.group(1) != jax.__version__:
        sys.exit(f"error: this venv has jax {jax.__version__}, the project pins {pin.group(1)}")


def make_inputs(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 0.5, (BATCH, LENGTH)).astype(np.float32)
    old = (logp + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32)
    ref = (logp + rng.uniform(-0.3, 0.3, logp.shape)).astype(np.float32)
    adv = rng.normal(size=logp.shape).astype(np.float32)
    lengths = rng.integers(3, LENGTH + 1, BATCH)
    lengths[0] = LENGTH                         # one full row: dr_grpo's max_completion_length is T
    if kind == "empty row":
        lengths[3] = 0
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.float32)
    if kind == "NaN at padding":
        logp = np.where(mask > 0, logp, np.nan).astype(np.float32)
    return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask)


def caper(x, agg: str, kl_bias_correction: bool):
    def loss_fn(logp):
        return grpo_loss(logp, jnp.asarray(x["old"]), jnp.asarray(x["ref"]), jnp.asarray(x["adv"]),
                         jnp.asarray(x["mask"]), eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, agg=agg,
                         kl_bias_correction=kl_bias_correction)[0]
    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(x["logp"]))
    return float(loss), np.asarray(grad)


class TrlLoss:
    """TRL's ``_compute_loss`` on given log-probs: one GRPOTrainer per (loss_type, bias correction)."""

    def __init__(self):
        import torch
        import transformers
        from datasets import Dataset
        from tokenizers import Tokenizer, models
        from trl import GRPOConfig, GRPOTrainer

        self.torch, self.GRPOConfig, self.GRPOTrainer, self.Dataset = torch, GRPOConfig, GRPOTrainer, Dataset
        torch.manual_seed(0)
        vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}
        self.tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), pad_token="<pad>", eos_token="<eos>")
        config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=8, intermediate_size=16,
                                          num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
        self.workdir = tempfile.mkdtemp(prefix="peer_grpo_trl_")
        # A path, not the module: with beta > 0 TRL builds its reference model from the policy's path.
        self.model_dir = os.path.join(self.workdir, "tiny_llama")
        transformers.LlamaForCausalLM(config).save_pretrained(self.model_dir)
        self.trainers = {}

    def trainer(self, loss_type: str, bias_correction: bool):
        key = (loss_type, bias_correction)
        if key not in self.trainers:
            args = self.GRPOConfig(
                output_dir=self.workdir, per_device_train_batch_size=BATCH, num_generations=GROUP,
                max_completion_length=LENGTH, beta=BETA, epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
                loss_type=loss_type, use_bias_correction_kl=bias_correction, report_to=[], use_cpu=True,
                bf16=False, logging_steps=1)
            trainer = self.GRPOTrainer(
                model=self.model_dir, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                train_dataset=self.Dataset.from_dict({"prompt": ["a b"] * BATCH}), processing_class=self.tokenizer)
            trainer.current_gradient_accumulation_steps = 1   # set by Trainer's training loop otherwise
            trainer.model.train()
            self.trainers[key] = trainer
        return self.trainers[key]

    def __call__(self, x, loss_type: str, bias_correction: bool):
        torch = self.torch
        trainer = self.trainer(loss_type, bias_correction)
        logp = torch.tensor(x["logp"], requires_grad=True)
        trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, torch.zeros_like(logp), None)
        mask = torch.tensor(x["mask"])
        inputs = {
            "prompt_ids": torch.full((BATCH, 2), 2), "prompt_mask": torch.ones(BATCH, 2, dtype=torch.long),
            "completion_ids": torch.full((BATCH, LENGTH), 3), "completion_mask": mask,
            "advantages": torch.tensor(x["adv"]), "old_per_token_logps": torch.tensor(x["old"]),
            "ref_per_token_logps": torch.tensor(x["ref"]), "num_items_in_batch": mask.sum(),
        }
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        grad = logp.grad.numpy() if logp.grad is not None else np.full(logp.shape, np.nan)
        return float(loss.detach()), grad

    def advantages(self, rewards: np.ndarray, scale: str) -> np.ndarray:
        """``_generate_and_score_completions``' sum_then_normalize branch, with TRL's ``nanstd``."""
        from trl.trainer.utils import nanstd
        torch = self.torch
        r = torch.tensor(rewards)
        mean = r.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)
        std = nanstd(r.view(-1, GROUP), dim=1).repeat_interleave(GROUP) if scale == "group" else \
            nanstd(r).expand_as(r)
        return torch.nan_to_num((r - mean) / (std + 1e-4), nan=0.0).numpy()


class TunixLoss:
    """tunix's ``grpo_loss_fn`` with the log-probs as the model's one parameter."""

    def __init__(self):
        from flax import nnx
        from tunix.rl import algo_core, common
        from tunix.rl.grpo.grpo_learner import GRPOConfig

        self.nnx, self.algo_core, self.common, self.GRPOConfig = nnx, algo_core, common, GRPOConfig

        class LogProbs(nnx.Module):
            def __init__(self, value):
                self.logp = nnx.Param(jnp.asarray(value))

        self.LogProbs = LogProbs

        def given_logps(graphdef, state, **kwargs):
            logp = nnx.merge(graphdef, state).logp[...]
            return logp, jnp.zeros(logp.shape + (2,), jnp.float32)   # logits: only its entropy metric reads them

        common.compute_per_token_logps = given_logps

    def __call__(self, x, mode: str):
        nnx = self.nnx
        config = self.GRPOConfig(loss_agg_mode=mode, num_generations=GROUP, beta=BETA, epsilon=EPS_LOW,
                                 kl_loss_mode="low_var_kl")
        config.epsilon_high = EPS_HIGH      # read with hasattr, not a GRPOConfig field in 0.1.7
        config.temperature = 1.0            # set by GRPOLearner from the rollout config otherwise
        example = self.common.TrainExample(
            prompt_ids=jnp.full((BATCH, 2), 2), prompt_mask=jnp.ones((BATCH, 2), jnp.int32),
            completion_ids=jnp.full((BATCH, LENGTH), 3), completion_mask=jnp.asarray(x["mask"]),
            advantages=jnp.asarray(x["adv"]), ref_per_token_logps=jnp.asarray(x["ref"]),
            old_per_token_logps=jnp.asarray(x["old"]))
        graphdef, state = nnx.split(self.LogProbs(x["logp"]))

        def loss_fn(state):
            return self.algo_core.grpo_loss_fn(nnx.merge(graphdef, state), example, config, pad_id=0, eos_id=1)[0]

        loss, grad = jax.value_and_grad(loss_fn)(state)
        return float(loss), np.asarray(grad["logp"][...])


def delta(a, b) -> str:
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return "NaN (" + ("peer" if np.all(np.isfinite(a)) else "ours") + ")"
    return f"{np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max():.1e}"


def main():
    logging.disable(logging.WARNING)
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import transformers
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    check_jax_pin()
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")
    trl, tunix = TrlLoss(), TunixLoss()
    import trl as trl_package
    import tunix as tunix_package  # noqa: F401
    from importlib.metadata import version
    print(f"trl {trl_package.__version__}, google-tunix {version('google-tunix')}, jax {jax.__version__}, "
          f"torch {trl.torch.__version__}")

    print("\n## Loss: max |Δ loss|, max |Δ d loss / d logp| against caper_jax (beta 0.04, eps 0.2 / 0.28)\n")
    print("k3: `rl.kl_bias_correction=False` against TRL `use_bias_correction_kl=False` and tunix "
          "(`kl_loss_mode=\"low_var_kl\"`); ρ·k3: `True` against TRL `True` (tunix has no such option).\n")
    print("| inputs | caper_jax `agg` | peer | Δ loss, k3 | Δ gradient, k3 | Δ loss, ρ·k3 | Δ gradient, ρ·k3 |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("every row has tokens", "empty row", "NaN at padding"):
        x = make_inputs(kind)
        for agg in AGGREGATIONS:
            trl_types, tunix_modes = PEERS[agg]
            ours = {correction: caper(x, agg, correction) for correction in (False, True)}
            peers = [(f"TRL `{t}`", {c: trl(x, t, c) for c in (False, True)}) for t in trl_types]
            peers += [(f"tunix `{m}`", {False: tunix(x, m)}) for m in tunix_modes]
            for name, theirs in peers:
                cells = []
                for correction in (False, True):
                    if correction in theirs:
                        cells += [delta(ours[correction][0], theirs[correction][0]),
                                  delta(ours[correction][1], theirs[correction][1])]
                    else:
                        cells += ["—", "—"]
                print(f"| {kind} | `{agg}` | {name} | " + " | ".join(cells) + " |")
    x = make_inputs("every row has tokens")
    unmatched = delta(caper(x, "token-mean", False)[1], trl(x, "dapo", True)[1])
    print(f"\nThe defaults unmatched (caper_jax k3, TRL `dapo` with its default ρ·k3), every row has tokens: "
          f"max |Δ gradient| {unmatched}")

    print("\n## Advantages (one reward per row, 2 groups of 4; group 1's rewards all equal): max |Δ|\n")
    print("| caper_jax settings | peer | max abs Δ |")
    print("|---|---|---|")
    rewards = np.array([0.3, 1.0, 0.0, 0.7, 0.5, 0.5, 0.5, 0.5], np.float32)

    def ours(**conventions):
        out = clause_advantages(jnp.asarray(rewards[:, None]), jnp.ones((BATCH, 1), bool),
                                jnp.zeros((BATCH, 1), jnp.int32), jnp.ones((BATCH, 1), bool), group_size=GROUP,
                                **conventions)
        return np.asarray(out)[:, 0]

    tunix_adv = np.asarray(tunix.algo_core.compute_advantages(rewards, GROUP))
    rows = [
        ("std_ddof=1, std_eps=1e-6", ours(std_ddof=1, eps=1e-6), "tunix `compute_advantages`", tunix_adv),
        ("std_ddof=0, std_eps=1e-6 (default)", ours(), "tunix `compute_advantages`", tunix_adv),
        ("std_ddof=1, std_eps=1e-4", ours(std_ddof=1, eps=1e-4), 'TRL scale_rewards="group"',
         trl.advantages(rewards, "group")),
        ('std_ddof=1, std_eps=1e-4, std_scope="batch"', ours(std_ddof=1, eps=1e-4, std_scope="batch"),
         'TRL scale_rewards="batch"', trl.advantages(rewards, "batch")),
        ("std_ddof=0, std_eps=1e-6 (default)", ours(), 'TRL scale_rewards="group"', trl.advantages(rewards, "group")),
    ]
    for settings, mine, peer, theirs in rows:
        print(f"| {settings} | {peer} | {delta(mine, theirs)} |")
    print(f"\nload average at end: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
