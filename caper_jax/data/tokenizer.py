"""An offline byte-level BPE tokenizer trainer (no downloads, deterministic), for every world.

Trained with the ``tokenizers`` library on the demo world's training questions and gold SQL, the
serialised schemas of its databases, and a list of SQL keywords and functions, or on another
corpus (``experiments.spider_verifier.build_spider_view`` gives it Spider's training prompts + SQL). Design choices:

* Byte-level BPE: any string (any script, emoji, control bytes) encodes and decodes back exactly;
  there is no unknown token.
* Qwen2/Qwen3.5's pre-tokenisation regex, which splits digits one by one: numbers in dev
  questions are values never seen in training, and digit tokens let a tiny model copy them.
* No normaliser, and offsets are not trimmed: ``return_offsets_mapping=True`` gives spans that
  index the original text exactly and together cover it, which GRPO needs to map clause
  character spans to tokens.
* Special tokens (ids 0-3): ``<|pad|>`` (padding), ``<|endoftext|>`` (document separator when
  packing), ``<|im_start|>`` and ``<|im_end|>`` (prompt markers, caper_jax.sql.contract;
  ``<|im_end|>`` is the end-of-sequence token that ends the policy's SQL) — the same strings
  Qwen's tokenizer uses.

The real Qwen3.5 tokenizer, which the 9B recipe reads, is written offline by
``caper_jax.data.qwen35_tokenizer`` (``python -m caper_jax.convert qwen35-tokenizer``; docs/tokenizer.md).
"""
from __future__ import annotations

import functools
import pathlib
import random
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from caper_jax.demo.schemas import tables_json_entry
from caper_jax.demo.world import DEFAULT_TRAIN_SIZE, generate_examples, open_databases
from caper_jax.sql.contract import policy_prompt, serialize_schema

PAD, EOT, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOT, IM_START, IM_END)
DEFAULT_VOCAB_SIZE = 2048
# Qwen2 / Qwen3.5 tokenizer.json pre-tokenizer pattern.
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SQL_WORDS = (
    "SELECT", "DISTINCT", "FROM", "JOIN", "LEFT JOIN", "INNER JOIN", "ON", "AS", "WHERE", "AND", "OR", "NOT",
    "IN", "LIKE", "BETWEEN", "IS NULL", "IS NOT NULL", "GROUP BY", "HAVING", "ORDER BY", "ASC", "DESC",
    "LIMIT", "OFFSET", "UNION", "UNION ALL", "INTERSECT", "EXCEPT", "EXISTS", "CASE", "WHEN", "THEN", "ELSE",
    "END", "COUNT", "SUM", "AVG", "MIN", "MAX", "CAST", "WITH", "=", "<>", "!=", ">=", "<=", ">", "<",
)


@functools.lru_cache(maxsize=4)
def training_corpus(seed: int = 0) -> tuple[str, ...]:
    """Texts the tokenizer learns from, in a fixed order (the demo world's training split only)."""
    databases = open_databases(seed)
    try:
        examples = generate_examples(databases, seed, "train", DEFAULT_TRAIN_SIZE)
    finally:
        for db in databases.values():
            db.conn.close()
    schemas = {db_id: serialize_schema(tables_json_entry(db.schema)) for db_id, db in databases.items()}
    texts = [" ".join(SQL_WORDS), " ".join(w.lower() for w in SQL_WORDS)]
    for e in examples:
        # The prompt as the models see it, minus the special tokens (those are never merged).
        prompt = policy_prompt(e["question"], schemas[e["db_id"]])
        for special in SPECIAL_TOKENS:
            prompt = prompt.replace(special, "\n")
        texts.append(prompt + e["query"])
    return tuple(texts)


def build_demo_tokenizer(out_dir: str | pathlib.Path | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                         seed: int = 0, corpus: Sequence[str] | None = None) -> PreTrainedTokenizerFast:
    """Trains the demo tokenizer; saves it to ``out_dir`` (``AutoTokenizer.from_pretrained`` loads it).

    ``corpus``: other training texts (say, Spider's training prompts + SQL) instead of the demo world's.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + special tokens), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = list(training_corpus(seed) if corpus is None else corpus)
    random.Random(seed).shuffle(corpus)
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, unk_token=None, bos_token=None,
        additional_special_tokens=[EOT, IM_START], model_max_length=4096, padding_side="right",
        clean_up_tokenization_spaces=False)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
