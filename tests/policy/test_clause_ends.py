"""Clause ends of a completion (``caper_jax.policy.clause_ends``): character spans to the token holding each
span's last character, against a naive reference and real tokenizers, and the padded ``[B, K]`` batch."""
import numpy as np
import pytest

from caper_jax.policy.clause_ends import pad_clause_ends, spans_to_token_ends


def covering_token(offsets, char):
    """Naive reference: the token whose [start, end) holds char."""
    hits = [i for i, (s, e) in enumerate(offsets) if s <= char < e]
    assert len(hits) == 1
    return hits[0]


def test_spans_inside_tokens_and_gaps_hand_made_offsets():
    text = "SELECT a FROM t WHERE x=1"
    # Tokens: "SELECT", " a F" (crosses the SELECT|FROM boundary), "ROM", " t", " WHERE", " x=1",
    # plus a special token (0, 0) at the start and a tokenizer that leaves the space before "t" out.
    offsets = [(0, 0), (0, 6), (6, 10), (10, 13), (14, 15), (15, 21), (21, 25)]
    spans = [(0, 8), (9, 15), (16, 25)]  # "SELECT a", "FROM t", "WHERE x=1"
    assert text[0:8] == "SELECT a" and text[9:15] == "FROM t" and text[16:25] == "WHERE x=1"
    np.testing.assert_array_equal(spans_to_token_ends(spans, offsets), [2, 4, 6])
    # A span whose last character (the space at 13) is in the gap maps to the token before the gap.
    np.testing.assert_array_equal(spans_to_token_ends([(9, 14)], offsets), [3])


def test_spans_with_a_trained_bpe_tokenizer_and_split_clauses():
    tokenizers = pytest.importorskip("tokenizers")
    from caper_jax.sql.clauses import split_clauses

    corpus = ["SELECT name, age FROM singer WHERE age > 20 ORDER BY age DESC LIMIT 3;",
              "SELECT count(*) FROM concert GROUP BY year HAVING count(*) > 1"] * 20
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    for sql in corpus[:2]:
        units = split_clauses(sql)
        offsets = tok.encode(sql).offsets
        ends = spans_to_token_ends(units, offsets)
        expected = [covering_token(offsets, u.end - 1) for u in units]
        np.testing.assert_array_equal(ends, expected)
        assert np.all(np.diff(ends) > 0)


def test_spans_with_the_real_qwen35_tokenizer(qwen35, spider):
    """Qwen3.5's offsets on Spider dev golds and non-ASCII SQL: each clause maps to the token holding its last
    character (the last such token where a character is split over several byte tokens)."""
    from caper_jax.data.spider import load_split
    from caper_jax.sql.clauses import split_clauses

    tok, _ = qwen35
    sqls = [ex.query for ex in load_split(spider, "dev")[::3]]
    sqls += ["SELECT \"名前\" FROM 表 WHERE 市 = '東京' ORDER BY 1", "SELECT x FROM t WHERE y = '🙂👍🏽' LIMIT 1",
             "SELECT max(a)\nFROM t GROUP BY b\nHAVING count(*) > 2"]
    split_chars = 0
    for sql in sqls:
        units = split_clauses(sql)
        offsets = tok(sql, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        expected = [max(i for i, (s, e) in enumerate(offsets) if s <= u.end - 1 < e) for u in units]
        np.testing.assert_array_equal(spans_to_token_ends(units, offsets), expected, err_msg=sql)
        split_chars += len(offsets) - len(set(map(tuple, offsets)))
    assert split_chars > 0     # some characters did span several tokens


def test_span_errors():
    offsets = [(0, 3), (3, 6)]
    with pytest.raises(ValueError, match="empty"):
        spans_to_token_ends([(2, 2)], offsets)
    with pytest.raises(ValueError, match="past the tokenised text"):
        spans_to_token_ends([(0, 7)], offsets)
    with pytest.raises(ValueError, match="before the first token"):
        spans_to_token_ends([(0, 1)], [(2, 4)])
    with pytest.raises(ValueError, match="no non-empty token"):
        spans_to_token_ends([(0, 1)], [(0, 0)])


def test_pad_clause_ends():
    np.testing.assert_array_equal(pad_clause_ends([[1, 4], [], [2, 3, 5]], 3),
                                  [[1, 4, -1], [-1, -1, -1], [2, 3, 5]])
    with pytest.raises(ValueError, match="max_clauses"):
        pad_clause_ends([[1, 2, 3, 4]], 3)
