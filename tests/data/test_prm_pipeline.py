"""Clause-PRM pipeline: tokenisation, truncation, buckets, padding, order, resume, host slices.

References are independent of the code under test: byte-level BPE decoding (lossless) checks what
a sequence holds, split_clauses spans check where a clause ends, and plain set arithmetic checks
that hosts and epochs cover every record exactly once.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from caper_jax.data.bucket_plan import bucket_index, default_bucket_lengths, epoch_plan
from caper_jax.data.clause_encoder import ClauseEncoder, ClauseTooLongError, join_sql, record_side
from caper_jax.data.prm_records import RecordError, clause_id
from caper_jax.data.prm_scoring_batches import score_batch
from caper_jax.data.prm_training_batches import BATCH_KEYS, GROUP_KEYS, PrmPipeline, prm_pipeline
from caper_jax.sql.clauses import split_clauses
from caper_jax.sql.contract import CLAUSE_NAMES, COMPOUND_CLAUSE_ID, prm_prompt
from caper_jax.sql.contract import END_OF_SQL as END
from tests.helpers import SCHEMAS, SQLS, make_tokenizer, make_tuples, make_within_tuples, prompt_fn

@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tuples():
    return make_tuples(45)


LADDER = (48, 64, 96, 128, 192)


def build(tuples, tokenizer, **kwargs) -> PrmPipeline:
    kwargs = dict(global_batch_size=8, max_len=192, bucket_lengths=LADDER, seed=3, prompt_fn=prompt_fn) | kwargs
    return prm_pipeline(tuples, tokenizer, **kwargs)


def all_batches(pipeline: PrmPipeline) -> list[dict]:
    return [pipeline.dataset[i] for i in range(len(pipeline.dataset))]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_sequence_is_prompt_prefix_clause_scored_at_last_clause_token(tuples, tokenizer):
    batch = build(tuples, tokenizer).dataset[0]
    assert set(batch) == set(BATCH_KEYS)
    for row in np.flatnonzero(batch["weight"]):
        rec = tuples[batch["record_index"][row]]
        for side in ("chosen", "rejected"):
            ids, mask, pos = batch[f"{side}_ids"][row], batch[f"{side}_mask"][row], batch[f"{side}_pos"][row]
            expected = prompt_fn(rec["question"], rec["schema"]) + rec[f"prefix_{side}"] + rec[side]
            decoded = tokenizer.decode(ids[: pos + 1])
            assert decoded == expected or (pos + 1 == 192 and expected.endswith(decoded))
            assert mask.sum() == pos + 1 and mask[: pos + 1].all()
            # The score token is the clause's own last token: its text ends the clause.
            assert rec[side].endswith(tokenizer.decode(ids[pos : pos + 1]).strip())
            assert (ids[pos + 1 :] == tokenizer.pad_token_id).all()
        assert batch["margin"][row] == np.float32(rec["margin"])
        expected_id = COMPOUND_CLAUSE_ID if rec["clause"] == "UNION" else CLAUSE_NAMES.index(rec["clause"])
        assert batch["clause_id"][row] == expected_id


def test_left_truncation_keeps_the_clause(tokenizer):
    sql = SQLS[2]
    where = split_clauses(sql)[-1]
    question, schema, prefix = "Which songs sold well?", SCHEMAS[0], sql[: where.start]
    # Prompt and SQL are tokenised apart (as a policy's generated SQL continues its prompt).
    full = [ids for text in (prompt_fn(question, schema), sql)
            for ids in tokenizer(text, add_special_tokens=False)["input_ids"]]
    # Reference: the fewest trailing tokens of the whole text that still hold the whole clause.
    fewest = next(m for m in range(1, len(full)) if where.text in tokenizer.decode(full[-m:]))
    for max_len in (fewest, fewest + 3, len(full) - 5):
        encoder = ClauseEncoder(tokenizer, max_len=max_len, prompt_fn=prompt_fn)
        (ids,) = encoder.encode([(question, schema, prefix, where.text)])
        assert len(ids) == max_len
        np.testing.assert_array_equal(ids, full[-max_len:])  # cut from the left only
    with pytest.raises(ClauseTooLongError, match="record 7"):
        ClauseEncoder(tokenizer, max_len=fewest - 1, prompt_fn=prompt_fn).encode(
            [(question, schema, prefix, where.text)], [7])


def test_buckets_are_the_shortest_that_fit_and_only_the_last_batch_pads(tuples, tokenizer):
    pipeline = build(tuples, tokenizer, num_epochs=2)
    encoder = ClauseEncoder(tokenizer, 192, prompt_fn)
    lengths = [max(len(ids) for ids in encoder.encode([record_side(r, "chosen"), record_side(r, "rejected")]))
               for r in tuples]
    assert len(set(bucket_index(np.asarray(lengths), LADDER))) >= 3  # the data spans buckets
    batches = all_batches(pipeline)
    assert pipeline.steps_per_epoch == 6 and len(batches) == 12  # ceil(45 / 8) per epoch
    for epoch in range(2):
        epoch_batches = batches[epoch * 6 : (epoch + 1) * 6]
        partial = [b for b in epoch_batches if b["weight"].min() == 0]
        assert len(partial) == 1 and partial[0]["weight"].sum() == 45 % 8
        for b in epoch_batches:
            longest = max(lengths[i] for i in b["record_index"] if i >= 0)
            assert b["chosen_ids"].shape[1] == b["rejected_ids"].shape[1] == min(n for n in LADDER if n >= longest)


def test_padding_rows_are_inert(tuples, tokenizer):
    pipeline = build(tuples, tokenizer)
    (batch,) = [b for b in all_batches(pipeline) if b["weight"].min() == 0]
    pad = batch["weight"] == 0
    assert pad.sum() == 8 - 45 % 8
    assert (batch["record_index"][pad] == -1).all() and (batch["margin"][pad] == 0).all()
    for side in ("chosen", "rejected"):
        # One visible token keeps attention rows non-empty; the weight removes the row from the loss.
        assert (batch[f"{side}_mask"][pad].sum(axis=1) == 1).all()
        assert (batch[f"{side}_pos"][pad] == 0).all()


def test_every_record_once_per_epoch_reshuffled_and_seed_deterministic(tuples, tokenizer):
    batches = all_batches(build(tuples, tokenizer, num_epochs=2))
    orders = []
    for epoch in range(2):
        seen = np.concatenate([b["record_index"] for b in batches[epoch * 6 : (epoch + 1) * 6]])
        seen = seen[seen >= 0]
        assert sorted(seen) == list(range(45))
        orders.append(list(seen))
    assert orders[0] != orders[1]
    assert_batches_equal(batches, all_batches(build(tuples, tokenizer, num_epochs=2)))
    other = np.concatenate([b["record_index"] for b in all_batches(build(tuples, tokenizer, seed=4))])
    assert list(other[other >= 0]) != orders[0]


def test_infinite_repeat_keeps_reshuffling(tuples, tokenizer):
    pipeline = build(tuples, tokenizer, num_epochs=None)
    assert len(pipeline.dataset) > 10**9
    third = [pipeline.dataset[2 * 6 + s]["record_index"] for s in range(6)]
    seen = np.concatenate(third)
    assert sorted(seen[seen >= 0]) == list(range(45))


@pytest.mark.parametrize("stop", [2, 5, 8])  # mid-epoch, end of epoch 0 - 1, inside epoch 1
def test_iterator_state_resumes_exactly(tuples, tokenizer, stop):
    pipeline = build(tuples, tokenizer, num_epochs=2)
    it = pipeline.iterator(num_threads=2, prefetch=3)
    for _ in range(stop):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # survives a JSON round trip (checkpoint)
    expected = list(it)
    fresh = build(tuples, tokenizer, num_epochs=2).iterator(num_threads=1)
    fresh.set_state(state)
    assert_batches_equal(list(fresh), expected)
    assert_batches_equal(expected, all_batches(pipeline)[stop:])


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_slices_are_disjoint_complete_and_stitch_to_the_global_batch(tuples, tokenizer, hosts):
    whole = all_batches(build(tuples, tokenizer))
    parts = [all_batches(build(tuples, tokenizer, process_index=p, process_count=hosts)) for p in range(hosts)]
    for step, global_batch in enumerate(whole):
        stitched = {k: np.concatenate([parts[p][step][k] for p in range(hosts)]) for k in global_batch}
        assert_batches_equal([stitched], [global_batch])
        host_rows = [set(parts[p][step]["record_index"]) - {-1} for p in range(hosts)]
        assert sum(len(r) for r in host_rows) == len(set().union(*host_rows))
    covered = np.concatenate([b["record_index"] for part in parts for b in part])
    assert sorted(covered[covered >= 0]) == list(range(45))


@dataclasses.dataclass
class Tuple_:  # shape of caper_jax.sql.tuples.PreferenceTuple (asdict-able)
    question: str
    db_id: str
    schema: str
    clause: str
    prefix_chosen: str
    chosen: str
    prefix_rejected: str
    rejected: str
    margin: float
    provenance: str
    gold_sql: str
    negative_sql: str


def test_sources_jsonl_bytes_features_and_dataclasses_agree(tuples, tokenizer, tmp_path):
    path = tmp_path / "tuples.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" + ("\n" if i == 3 else "") for i, t in enumerate(tuples)))
    features = [{k: (v.encode() if isinstance(v, str) else np.float32(v)) for k, v in t.items()} for t in tuples]
    reference = all_batches(build(tuples, tokenizer))
    for source in (str(path), [json.dumps(t).encode() for t in tuples], features,
                   [Tuple_(**t) for t in tuples], iter(tuples)):
        assert_batches_equal(all_batches(build(source, tokenizer)), reference)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("chosen"), "record 5: missing keys \\['chosen'\\]"),
    (lambda t: t.update(margin=-0.5), "record 5: margin must be a finite number > 0"),
    (lambda t: t.update(margin=float("nan")), "record 5: margin"),
    (lambda t: t.update(clause="WINDOW"), "record 5: unknown clause name 'WINDOW'"),
    (lambda t: t.update(question=3), "record 5: 'question' must be a string"),
])
def test_bad_records_fail_at_construction_with_their_index(tuples, tokenizer, edit, message):
    bad = [dict(t) for t in tuples[:8]]
    edit(bad[5])
    with pytest.raises(RecordError, match=message):
        build(bad, tokenizer)


def test_bad_arguments_are_rejected(tuples, tokenizer):
    with pytest.raises(ValueError, match="multiple of process_count"):
        build(tuples, tokenizer, global_batch_size=6, process_count=4)
    with pytest.raises(ValueError, match="exceeds the longest bucket"):
        build(tuples, tokenizer, bucket_lengths=(16, 32), max_len=64)
    with pytest.raises(RecordError, match="record 0: not valid JSON"):
        build([b"{not json"], tokenizer)


def test_default_bucket_ladder():
    assert default_bucket_lengths(1024) == (64, 128, 192, 256, 384, 512, 768, 1024)
    assert default_bucket_lengths(600) == (64, 128, 192, 256, 384, 512, 600)
    assert default_bucket_lengths(50) == (50,)


def test_epoch_plan_groups_buckets_and_carries_leftovers_up():
    buckets = np.asarray([0] * 5 + [1] * 6 + [2] * 2)
    rows, batch_bucket = epoch_plan(buckets, 4, seed=0, epoch=0)
    assert rows.shape == (4, 4) and sorted(rows[rows >= 0]) == list(range(13))
    for r, b in zip(rows, batch_bucket):
        assert b == buckets[r[r >= 0]].max()
    # Sorted by bucket, 13 rows cut in 4s: [0 0 0 0][0 1 1 1][1 1 1 2][2 pad pad pad].
    assert sorted(batch_bucket.tolist()) == [0, 1, 2, 2]


def test_score_batch_marks_every_clause_and_matches_training_sequences(tokenizer):
    rows = [dict(question=f"q{i} how many?", schema=SCHEMAS[i % 2], sql=sql) for i, sql in enumerate(SQLS)]
    rows.append(dict(question="broken", schema=SCHEMAS[0], sql="SELEC name FROMM"))
    out = score_batch(rows, tokenizer, max_len=192, bucket_lengths=LADDER, prompt_fn=prompt_fn)
    assert out["input_ids"].shape[1] in LADDER and out["clause_pos"].shape[1] == 8
    encoder = ClauseEncoder(tokenizer, 192, prompt_fn)
    for b, row in enumerate(rows[:-1]):
        units = split_clauses(row["sql"])
        prompt = prompt_fn(row["question"], row["schema"])
        for k, unit in enumerate(units):
            pos = out["clause_pos"][b, k]
            end = END if k == len(units) - 1 else ""     # the last clause is read after the end of the query
            assert tokenizer.decode(out["input_ids"][b, : pos + 1]) == prompt + row["sql"][: unit.end] + end
            (train_ids,) = encoder.encode([(row["question"], row["schema"], row["sql"][: unit.start],
                                            unit.text + end)])
            np.testing.assert_array_equal(out["input_ids"][b, : pos + 1], train_ids)
            assert out["clause_id"][b, k] == clause_id(unit.name)
        assert (out["clause_pos"][b, len(units) :] == -1).all()
    assert (out["clause_pos"][-1] == -1).all() and out["mask"][-1].sum() > 0


def test_score_batch_truncation_drops_only_clauses_that_fall_off(tokenizer):
    row = dict(question="q", schema=SCHEMAS[0], sql=SQLS[0])
    full = score_batch([row], tokenizer, max_len=192, bucket_lengths=LADDER, prompt_fn=prompt_fn)
    sql_tokens = len(tokenizer(SQLS[0], add_special_tokens=False)["input_ids"])
    cut = score_batch([row], tokenizer, max_len=sql_tokens - 2, bucket_lengths=(sql_tokens - 2,),
                         prompt_fn=prompt_fn)
    shift = int(full["mask"].sum()) - (sql_tokens - 2)
    expected = np.where(full["clause_pos"] - shift >= 0, full["clause_pos"] - shift, -1)
    expected[full["clause_pos"] < 0] = -1
    np.testing.assert_array_equal(cut["clause_pos"], expected)
    assert cut["clause_pos"][0, 0] == -1 and cut["clause_pos"][0, 4] >= 0  # SELECT fell off, LIMIT kept


@pytest.mark.parametrize("kind", ["demo", "qwen35"])
def test_within_groups_score_each_tuple_on_a_prefix_of_one_sequence(kind, tokenizer, request):
    if kind == "qwen35":   # the real tokenizer: a state's last token found by offsets in the whole query
        tokenizer = request.getfixturevalue("qwen35")[0]
    tuples = make_within_tuples()
    n_within = len(tuples) - 2
    pipeline = build(tuples, tokenizer, global_batch_size=2, within_batch_size=3, num_epochs=None)
    # 7 negatives -> 7 groups; the 2 mutation tuples are the pair rows (1 step per epoch).
    assert pipeline.num_groups == len(SQLS) and pipeline.steps_per_epoch == 1
    assert pipeline.host_group_batch_size == 3
    encoder = ClauseEncoder(tokenizer, 192, prompt_fn)
    seen = []
    for step in range(3):  # 7 groups in 3s: 3 steps of the group plan, the last with 2 padding rows
        batch = pipeline.dataset[step]
        assert set(batch) == set(BATCH_KEYS) | set(GROUP_KEYS)
        assert sorted(batch["record_index"]) == [n_within, n_within + 1]
        assert batch["group_ids"].shape[1] == batch["chosen_ids"].shape[1] and batch["group_pos"].shape[1] == 8
        for row in range(3):
            if batch["group_weight"][row] == 0:  # padding group: inert
                assert batch["group_mask"][row].sum() == 1 and (batch["group_pos"][row] == -1).all()
                assert (batch["group_margin"][row] == 0).all()
                continue
            ids, pos, margin = batch["group_ids"][row], batch["group_pos"][row], batch["group_margin"][row]
            members = [t for t in tuples[:n_within]
                       if tokenizer.decode(ids[: pos[0] + 1]) == prompt_fn(t["question"], t["schema"])
                       + t["prefix_rejected"] + t["rejected"]]
            assert len(members) == (pos >= 0).sum() - 1 and margin[0] == 0
            for k, t in enumerate(members, start=1):
                # Slot k is exactly the token sequence the pair pipeline builds for the chosen side,
                # slot 0 the one it builds for the rejected (root) side; the margin is the tuple's.
                (chosen,) = encoder.encode([record_side(t, "chosen")])
                (rejected,) = encoder.encode([record_side(t, "rejected")])
                np.testing.assert_array_equal(ids[: pos[k] + 1], chosen)
                np.testing.assert_array_equal(ids[: pos[0] + 1], rejected)
                assert margin[k] == np.float32(t["margin"])
            assert (margin[len(members) + 1:] == 0).all()
            seen += [tuples.index(t) for t in members]
    assert sorted(seen) == list(range(n_within))  # each within tuple in exactly one group per cycle


def test_only_within_tuples_give_padding_pair_rows_and_an_epoch_of_groups(tokenizer):
    pipeline = build(make_within_tuples()[:-2], tokenizer, global_batch_size=2, within_batch_size=3)
    assert pipeline.steps_per_epoch == 3 and len(pipeline.dataset) == 3  # ceil(7 groups / 3)
    batches = all_batches(pipeline)
    assert all((b["weight"] == 0).all() and (b["record_index"] == -1).all() for b in batches)
    assert sum(b["group_weight"].sum() for b in batches) == 7


def test_within_tuples_that_are_not_prefixes_of_their_query_stay_pairs(tokenizer):
    tuples = make_within_tuples()
    tuples[0] = dict(tuples[0], negative_sql="SELECT something else")
    pipeline = build(tuples, tokenizer, global_batch_size=3, within_batch_size=3)
    rows = np.concatenate([pipeline.dataset[s]["record_index"] for s in range(pipeline.steps_per_epoch)])
    assert sorted(rows[rows >= 0]) == [0, len(tuples) - 2, len(tuples) - 1]
    with pytest.raises(ValueError, match="within_batch_size=3 must be 0 or a positive multiple"):
        build(tuples, tokenizer, global_batch_size=2, within_batch_size=3, process_count=2)


def test_counterfactual_tuples_repeat_per_epoch(tokenizer):
    tuples = make_within_tuples()  # 7 within groups of 7 queries, then 2 mutation tuples
    n_within = len(tuples) - 2
    first = [i for i, t in enumerate(tuples) if t["negative_sql"] == SQLS[0]]  # query 0's within tuples
    for i in first:
        tuples[i] = dict(tuples[i], provenance="within:counterfactual")
    tuples[-1] = dict(tuples[-1], provenance="counterfactual")
    # Pairs: mutation tuple once, counterfactual tuple 3 times -> 4 rows, 2 steps of 2 per epoch.
    pipeline = build(tuples, tokenizer, global_batch_size=2, within_batch_size=3, counterfactual_repeat=3,
                     num_epochs=None)
    assert pipeline.steps_per_epoch == 2 and pipeline.num_groups == 7 + 2  # query 0's group 3 times
    rows = np.concatenate([pipeline.dataset[s]["record_index"] for s in range(2)])
    assert sorted(rows.tolist()) == [n_within, n_within + 1, n_within + 1, n_within + 1]
    # One cycle of the group plan: 9 group rows in 3 steps of 3; query 0's root state in 3 of them.
    encoder = ClauseEncoder(tokenizer, 192, prompt_fn)
    (root0,) = encoder.encode([record_side(tuples[first[0]], "rejected")])
    hits = 0
    for step in range(3):
        batch = pipeline.dataset[step]
        for row in np.flatnonzero(batch["group_weight"]):
            pos = batch["group_pos"][row, 0]
            hits += pos + 1 == len(root0) and (batch["group_ids"][row, : pos + 1] == root0).all()
    assert hits == 3
    assert build(tuples, tokenizer, global_batch_size=2).steps_per_epoch == -(-len(tuples) // 2)  # default 1
    with pytest.raises(ValueError, match="counterfactual_repeat=0 must be >= 1"):
        build(tuples, tokenizer, counterfactual_repeat=0)


def test_lm_weight_leaves_out_a_wrong_querys_states(tokenizer):
    """The PRM's auxiliary LM term learns the chosen side's SQL token by token; a within-trajectory
    tuple's chosen side is a state of the wrong query (after its wrong root clause when it comes later),
    so its pair row has lm_weight 0, while gold-side rows (here: fault injection) have 1."""
    tuples = make_within_tuples()
    pipeline = build(tuples, tokenizer, global_batch_size=4, within_batch_size=0, num_epochs=1)
    seen = {0.0: 0, 1.0: 0}
    for batch in all_batches(pipeline):
        for row in np.flatnonzero(batch["weight"]):
            within = tuples[batch["record_index"][row]]["provenance"].startswith("within:")
            assert batch["lm_weight"][row] == (0.0 if within else 1.0)
            seen[float(batch["lm_weight"][row])] += 1
        assert (batch["lm_weight"][batch["weight"] == 0] == 0).all()   # padding rows
    assert seen[0.0] == len(tuples) - 2 and seen[1.0] == 2


# ---------------------------------------------------------------------------------------------
# The real Qwen3.5 tokenizer (the session's ``qwen35`` fixture) on Spider's SQL and prompts

# Multi-line, compound and non-ASCII SQL next to Spider's: a clause keyword after a newline carries no
# leading space (HAVING then splits into 'HAV' 'ING'), and multi-byte characters split into byte tokens.
HARD_SQLS = (
    "SELECT max(a)\nFROM t GROUP BY b\nHAVING count(*) > 2",
    "SELECT a FROM t WHERE a IN (SELECT b FROM c)\nORDER BY d",
    "SELECT \"名前\" FROM 表 WHERE 市 = '東京' UNION SELECT nom FROM élève WHERE ville = 'Zürich'",
    "SELECT T1.name FROM singer AS T1 WHERE T1.age > 20 ORDER BY T1.age DESC LIMIT 3",
)


def spider_rows(spider, every: int = 7) -> list[dict]:
    from caper_jax.data.spider import load_schemas, load_split
    from caper_jax.sql.contract import serialize_schema

    examples = load_split(spider, "dev")
    schemas = {db_id: serialize_schema(entry) for db_id, entry in load_schemas(spider, "dev").items()}
    rows = [dict(question=e.question, schema=schemas[e.db_id], sql=e.query) for e in examples[::every]]
    return rows + [dict(question="Which names?", schema=rows[0]["schema"], sql=sql) for sql in HARD_SQLS]


def test_real_tokenizer_scores_each_clause_at_its_last_token_as_training_does(qwen35, spider):
    """Qwen3.5's BPE on Spider dev golds: the training sequence of every clause (prompt + preceding SQL +
    clause) is exactly the prefix of the whole query's sequence that score_batch reads it at; that token
    holds the clause's last character and nothing of the next clause; the last clause is read at
    <|im_end|> (248046)."""
    tok, _ = qwen35
    rows = spider_rows(spider)
    out = score_batch(rows, tok, max_len=2048, bucket_lengths=(512, 1024, 2048))
    encoder = ClauseEncoder(tok, 2048)
    checked = 0
    for b, row in enumerate(rows):
        units = split_clauses(row["sql"])
        prompt = tok(prm_prompt(row["question"], row["schema"]), add_special_tokens=False)["input_ids"]
        ids = out["input_ids"][b]
        for k, unit in enumerate(units):
            pos = int(out["clause_pos"][b, k])
            last = k == len(units) - 1
            (train_ids,) = encoder.encode([(row["question"], row["schema"], row["sql"][: unit.start],
                                            unit.text + (END if last else ""))])
            np.testing.assert_array_equal(ids[: pos + 1], train_ids, err_msg=f"{row['sql']!r} {unit.name}")
            sql_so_far = tok.decode(ids[len(prompt): pos + 1])
            if last:
                assert ids[pos] == 248046 and sql_so_far == row["sql"][: unit.end] + END
            else:   # the token read holds the clause's last character, the one before it does not
                assert sql_so_far == row["sql"][: unit.end], (row["sql"], unit.name, sql_so_far)
                assert len(tok.decode(ids[len(prompt): pos])) < unit.end
            checked += 1
    assert checked > 400


def test_real_tokenizer_pipeline_batches_and_left_truncation(qwen35):
    """The pair pipeline with Qwen3.5's tokenizer: rows decode to prompt + prefix + clause, the score
    position is the clause's last token, padding is <|endoftext|>; a cut keeps the clause whole."""
    tok, _ = qwen35
    tuples = make_tuples(24)
    pipeline = build(tuples, tok, max_len=192, bucket_lengths=(64, 128, 192))
    batch = pipeline.dataset[0]
    for row in np.flatnonzero(batch["weight"]):
        rec = tuples[batch["record_index"][row]]
        for side in ("chosen", "rejected"):
            ids, pos = batch[f"{side}_ids"][row], batch[f"{side}_pos"][row]
            text = prompt_fn(rec["question"], rec["schema"]) + join_sql(rec[f"prefix_{side}"], rec[side])
            assert tok.decode(ids[: pos + 1]) == text
            assert (ids[pos + 1:] == 248044).all()
    sql = HARD_SQLS[3]
    where = split_clauses(sql)[2]
    full = tok(prm_prompt("q", "t(a)"), add_special_tokens=False)["input_ids"] + \
        tok(sql[: where.end], add_special_tokens=False)["input_ids"]
    clause_tokens = len(tok(" " + where.text, add_special_tokens=False)["input_ids"])   # ' WHERE' ... '2' '0'
    for max_len in (clause_tokens, clause_tokens + 5):
        (ids,) = ClauseEncoder(tok, max_len).encode([("q", "t(a)", sql[: where.start], where.text)])
        assert ids.tolist() == full[-max_len:] and tok.decode(ids).endswith(where.text)
    with pytest.raises(ClauseTooLongError):
        ClauseEncoder(tok, clause_tokens - 1).encode([("q", "t(a)", sql[: where.start], where.text)])
