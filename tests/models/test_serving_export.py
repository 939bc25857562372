"""The end-of-run policy export as transformers (and so vLLM) serves it: loaded by ``AutoModelForCausalLM`` +
``AutoTokenizer``, its chat template rendering the training prompt's ids, its generation_config stopping at
``<|im_end|>``, and its bfloat16 tensors equal to the fp32 ones rounded by torch.

The export is ``caper_jax.loop.finish_policy_run``'s, on the settings configs/grpo.py and configs/sft.py
give; the references are transformers' loaders, ``apply_chat_template``, ``GenerationConfig``, ``generate``
and torch's bfloat16 cast.
"""
from __future__ import annotations

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file

from caper_jax import loop
from caper_jax.data.tokenizer import build_demo_tokenizer
from caper_jax.demo.schemas import tables_json_entry
from caper_jax.demo.world import open_databases
from caper_jax.models import Qwen35ForCausalLM, to_hf
from caper_jax.models.presets import model_preset
from caper_jax.data.serving import generation_defaults, policy_messages
from caper_jax.rl.settings import GrpoSettings
from caper_jax.settings import SettingsError, as_dict, from_config, replace
from caper_jax.sft.settings import SftSettings
from caper_jax.sql.contract import END_OF_SQL, policy_prompt, serialize_schema
from configs import grpo as grpo_config
from configs import prm as prm_config
from configs import sft as sft_config
from tests.helpers import build_policy_run, run_command

QUESTIONS = (  # (question, evidence): plain, BIRD's hint line, non-ASCII and a quote
    ("How many customers are there?", ""),
    ("List the names of products priced above 10.", "priced above 10 refers to price > 10"),
    ("Which café's owner is named 'Zoë'?", ""),
)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def demo_schemas() -> list[str]:
    databases = open_databases(0)
    try:
        return [serialize_schema(tables_json_entry(db.schema)) for db in databases.values()][:2]
    finally:
        for db in databases.values():
            db.conn.close()


def end_of_run_export(tmp_path, settings, policy, tokenizer):
    """``finish_policy_run``'s export, its run reduced to what the export reads."""
    run = types.SimpleNamespace(settings=settings, workdir=tmp_path, main=True, finish=lambda *a, **k: None)
    loop.finish_policy_run(run, {"steps": 1}, [], policy, tokenizer, curves=[], png="x.png", title="t")
    return tmp_path / "hf_export"


def grpo_settings():
    return from_config(GrpoSettings, grpo_config.get_config())


def sft_settings():
    return from_config(SftSettings, sft_config.get_config())


@pytest.fixture(scope="module")
def small_exports(tmp_path_factory, demo_tokenizer):
    """A random `small` policy (the widths vLLM-CPU's DeltaNet kernel takes) exported at the end of a GRPO
    run (configs/grpo.py: float32) and of an SFT run set to bfloat16."""
    policy = Qwen35ForCausalLM(model_preset("small", vocab_size=len(demo_tokenizer)), rngs=nnx.Rngs(0))
    fp32 = end_of_run_export(tmp_path_factory.mktemp("grpo"), grpo_settings(), policy, demo_tokenizer)
    bf16 = end_of_run_export(tmp_path_factory.mktemp("sft"), replace(sft_settings(), {"export_dtype": "bfloat16"}),
                             policy, demo_tokenizer)
    return fp32, bf16


