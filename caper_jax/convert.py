"""Qwen3.5 checkpoint conversion: transformers safetensors <-> orbax, and a parity check.

    python -m caper_jax.convert hf-to-orbax --hf_dir D --out O [--dtype bfloat16]
    python -m caper_jax.convert orbax-to-hf --ckpt O --out D2 [--max_shard_gb 5]
    python -m caper_jax.convert verify --hf_dir D [--batch 2 --seq_len 96 --new_tokens 16]

An orbax checkpoint here is a directory with `params/` (orbax StandardSave of the parameter
pytree, as nested dicts) and `config.json` (the HF config, so the directory is self-describing).
Parameters keep their dtype, so hf-to-orbax followed by orbax-to-hf reproduces every tensor bit
for bit. `verify` runs transformers' PyTorch model and caper_jax on the same random tokens; its last
stdout line is JSON: max_abs_logit_diff, mean_kl (KL(hf || caper_jax) per position), greedy_match
(both greedy-decode the same tokens). The reference needs torch (requirements-test.txt): without it
`verify` says so and exits 2 before loading anything.

Before any work, one line on stderr and exit status 2 for: a missing input directory or
config.json, a config.json that is not a JSON object, an `--out` that is (or holds) the input, is a
file or a non-empty directory, or whose parent cannot be written. A checkpoint whose tensors do not
fit its config (missing, unused or wrongly shaped tensors) ends the run with one line too. Outputs
are written into a temporary directory beside `--out` and renamed to it at the end, so an
interrupted conversion never leaves a directory that looks complete; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
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
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM, from_hf, to_hf
from caper_jax.models.hf_io import abstract_model
from caper_jax.parallel.rules import logical_to_sharding
from caper_jax.utils import atomic

PARAMS_DIR = "params"


def save_orbax(model: Qwen35ForCausalLM, config: Qwen35Config, out: str | pathlib.Path) -> pathlib.Path:
    """Writes `out/params` (orbax StandardSave of the param pytree) and `out/config.json`."""
    out = pathlib.Path(out).absolute()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS_DIR, params)
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2, sort_keys=True))
    return out


def load_orbax(
    ckpt: str | pathlib.Path, mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None, **runtime: Any
) -> tuple[Qwen35ForCausalLM, Qwen35Config]:
    """Restores a `save_orbax` directory; with a mesh, each parameter is restored onto its sharding."""
    ckpt = pathlib.Path(ckpt).absolute()
    hf_config = json.loads((ckpt / "config.json").read_text())
    dtype = hf_config.get("dtype", "float32")
    config = Qwen35Config.from_hf_dict(hf_config, **{"dtype": dtype, "param_dtype": dtype, **runtime})
    graphdef, params, rest = nnx.split(abstract_model(config, mesh, rules), nnx.Param, ...)
    if mesh is not None:
        shardings = logical_to_sharding(params, mesh, rules or ())
        params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), params, shardings)
    target = nnx.to_pure_dict(params)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(ckpt / PARAMS_DIR, target)
    nnx.replace_by_pure_dict(params, restored)
    return nnx.merge(graphdef, params, rest), config


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
    import torch
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m caper_jax.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-orbax", help="transformers checkpoint dir -> orbax checkpoint dir")
    p.add_argument("--hf_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default=None, help="param dtype (default: the checkpoint's config dtype)")
    p = sub.add_parser("orbax-to-hf", help="orbax checkpoint dir -> transformers checkpoint dir")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_shard_gb", type=float, default=5.0)
    p = sub.add_parser("verify", help="compare with transformers on random tokens (JSON on the last line)")
    p.add_argument("--hf_dir", required=True)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=96)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, ReferenceUnavailable, FileNotFoundError) as error:  # CheckpointError, OutputError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: convert {args.command} stopped; no output written", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    source = args.ckpt if args.command == "orbax-to-hf" else args.hf_dir
    hf_config = _read_config(source, "--ckpt" if args.command == "orbax-to-hf" else "--hf_dir")
    if args.command == "verify":
        require_reference()
    else:
        atomic.check_output_dir(args.out, inputs=(source,), flag="--out", must_be_empty=True)
    if args.command == "orbax-to-hf" and not (pathlib.Path(source) / PARAMS_DIR).is_dir():
        raise ValueError(f"--ckpt {source} has no {PARAMS_DIR}/ (not written by hf-to-orbax)")

    if args.command == "hf-to-orbax":
        dtype = args.dtype or _checkpoint_dtype(hf_config)
        model, config = from_hf(args.hf_dir, dtype=dtype)
        print(_into_place(args.out, lambda staging: save_orbax(model, config, staging)))
    elif args.command == "orbax-to-hf":
        model, config = load_orbax(args.ckpt)
        max_shard_bytes = int(args.max_shard_gb * 2**30)
        print(_into_place(args.out, lambda staging: to_hf(model, config, staging, max_shard_bytes=max_shard_bytes)))
    else:
        report = verify(args.hf_dir, args.batch, args.seq_len, args.new_tokens, args.seed)
        print(json.dumps(report))
    return 0


def _checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype a checkpoint was saved in (config.json `dtype`, older `torch_dtype`), default fp32."""
    text = hf_config.get("text_config", hf_config)
    dtype = text.get("dtype") or text.get("torch_dtype") or hf_config.get("dtype") or hf_config.get("torch_dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


if __name__ == "__main__":
    sys.exit(main())
