"""The demo tokenizer: exact round trips, offsets that index the text, determinism, transformers loading;
the byte-level contract (round trips, offsets, digits) also with the real Qwen3.5 tokenizer."""
import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from caper_jax.demo.schemas import tables_json_entry
from caper_jax.demo.world import DEFAULT_DEV_SIZE, DEFAULT_TRAIN_SIZE, generate_examples, open_databases
from caper_jax.data.tokenizer import SPECIAL_TOKENS, build_demo_tokenizer
from caper_jax.sql import contract

TEXTS = [
    "SELECT name FROM product WHERE price > 150 AND category = 'Toys' ORDER BY price DESC LIMIT 3",
    "Which customers bought products whose category is Garden?",
    "Ünïcødé, 漢字とかな, Ελληνικά, emoji 🙂👍🏽, tab\tnew\nline\r\n, NUL \x00 and \x7f",
    "   leading and trailing spaces   ",
    "SELECT \"Home Town\" FROM people WHERE name LIKE '%o''brien%'",
    "",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return build_demo_tokenizer(out), out


@pytest.fixture(params=["demo", "qwen35"])
def any_tokenizer(request, saved):
    """The demo tokenizer, then the real Qwen3.5 one (the session's ``qwen35``): the same byte-level contract."""
    return saved[0] if request.param == "demo" else request.getfixturevalue("qwen35")[0]


def test_round_trip_of_any_text(any_tokenizer):
    tok = any_tokenizer
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text


def test_offsets_index_and_cover_the_text(any_tokenizer):
    tok = any_tokenizer
    for text in TEXTS:
        enc = tok(text, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        covered = set()
        for start, end in offsets:
            assert 0 <= start < end <= len(text)
            covered.update(range(start, end))
        assert covered == set(range(len(text)))
        assert [s for s, _ in offsets] == sorted(s for s, _ in offsets)
        if text.isascii():
            # One byte per character: tokens tile the text exactly and each decodes to its span.
            assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
            for token_id, (start, end) in zip(enc["input_ids"], offsets):
                assert tok.decode([token_id]) == text[start:end]


def test_special_tokens_are_single_ids(saved):
    tok, _ = saved
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert (tok.pad_token, tok.eos_token) == ("<|pad|>", "<|im_end|>")
    text = contract.policy_prompt("How many?", "t(a number)") + "SELECT 1" + contract.END_OF_SQL
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_auto_tokenizer_loads_the_saved_files(saved):
    tok, out = saved
    loaded = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, PreTrainedTokenizerFast) and isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded.get_vocab() == tok.get_vocab()
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.pad_token_id == tok.pad_token_id and loaded.eos_token_id == tok.eos_token_id


def test_two_builds_are_identical(saved, tmp_path):
    _, out = saved
    build_demo_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((out / "tokenizer.json").read_text())


def test_digits_are_single_tokens(any_tokenizer):
    tok = any_tokenizer
    tokens = tok.convert_ids_to_tokens(tok("price > 1234.5")["input_ids"])
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["1", "2", "3", "4", "5"]


def test_vocab_size_is_an_upper_bound_and_checked():
    small = build_demo_tokenizer(vocab_size=300)
    assert 256 + len(SPECIAL_TOKENS) <= len(small) <= 300
    with pytest.raises(ValueError, match="vocab_size"):
        build_demo_tokenizer(vocab_size=100)


def test_demo_world_sequences_fit_512_tokens(saved):
    tok, _ = saved
    databases = open_databases(seed=0)
    schemas = {db_id: contract.serialize_schema(tables_json_entry(db.schema)) for db_id, db in databases.items()}
    texts = [contract.policy_prompt(e["question"], schemas[e["db_id"]]) + e["query"] + contract.END_OF_SQL
             for split, size in (("train", DEFAULT_TRAIN_SIZE), ("dev", DEFAULT_DEV_SIZE))
             for e in generate_examples(databases, 0, split, size)]
    lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    assert len(lengths) == DEFAULT_TRAIN_SIZE + DEFAULT_DEV_SIZE and max(lengths) <= 512
