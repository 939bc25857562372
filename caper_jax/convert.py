"""Qwen3.5 checkpoint conversion: transformers safetensors <-> orbax, and a parity check.

    python -m caper_jax.convert hf-to-orbax --hf_dir D --out O [--dtype bfloat16]
    python -m caper_jax.convert orbax-to-hf --ckpt O --out D2 [--max_shard_gb 5]
    python -m caper_jax.convert verify --hf_dir D [--batch 2 --seq_len 96 --new_tokens 16]

An orbax checkpoint here is a directory with `params/` (orbax StandardSave of the parameter
pytree, as nested dicts) and `config.json` (the HF config, so the directory is self-describing).
Parameters keep their dtype, so hf-to-orbax followed by orbax-to-hf reproduces every tensor bit
for bit. `verify` runs transformers (when torch is importable) and caper_jax on the same random
tokens; its last stdout line is JSON: max_abs_logit_diff, mean_kl (KL(hf || caper_jax) per
position), greedy_match (both greedy-decode the same tokens).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
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
    """Compares caper_jax with transformers (fp32) on random tokens; returns the report dict."""
    model, config = from_hf(hf_dir, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len))
    graphdef, state = nnx.split(model)
    ours = np.asarray(jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, jnp.asarray(tokens, jnp.int32)))
    report: dict[str, Any] = {
        "hf_dir": str(hf_dir), "batch": batch, "seq_len": seq_len, "finite": bool(np.isfinite(ours).all())
    }
    try:
        import torch
        import transformers
    except ImportError:
        report.update(reference=None, max_abs_logit_diff=None, mean_kl=None, greedy_match=None)
        return report
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


# CLI ---------------------------------------------------------------------------------------------


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

    if args.command == "hf-to-orbax":
        dtype = args.dtype or _checkpoint_dtype(json.loads((pathlib.Path(args.hf_dir) / "config.json").read_text()))
        model, config = from_hf(args.hf_dir, dtype=dtype)
        print(save_orbax(model, config, args.out))
    elif args.command == "orbax-to-hf":
        model, config = load_orbax(args.ckpt)
        print(to_hf(model, config, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30)))
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
