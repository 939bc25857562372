"""Rollouts: clause token ends against the decoded text, execution rewards against SQLite, and a random
tiny policy's garbage going through the whole host path without a crash.

References: the decoded token prefix itself (a clause end is right iff decoding up to it covers the
clause and decoding one token less does not), SQLite results computed here, and the policy's own
full forward for the sampler's log-probs.
"""
from __future__ import annotations

import sqlite3

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.models.sampler import SampleOutput, SamplingConfig, generate
from caper_jax.policy import rollout as R
from caper_jax.policy.clause_ends import clause_token_ends
from caper_jax.policy.sampling import decode_with_offsets
from caper_jax.rl import layout_rewards
from caper_jax.sql.clauses import split_clauses
from caper_jax.sql.execution import Executors
from tests.sft import hand_tokenizer, random_policy

GOLD = "SELECT name FROM t WHERE id = 1"
REWARD = R.RewardConfig(correct_reward=1.0, wrong_reward=0.25, failure_reward=-1.0)


@pytest.fixture(scope="module")
def tok():
    return hand_tokenizer()


@pytest.fixture(params=["hand", "qwen35"])
def any_tok(request):
    """The hand-made tokenizer, then the real Qwen3.5 one (the session's ``qwen35``)."""
    return hand_tokenizer() if request.param == "hand" else request.getfixturevalue("qwen35")[0]


@pytest.fixture()
def executors(tmp_path):
    db = tmp_path / "database" / "d" / "d.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)")
        con.executemany("INSERT INTO t VALUES (?, ?, ?)", [(1, "ann", 30), (2, "bob", 40), (3, "cy", 30)])
    with Executors(tmp_path / "database") as ex:
        yield ex


def check_ends_cover_clauses(tok, sql: str, ids: list[int]) -> None:
    text, offsets = decode_with_offsets(tok, ids)
    assert text == sql
    ends, ok = clause_token_ends(text, offsets)
    units = split_clauses(sql)
    assert ok and len(ends) == len(units)
    for unit, end in zip(units, ends):
        covered = tok.decode(ids[: end + 1])
        assert sql.startswith(covered) and len(covered) >= unit.end, (unit.name, covered)
        assert len(tok.decode(ids[:end])) < unit.end, (unit.name, "an earlier token already holds the clause")


@pytest.mark.parametrize("sql", [GOLD, "SELECT name, age FROM t WHERE age > 20 ORDER BY age DESC LIMIT 2;",
                                 "SELECT COUNT(*) FROM t GROUP BY age HAVING COUNT(*) > 1"])
def test_clause_ends_map_back_to_clause_text(any_tok, sql):
    tok = any_tok
    ids = tok(sql, add_special_tokens=False)["input_ids"]
    check_ends_cover_clauses(tok, sql, ids)
    if sql == GOLD and len(tok) < 1000:   # the hand tokenizer  # the SELECT clause ends inside the token "e F"
        end = clause_token_ends(*decode_with_offsets(tok, ids))[0][0]
        assert tok.convert_ids_to_tokens(ids[end]) == "e F"


def test_non_canonical_token_sequence(tok):
    """A policy may emit 'S','E','L','E','C','T' instead of 'SELECT': offsets must follow ITS tokens."""
    ids = [tok.convert_tokens_to_ids(ch) for ch in GOLD]
    assert ids != tok(GOLD, add_special_tokens=False)["input_ids"]
    check_ends_cover_clauses(tok, GOLD, ids)


def fake_output(tok, texts: list[str], stop: int, width: int) -> SampleOutput:
    """Sampler output for given completions: tokens, the stop token (unless the text is cut), padding."""
    tokens = np.zeros((len(texts), width), np.int32)
    lengths = np.zeros(len(texts), np.int32)
    for b, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [stop]
        ids = ids[:width]
        tokens[b, : len(ids)] = ids
        lengths[b] = len(ids)
    log_probs = np.where(np.arange(width) < lengths[:, None], -0.5, 0.0).astype(np.float32)
    return SampleOutput(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(log_probs))


