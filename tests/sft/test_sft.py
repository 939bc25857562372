"""SFT: the loss reads only SQL + stop targets (checked against a float64 NLL of the model's own full
logits), training reduces it, the pipeline's targets are exactly the SQL, and a run resumes.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from caper_jax.sql.contract import END_OF_SQL, policy_prompt
from caper_jax.utils.optim import init_state, make_optimizer
from caper_jax.sft import data as D
from caper_jax.sft import trainer as S
from caper_jax.utils.monitoring import read_metrics
from tests.sft import hand_tokenizer, persistent_compile_cache, random_policy

VOCAB = 64


def tiny_batch():
    """Two sequences, prompt lengths 5 and 3, SQL+stop lengths 4 and 6, padded to 12 (+ a padding row)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, VOCAB, 9).astype(np.int32), rng.integers(4, VOCAB, 9).astype(np.int32)]
    return D.make_batch(seqs, [5, 3], length=12, size=3, pad_id=0), seqs


def reference_nll(model, batch) -> float:
    """float64 NLL of the masked targets from the model's own full ``[B, T, V]`` logits."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p)(ids, mask))
    logits = np.asarray(forward(params, batch["input_ids"], batch["attention_mask"]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"].astype(bool)
    return float(-picked[mask].sum() / mask.sum())


def test_batch_layout_by_hand():
    batch, seqs = tiny_batch()
    # Row 0: prompt 5 tokens, targets 4: positions 4..7 predict tokens 5..8.
    np.testing.assert_array_equal(np.flatnonzero(batch["loss_mask"][0]), [4, 5, 6, 7])
    np.testing.assert_array_equal(batch["targets"][0, 4:8], seqs[0][5:9])
    np.testing.assert_array_equal(np.flatnonzero(batch["loss_mask"][1]), [2, 3, 4, 5, 6, 7])
    assert batch["loss_mask"][2].sum() == 0 and batch["attention_mask"][2].sum() == 1


def test_loss_masks_the_prompt():
    model = random_policy(VOCAB, scale=0.2)
    graphdef, params = nnx.split(model)
    loss = jax.jit(lambda p, b: S.sft_loss(p, b, graphdef=graphdef, chunk_size=5)[0])
    batch, _ = tiny_batch()
    value = float(loss(params, batch))
    assert value == pytest.approx(reference_nll(model, batch), rel=1e-5)

    changed = dict(batch, targets=batch["targets"].copy())
    off = batch["loss_mask"] == 0
    changed["targets"][off] = (changed["targets"][off] + 7) % VOCAB   # prompt and padding targets
    assert float(loss(params, changed)) == value
    changed["targets"][0, 5] = (changed["targets"][0, 5] + 7) % VOCAB  # one SQL target
    assert float(loss(params, changed)) != pytest.approx(value, rel=1e-6)


def test_few_steps_reduce_the_loss():
    model = random_policy(VOCAB, scale=0.1)
    graphdef, params = nnx.split(model)
    from configs.sft import get_config

    optim = get_config().optim
    optim.update(lr=1e-2, warmup_steps=0, total_steps=10)
    tx = make_optimizer(optim)
    step = S.jit_train_step(graphdef, tx, chunk_size=6)
    state = init_state(params, tx)
    batch, _ = tiny_batch()
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert int(state.step) == 8 and int(state.nonfinite) == 0


EXAMPLES = [D.SftExample(f"How many rows with id {i}?", "t(id number PK, name text)",
                         f"SELECT COUNT(*) FROM t WHERE id = {i}") for i in range(7)]


@pytest.mark.parametrize("tokenizer", ["hand", "qwen35"])
def test_pipeline_targets_truncation_and_resume(tokenizer, request):
    tok = hand_tokenizer() if tokenizer == "hand" else request.getfixturevalue("qwen35")[0]
    stop = D.stop_token_id(tok)
    assert tok.convert_ids_to_tokens(stop) == END_OF_SQL
    pipe = D.sft_pipeline(EXAMPLES, tok, global_batch_size=2, max_len=64, bucket_lengths=(48, 64), seed=1)
    assert pipe.steps_per_epoch == 4
    it = pipe.iterator()
    seen = []
    for _ in range(4):  # one epoch: every example once, targets = its SQL + stop, prompt cut from the left
        batch = next(it)
        assert batch["input_ids"].shape[1] in (48, 64)
        for row in range(2):
            mask = batch["loss_mask"][row].astype(bool)
            if not mask.any():
                continue
            target = tok.decode(batch["targets"][row][mask])
            sql, _, tail = target.partition(END_OF_SQL)
            assert tail == "" and target.endswith(END_OF_SQL)
            seen.append(sql)
            prompt = tok.decode(batch["input_ids"][row][: np.flatnonzero(mask)[0] + 1])
            assert prompt.endswith("<|im_start|>assistant\n")
    assert sorted(seen) == sorted(ex.sql for ex in EXAMPLES)

    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(3)]
    resumed = pipe.iterator()
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["input_ids"], want)

    with pytest.raises(D.SqlTooLongError):
        D.encode_examples([D.SftExample("q", "s", "SELECT " + "x, " * 30 + "y FROM t")], tok, max_len=64)


def test_spider_targets_with_the_real_tokenizer(qwen35, spider):
    """Qwen3.5's tokenizer on Spider dev: each sequence is the prompt's own tokens then the gold's own tokens
    then <|im_end|> (248046), the loss reads exactly those, and a cut drops prompt tokens from the left."""
    tok, _ = qwen35
    examples = D.examples_from_split(spider, "dev")[::5]
    sequences, prompt_lengths = D.encode_examples(examples, tok, max_len=2048)
    for ex, seq, n_prompt in zip(examples, sequences, prompt_lengths):
        prompt = tok(policy_prompt(ex.question, ex.schema), add_special_tokens=False)["input_ids"]
        sql = tok(ex.sql.strip(), add_special_tokens=False)["input_ids"]
        assert seq.tolist() == prompt + sql + [248046] and n_prompt == len(prompt)
        batch = D.make_batch([seq], [n_prompt], length=len(seq) + 3, size=1, pad_id=tok.pad_token_id)
        mask = batch["loss_mask"][0].astype(bool)
        assert tok.decode(batch["targets"][0][mask]) == ex.sql.strip() + END_OF_SQL
        assert (batch["input_ids"][0, len(seq):] == 248044).all()      # padded with <|endoftext|>
    longest = max(examples, key=lambda ex: len(ex.schema))
    (full,), _ = D.encode_examples([longest], tok, max_len=4096)
    n_target = len(tok(longest.sql.strip(), add_special_tokens=False)["input_ids"]) + 1
    (cut,), (n_prompt,) = D.encode_examples([longest], tok, max_len=n_target + 7)
    assert cut.tolist() == full[-(n_target + 7):].tolist() and n_prompt == 7
    assert tok.decode(cut[:n_prompt]).endswith("<|im_start|>assistant\n")
    with pytest.raises(D.SqlTooLongError):
        D.encode_examples([longest], tok, max_len=n_target)


def test_hosts_agree_on_lengths():
    tok = hand_tokenizer()
    hosts = [D.sft_pipeline(EXAMPLES, tok, global_batch_size=4, max_len=64, bucket_lengths=(48, 64), seed=2,
                            process_index=p, process_count=2).iterator() for p in range(2)]
    for _ in range(4):
        a, b = next(hosts[0]), next(hosts[1])
        assert a["input_ids"].shape == b["input_ids"].shape == (2, a["input_ids"].shape[1])
        assert not np.array_equal(a["input_ids"], b["input_ids"])


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_run_writes_results_and_resumes(tmp_path):
    from configs.sft import get_config

    config = get_config()
    config.data.update(demo_train_size=40, demo_dev_size=10, batch_size=4, bucket_lengths=(256,))
    config.eval.update(num_examples=2, batch_size=2, max_new_tokens=8)
    config.update(log_every=1, ckpt_every=1)
    config.optim.total_steps = 2
    with persistent_compile_cache(tmp_path / "xla_cache"):
        results = S.run(S.validate(config), str(tmp_path / "run"))
        assert results["eval/n"] == 2 and results["steps"] == 2
        config.optim.total_steps = 3
        S.run(S.validate(config), str(tmp_path / "run"))
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3]
    export = tmp_path / "run" / "hf_export"
    assert (export / "model.safetensors").is_file() and (export / "tokenizer.json").is_file()
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 3
