"""Clause-PRM <-> Hugging Face: load a Qwen3.5 backbone into a PRM, export a trained PRM.

The export is a ``Qwen3_5TextForSequenceClassification`` checkpoint with ``num_labels=1``: the
backbone under ``model.*`` and the head as ``score.weight`` ``[1, hidden]``. transformers applies the
head at the last non-pad token, so feeding it ``prompt + preceding SQL + clause`` returns the same
clause score caper_jax computes (tests/prm/test_export.py checks this against PyTorch).
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from caper_jax.models import hf_io
from caper_jax.parallel.multihost import fetch
from caper_jax.parallel.rules import logical_to_sharding
from caper_jax.data import serving
from caper_jax.prm.model import ClausePRM, backbone_config
from caper_jax.utils.errors import CheckpointError

HF_ARCHITECTURE = "Qwen3_5TextForSequenceClassification"
# vLLM has no Qwen3_5Text model and refuses the linear-attention layers through its transformers fallback; under
# this name it runs its own Qwen3.5 with a pooling head (`--runner pooling`, task token_classify: a score at every
# token, the clause ends among them; bench/vllm_check.py). transformers loads by model_type and ignores it.
VLLM_ARCHITECTURE = "Qwen3_5ForSequenceClassification"
SCORE_TENSOR = "score.weight"


def load_prm_backbone(hf_dir: str, mesh, rules, *, seed: int = 0, **runtime) -> ClausePRM:
    """A ClausePRM whose backbone comes from an HF Qwen3.5 checkpoint (text or multimodal layout).

    Tensors stream straight to their shardings (``from_hf``); an untied ``lm_head`` is dropped
    right after loading, since the PRM never reads vocabulary logits. The score head starts random.
    """
    dtype = runtime.pop("dtype", "float32")
    backbone, config = hf_io.from_hf(hf_dir, dtype=dtype, mesh=mesh, rules=rules, **runtime)
    if not config.tie_word_embeddings:
        del backbone.lm_head
    backbone.config = backbone_config(config)
    return ClausePRM(config, rngs=nnx.Rngs(seed), backbone=backbone)


def load_prm_from_hf(hf_dir: str | pathlib.Path, mesh=None, rules=None, *, dtype: str = "float32",
                     **runtime) -> ClausePRM:
    """A trained ClausePRM from an ``export_prm_to_hf`` directory, each tensor placed on its sharding."""
    hf_dir = pathlib.Path(hf_dir)
    architectures = json.loads((hf_dir / "config.json").read_text()).get("architectures") or []
    if HF_ARCHITECTURE not in architectures:
        raise CheckpointError(f"{hf_dir} is a {architectures} checkpoint, not a Clause-PRM export "
                                    f"({HF_ARCHITECTURE}): its score head would be random")
    backbone, config = hf_io.from_hf(hf_dir, dtype=dtype, mesh=mesh, rules=rules, allow_unused=(SCORE_TENSOR,),
                                     **runtime)
    head = hf_io.read_tensor(hf_dir, SCORE_TENSOR)
    if head.shape != (1, config.hidden_size):
        raise CheckpointError(f"{hf_dir}: {SCORE_TENSOR} has shape {head.shape}, expected (1, {config.hidden_size})")
    prm = ClausePRM(config, rngs=nnx.Rngs(0), backbone=backbone)
    value = jnp.asarray(head[0], jnp.float32)
    if mesh is not None:
        value = jax.device_put(value, logical_to_sharding(prm.score_head, mesh, rules or ()).get_value())
    prm.score_head.set_value(value)
    return prm


def export_prm_to_hf(model: ClausePRM, out_dir: str | pathlib.Path, tokenizer=None,
                     max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> pathlib.Path:
    """Writes the PRM as an HF sequence-classification checkpoint, its tensors in ``dtype`` (None: the
    parameters'; ``hf_io.EXPORT_DTYPES``), plus, given the tokenizer, its files with the policy's chat
    template and the token ids in config.json (``caper_jax.data.serving``; no generation_config.json: a
    sequence classifier generates nothing). The template renders the context a clause is scored in:
    ``apply_chat_template(policy_messages(...), add_generation_prompt=True, tokenize=False)`` + the SQL.

    Every process must call it (gathering a parameter sharded across hosts is collective); only
    process 0 writes.
    """
    backbone_config = model.backbone.config
    dtype = hf_io.export_dtype(dtype, backbone_config)
    head = np.asarray(fetch(model.score_head[...]), np.float32)[None, :]

    def tensors():
        yield from hf_io.hf_state_dict(model.backbone, backbone_config, dtype)
        yield SCORE_TENSOR, head.astype(np.dtype(jnp.dtype(dtype)))

    # The backbone config (no separate lm_head) is what the file holds; load_prm_from_hf reads it back.
    hf_config = backbone_config.to_hf_dict()
    hf_config.update(architectures=[HF_ARCHITECTURE, VLLM_ARCHITECTURE], num_labels=1, id2label={"0": "LABEL_0"},
                     label2id={"LABEL_0": 0}, pad_token_id=model.config.pad_token_id, problem_type="regression",
                     dtype=dtype)
    out = hf_io.write_safetensors(tensors(), out_dir, hf_config, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None and jax.process_index() == 0:
        serving.add_serving_files(out, tokenizer, generation=None)
    return out