def test_export_loads_in_transformers_with_the_run_s_token_ids_and_sampling(small_exports, demo_tokenizer):
    fp32, _ = small_exports
    model = transformers.AutoModelForCausalLM.from_pretrained(fp32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(fp32)
    im_end, end_of_text = (demo_tokenizer.convert_tokens_to_ids(t) for t in (END_OF_SQL, "<|endoftext|>"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.float32
    assert model.config.eos_token_id == im_end and model.config.pad_token_id == demo_tokenizer.pad_token_id
    assert tokenizer.eos_token_id == im_end and len(tokenizer) == len(demo_tokenizer)
    generation = transformers.GenerationConfig.from_pretrained(fp32)
    sampling = grpo_settings().sampling
    assert generation.eos_token_id == [im_end, end_of_text] and generation.pad_token_id == demo_tokenizer.pad_token_id
    assert generation.do_sample and (generation.temperature, generation.top_p, generation.top_k,
                                     generation.max_new_tokens) == (sampling.temperature, sampling.top_p,
                                                                    sampling.top_k, sampling.max_new_tokens)


def test_bfloat16_export_is_the_fp32_one_rounded_by_torch(small_exports):
    fp32, bf16 = small_exports
    full, half = load_file(fp32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert sorted(full) == sorted(half)
    for name in full:
        assert full[name].dtype == torch.float32 and half[name].dtype == torch.bfloat16, name
        assert torch.equal(full[name].to(torch.bfloat16), half[name]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16)
    assert model.dtype == torch.bfloat16 and json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    generation = transformers.GenerationConfig.from_pretrained(bf16)   # an SFT run: greedy, as it was evaluated
    assert not generation.do_sample and generation.max_new_tokens == sft_settings().eval.max_new_tokens


def assert_template_gives_training_ids(export_dir, run_tokenizer, schemas):
    served = transformers.AutoTokenizer.from_pretrained(export_dir)
    for schema in schemas:
        for question, evidence in QUESTIONS:
            trained = run_tokenizer(policy_prompt(question, schema, evidence), add_special_tokens=False)["input_ids"]
            chat = served.apply_chat_template(policy_messages(question, schema, evidence), add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
            assert chat == trained, (question, served.decode(chat))


def test_chat_template_reproduces_the_training_prompt_with_the_demo_tokenizer(small_exports, demo_tokenizer,
                                                                              demo_schemas):
    fp32, _ = small_exports
    assert "chat_template" in json.loads((fp32 / "tokenizer_config.json").read_text())
    assert_template_gives_training_ids(fp32, demo_tokenizer, demo_schemas)


def tiny_policy(tokenizer) -> Qwen35ForCausalLM:
    """A random `tiny` policy; one vocabulary size for all, so JAX's compiled initialisers are reused."""
    return Qwen35ForCausalLM(model_preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))


def test_chat_template_reproduces_the_training_prompt_with_the_qwen35_tokenizer(qwen35, tmp_path, demo_schemas,
                                                                                demo_tokenizer):
    """The real tokenizer, its own (release-less) template replaced; the model's vocabulary is immaterial."""
    tokenizer, _ = qwen35
    policy = tiny_policy(demo_tokenizer)
    out = end_of_run_export(tmp_path, grpo_settings(), policy, tokenizer)
    assert_template_gives_training_ids(out, tokenizer, demo_schemas)
    config = json.loads((out / "config.json").read_text())
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert config["eos_token_id"] == 248_046 and config["pad_token_id"] == 248_044   # <|im_end|>, <|endoftext|>
    assert generation.eos_token_id == [248_046, 248_044]


def stepping_policy(tokenizer, ordinary: int, im_end: int) -> Qwen35ForCausalLM:
    """A tiny policy whose greedy next token depends only on the last one: ``ordinary`` after any other
    token, ``<|im_end|>`` after ``ordinary`` and after itself. Every block's output projection is zero, so the
    residual stream is the last token's embedding, and the (tied) embeddings are chosen so: generic rows e0,
    ``ordinary`` 2 e0 + e1, ``<|im_end|>`` 1.5 e0 + 3 e1 (dot products 1 < 1.5 < 2, then 2 < 5 < 6, 11.25)."""
    policy = tiny_policy(tokenizer)
    for path, variable in nnx.to_flat_state(nnx.state(policy, nnx.Param)):
        if path[-1] in ("o_proj", "out_proj", "down_proj") or path == ("norm", "weight"):
            variable[...] = jnp.zeros_like(variable[...])
    embed = np.zeros(policy.embed_tokens[...].shape, np.float32)
    embed[:, 0] = 1.0
    embed[ordinary, :2] = (2.0, 1.0)
    embed[im_end, :2] = (1.5, 3.0)
    policy.embed_tokens[...] = jnp.asarray(embed)
    return policy


def test_greedy_generation_stops_at_im_end_by_the_export_s_generation_config(tmp_path, demo_tokenizer):
    im_end = demo_tokenizer.convert_tokens_to_ids(END_OF_SQL)
    ordinary = demo_tokenizer.convert_tokens_to_ids("ĠFROM")
    out = end_of_run_export(tmp_path, sft_settings(), stepping_policy(demo_tokenizer, ordinary, im_end),
                            demo_tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([demo_tokenizer(policy_prompt("How many shops?", "shop(id number PK)"))["input_ids"]])
    with torch.no_grad():
        served = model.generate(prompt, attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:].tolist()
        unstopped = model.generate(prompt, attention_mask=torch.ones_like(prompt), eos_token_id=None,
                                   max_new_tokens=4)[0, prompt.shape[1]:].tolist()
    assert unstopped == [ordinary, im_end, im_end, im_end]   # the policy goes on past <|im_end|> unless told
    assert served == [ordinary, im_end]


def test_export_dtype_settings_and_refusals(tmp_path, capsys, demo_tokenizer):
    for config in (grpo_config, sft_config, prm_config):
        assert config.get_config("model=qwen35_9b").export_dtype == "bfloat16"
        assert config.get_config("model=tiny").export_dtype == "float32"
    unknown = sft_config.get_config()
    unknown.export_dtype = "float16"
    with pytest.raises(SettingsError, match="export_dtype='float16'"):
        from_config(SftSettings, unknown)
    policy = tiny_policy(demo_tokenizer)
    with pytest.raises(ValueError, match="export dtype 'float16'"):
        to_hf(policy, policy.config, tmp_path / "x", dtype="float16")
    from caper_jax import convert

    code = run_command(convert, "orbax-to-hf", "--ckpt", tmp_path, "--out", tmp_path / "o", "--dtype", "float16")
    assert code == 2 and "--dtype=float16" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no generation defaults for a 'prm' run"):
        generation_defaults(as_dict(from_config(GrpoSettings, grpo_config.get_config())) | {"trainer": "prm"})


def test_orbax_to_hf_of_an_sft_run_writes_the_serving_files_in_bfloat16(tmp_path, demo_tokenizer, capsys):
    demo_tokenizer.save_pretrained(tmp_path / "world" / "tokenizer")
    run = build_policy_run(tmp_path, tmp_path / "world")
    from caper_jax import convert

    assert run_command(convert, "orbax-to-hf", "--ckpt", run, "--out", tmp_path / "hf", "--dtype", "bfloat16") == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16 and model.config.eos_token_id == demo_tokenizer.convert_tokens_to_ids(END_OF_SQL)
    assert not generation.do_sample and generation.max_new_tokens == sft_settings().eval.max_new_tokens
    assert_template_gives_training_ids(tmp_path / "hf", demo_tokenizer, ["shop(id number PK, name text)"])
