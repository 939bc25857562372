"""HF safetensors import/export, the orbax round trip and the convert CLI.

References: the safetensors files transformers itself wrote (bit comparisons), transformers'
`from_pretrained` on what we export, and PartitionSpecs computed by the parallel rules.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from caper_jax import convert
from caper_jax.models import from_hf, to_hf
from caper_jax.models.hf_io import CheckpointError
from tests.helpers import build_hf_model, run_command, simulated_devices_env

REPO = pathlib.Path(__file__).resolve().parents[2]


def read_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """transformers-written checkpoints: untied fp32, and tied bf16."""
    dirs = {}
    for name, dtype in (("untied", torch.float32), ("tied", torch.bfloat16)):
        path = tmp_path_factory.mktemp(f"hf_{name}")
        build_hf_model(name).to(dtype).save_pretrained(path)
        dirs[name] = path
    return dirs


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_hf_orbax_hf_round_trip_is_bit_exact(hf_dirs, tmp_path, name):
    source = hf_dirs[name]
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_command(convert, "hf-to-orbax", "--hf_dir", source, "--out", tmp_path / "orbax") == 0
        assert run_command(convert, "orbax-to-hf", "--ckpt", tmp_path / "orbax", "--out", tmp_path / "hf") == 0
    assert_bit_identical(read_tensors(source), read_tensors(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] == (name == "tied")
    assert config["dtype"] == ("bfloat16" if name == "tied" else "float32")


def test_sharded_export_loads_in_transformers(hf_dirs, tmp_path):
    model, config = from_hf(hf_dirs["untied"])
    to_hf(model, config, tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_bit_identical(read_tensors(hf_dirs["untied"]), read_tensors(tmp_path))
    reloaded = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path).eval()
    original = transformers.Qwen3_5ForCausalLM.from_pretrained(hf_dirs["untied"]).eval()
    ids = torch.arange(1, 40)[None] % config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)
    again, _ = from_hf(tmp_path)  # the sharded index reads back too
    np.testing.assert_array_equal(
        np.asarray(again.layers[3].self_attn.q_proj[...]), np.asarray(model.layers[3].self_attn.q_proj[...])
    )


def test_multimodal_checkpoint_loads_text_part(hf_dirs, tmp_path):
    """`model.language_model.` prefix, vision tower and MTP tensors present: same text model."""
    source = hf_dirs["untied"]
    tensors = read_tensors(source)
    renamed = {
        ("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    renamed["mtp.fc.weight"] = np.ones((2, 2), np.float32)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((source / "config.json").read_text())
    wrapper = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=False).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    model, config = from_hf(tmp_path)
    reference, _ = from_hf(source)
    assert config.hidden_size == reference.config.hidden_size
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]), np.asarray(reference.lm_head[...]))
    np.testing.assert_array_equal(
        np.asarray(model.layers[0].linear_attn.conv1d[...]), np.asarray(reference.layers[0].linear_attn.conv1d[...])
    )


def test_bad_checkpoints_raise_typed_errors(hf_dirs, tmp_path):
    tensors = read_tensors(hf_dirs["untied"])
    (tmp_path / "config.json").write_text((hf_dirs["untied"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="neither"):
        from_hf(tmp_path)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors.*lm_head"):
        from_hf(tmp_path)
    save_file({**tensors, "model.layers.0.extra.weight": np.zeros(2, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not use"):
        from_hf(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = np.zeros(3, np.float32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="shape"):
        from_hf(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        from_hf(tmp_path / "nowhere")


def test_verify_cli_reports_parity(hf_dirs):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        run_command(convert, "verify", "--hf_dir", hf_dirs["tied"], "--batch", "1", "--seq_len", "24", "--new_tokens", "4")
    report = json.loads(stdout.getvalue().strip().splitlines()[-1])
    # Bounds from fp32 precision, not from what one processor printed. Logits: each forward pass
    # rounds at eps = 1.2e-7 relative per op; errors from a few hundred accumulations (every GEMM
    # row, norm and softmax of each layer) add up to well under 1000 eps of the logits' scale, while a
    # real defect (a transposed weight, a wrong norm) moves logits by 1e-2 or more.
    logit_atol = 1000 * np.finfo(np.float32).eps * max(1.0, report["max_abs_logit"])
    assert report["max_abs_logit_diff"] < logit_atol
    # KL (computed in float64 from the two fp32 logit arrays): to second order it is half the
    # variance under p of the logit difference, so it cannot exceed max|diff|^2 / 2; twice that
    # leaves room for the third-order term.
    assert 0 <= report["mean_kl"] <= report["max_abs_logit_diff"] ** 2
    assert report["greedy_match"] is True and report["greedy_tokens_compared"] == 4


_MESH_SCRIPT = """
import json, sys
import jax
from caper_jax.models import from_hf
from caper_jax.parallel.mesh import make_mesh
from caper_jax.parallel.rules import DEFAULT_RULES, logical_to_spec
mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2})
model, config = from_hf(sys.argv[1], mesh=mesh, rules=DEFAULT_RULES)
q = model.layers[3].self_attn.q_proj
embed = model.embed_tokens
print(json.dumps({
    "q_spec": str(q[...].sharding.spec),
    "q_expected": str(logical_to_spec(q.get_metadata()["out_sharding"], DEFAULT_RULES, shape=q.shape, mesh=mesh)),
    "q_shard_shape": list(q[...].addressable_shards[0].data.shape),
    "embed_spec": str(embed[...].sharding.spec),
    "devices": len(q[...].sharding.device_set),
}))
"""


def test_loading_onto_a_mesh_places_each_tensor_on_its_sharding(hf_dirs):
    """4 simulated devices (a subprocess: this process already initialised JAX with one)."""
    result = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(hf_dirs["untied"])], env=simulated_devices_env(4), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["q_spec"] == report["q_expected"] == "P(None, 'fsdp', 'tensor')"
    assert report["q_shard_shape"] == [2, 32, 64]       # [groups, hidden / fsdp, 2 * heads * head_dim / tensor]
    assert report["embed_spec"] == "P('tensor', 'fsdp')"
    assert report["devices"] == 4