def test_rewards_and_garbage(tok, executors):
    stop = tok.eos_token_id
    completions = [
        GOLD,                                      # correct
        "SELECT name FROM t WHERE id = 2",         # runs, wrong
        "SELECT nope FROM t",                      # parses, SQLite error
        "",                                        # empty
        "SELECT FROM WHERE ((",                    # unparseable
        "DROP TABLE t",                            # hostile: refused by the sandbox
        "ATTACH DATABASE 'x.sqlite' AS x",         # hostile
        ")))))))))))))))))))))))))))))))))))))))",  # cut by the width: no stop token
    ]
    width = 32
    gold = executors.execute("d", GOLD)
    prompt = np.ones((len(completions), 4), np.int32)
    out = fake_output(tok, completions, stop, width)
    r = R.assemble_rollout(prompt, prompt, out, tok, executors, ["d"] * len(completions), [GOLD] * len(completions),
                           [gold] * len(completions), (stop,), REWARD)
    assert r.texts == completions[:7] + [completions[7][:width]]
    np.testing.assert_array_equal(r.exec_rewards, [1.0, 0.25, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(r.correct, [1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(r.executed, [1, 1, 0, 0, 0, 0, 0, 0])
    assert r.parse_ok[:3].all() and not r.parse_ok[3:5].any() and not r.parse_ok[7]
    assert r.input_ids.shape == (8, 4 + width) and r.prompt_len == 4
    np.testing.assert_array_equal(r.completion_mask.sum(1), np.asarray(out.lengths))
    # A completion that stopped has its last clause end at the stop token: the PRM reads the last
    # clause after the end of the query, as in training; the other clauses end on their own tokens.
    for b in (0, 1, 2):
        ends = r.clause_ends[b][r.clause_ends[b] >= 0]
        assert ends[-1] == int(out.lengths[b]) - 1 and r.input_ids[b, 4 + ends[-1]] == stop
        assert (r.input_ids[b, 4 + ends[:-1]] != stop).all()
    # The sandbox left the database as it was.
    assert executors.execute("d", "SELECT COUNT(*) FROM t").rows == ((3,),)
    assert not (executors.db_path("d").parents[1] / "x.sqlite").exists()

    # Through the layout: garbage rows are one unit carrying the failure reward; SQL rows one per clause.
    prm = jnp.asarray(np.random.default_rng(0).normal(size=r.completion_mask.shape), jnp.float32)
    rewards, mask, _ = layout_rewards("clause", prm, jnp.asarray(r.clause_ends), jnp.asarray(r.exec_rewards),
                                      jnp.asarray(r.completion_mask), jnp.asarray(r.parse_ok),
                                      exec_failure_reward=REWARD.failure_reward)
    units = np.asarray(mask).sum(1)
    np.testing.assert_array_equal(units, [3, 3, 2, 1, 1, 1, 1, 1])
    for b in (3, 4, 7):
        assert float(rewards[b, 0]) == REWARD.failure_reward
    ends = r.clause_ends[0][r.clause_ends[0] >= 0]
    last = float(prm[0, ends[-1]]) + 1.0
    assert float(rewards[0, 2]) == pytest.approx(last)


def test_a_completion_cut_before_its_stop_token_ends_on_its_last_sql_token(any_tok, executors):
    tok = any_tok
    sql = "SELECT name FROM t WHERE id = 2"
    n = len(tok(sql, add_special_tokens=False)["input_ids"])
    out = fake_output(tok, [sql, sql], tok.eos_token_id, n + 1)
    cut = fake_output(tok, [sql, sql], tok.eos_token_id, n)        # no room for the stop token
    gold = executors.execute("d", GOLD)
    prompt = np.ones((2, 4), np.int32)
    stopped, open_ = (R.assemble_rollout(prompt, prompt, o, tok, executors, ["d"] * 2, [GOLD] * 2, [gold] * 2,
                                         (tok.eos_token_id,), REWARD) for o in (out, cut))
    assert stopped.clause_ends[0][2] == n and open_.clause_ends[0][2] == n - 1
    np.testing.assert_array_equal(stopped.clause_ends[0][:2], open_.clause_ends[0][:2])


def test_random_policy_rollout(tok, executors):
    """Sampled garbage never crashes the host path, and the sampler's log-probs are the training ones."""
    from flax import nnx

    from caper_jax.policy.logprobs import completion_logprobs

    policy = random_policy(len(tok), scale=0.3)
    stop = tok.eos_token_id
    group = 4
    from caper_jax.policy.prompts import prompt_batch

    prompt_ids, prompt_mask = prompt_batch(["<|im_start|>user\nname of id 1?<|im_end|>\n"] * group, tok, 32, 8)
    config = SamplingConfig(12, temperature=1.0, stop_tokens=(stop,), pad_id=tok.pad_token_id)
    out = generate(policy, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), jax.random.key(1), config)
    gold = executors.execute("d", GOLD)
    r = R.assemble_rollout(prompt_ids, prompt_mask, out, tok, executors, ["d"] * group, [GOLD] * group,
                           [gold] * group, (stop,), REWARD)
    assert set(r.exec_rewards.tolist()) <= {1.0, 0.25, -1.0}
    assert r.input_ids.shape == (group, prompt_ids.shape[1] + 12)
    graphdef, params = nnx.split(policy)
    logp = jax.jit(lambda p, ids, mask: completion_logprobs(p, ids, mask, graphdef=graphdef, completion_len=12,
                                                            temperature=1.0, chunk_size=8))(
        params, jnp.asarray(r.input_ids), jnp.asarray(r.attention_mask))
    mask = r.completion_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logp)[mask], r.old_logp[mask], atol=2e-4)


# --- the real Qwen3.5 tokenizer (the session's ``qwen35``) ------------------------------------------


def test_real_tokenizer_clause_ends_on_spider_golds(qwen35, spider):
    """Every clause end of Spider dev's gold queries, as Qwen3.5 tokenises them, is the token holding the
    clause's last character."""
    from caper_jax.data.spider import load_split

    tok, _ = qwen35
    for ex in load_split(spider, "dev")[::4]:
        check_ends_cover_clauses(tok, ex.query, tok(ex.query, add_special_tokens=False)["input_ids"])


def test_real_tokenizer_clause_starts_inside_a_token(qwen35):
    """' WHERE' carries the space before the clause, '.name' fuses the dot with the column: the SELECT
    clause ends on '.name', FROM on its table alias, and the next clause's first token starts in the gap."""
    tok, _ = qwen35
    sql = "SELECT T1.name FROM singer AS T1 WHERE T1.age > 20"
    ids = tok(sql, add_special_tokens=False)["input_ids"]
    text, offsets = decode_with_offsets(tok, ids)
    ends, ok = clause_token_ends(text, offsets)
    tokens = tok.convert_ids_to_tokens(ids)
    assert ok and [tokens[e] for e in ends] == [".name", "1", "0"]
    assert [tokens[e + 1] for e in ends[:-1]] == ["ĠFROM", "ĠWHERE"]
    units = split_clauses(sql)
    assert [int(offsets[e + 1][0]) for e in ends[:-1]] == [u.start - 1 for u in units[1:]]   # the space


def test_real_tokenizer_multibyte_characters_sampled_byte_by_byte(qwen35):
    """A policy may emit a character's UTF-8 bytes as separate tokens: the clause ending in it ends on the
    token that completes the character, not on one that leaves it half written."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok, _ = qwen35
    byte_token = {b: tok.convert_tokens_to_ids(ch) for b, ch in bytes_to_unicode().items()}
    head, word, tail = "SELECT", " 東京", " FROM t WHERE a = 'é'"
    bytes_of_word = [byte_token[b] for b in word.encode("utf-8")]           # 7 tokens: ' ' and 6 bytes
    ids = (tok(head, add_special_tokens=False)["input_ids"] + bytes_of_word
           + tok(tail, add_special_tokens=False)["input_ids"])
    sql = head + word + tail
    assert ids != tok(sql, add_special_tokens=False)["input_ids"]           # not the canonical tokens
    text, offsets = decode_with_offsets(tok, ids)
    assert text == sql
    ends, ok = clause_token_ends(text, offsets)
    first_after = len(tok(head, add_special_tokens=False)["input_ids"]) + len(bytes_of_word)
    assert ok and ends[0] == first_after - 1          # the 6th byte completes 京, the SELECT clause's last char
    assert tok.decode(ids[: ends[0]]).endswith("\ufffd") and tok.decode(ids[: ends[0] + 1]) == head + word
    assert ends[-1] == len(ids) - 1 and tok.decode(ids[ends[-1]:]).endswith("'")


def test_real_tokenizer_rollout_reads_the_last_clause_at_im_end(qwen35, executors):
    """assemble_rollout with Qwen3.5's ids: <|im_end|> (248046) stops a completion and is where its last
    clause is read; the other clauses end on their own tokens; rewards come from SQLite."""
    tok, _ = qwen35
    completions = [GOLD, "SELECT name\nFROM t\nWHERE id = 2", "SELECT nom FROM t WHERE name = 'Zürich'"]
    out = fake_output(tok, completions, 248046, 24)
    gold = executors.execute("d", GOLD)
    prompt = np.full((3, 4), 248044, np.int32)
    r = R.assemble_rollout(prompt, prompt, out, tok, executors, ["d"] * 3, [GOLD] * 3, [gold] * 3, (248046,), REWARD)
    assert r.texts == completions
    np.testing.assert_array_equal(r.exec_rewards, [1.0, 0.25, -1.0])
    for b, sql in enumerate(completions):
        ends = r.clause_ends[b][r.clause_ends[b] >= 0]
        assert len(ends) == 3 and ends[-1] == int(out.lengths[b]) - 1 and r.input_ids[b, 4 + ends[-1]] == 248046
        units = split_clauses(sql)
        for unit, end in zip(units[:-1], ends[:-1]):
            assert tok.decode(r.input_ids[b, 4: 4 + end + 1]) == sql[: unit.end]
