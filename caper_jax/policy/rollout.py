"""Rollouts: sampled completions turned into text, clause token ends and execution rewards; greedy EX.

Device work is the sampler (one jitted prefill + one jitted decode loop, ``caper_jax.models.sampler``)
and, in the trainer, one batched PRM forward. Everything here after sampling is host-side Python on
small arrays:

* **Text and offsets of the SAMPLED tokens** (``sampling.decode_with_offsets``). The completion is
  decoded once. Clause ends must index the tokens the policy actually emitted (their log-probs are
  what GRPO trains), so character offsets are those of the sampled ids: when re-tokenising the text
  gives back exactly those ids (the usual case), the tokenizer's own ``offset_mapping`` is used;
  otherwise (a non-canonical token sequence) each token's end is the length of the decoded prefix up
  to it, and a token that completes no character yet (part of a multi-byte character) gets an empty
  span, so a clause ending in that character maps to the token that completes it.
* **Clause ends** (``clause_ends``): ``split_clauses`` character spans -> ``spans_to_token_ends`` over those
  offsets, in completion coordinates (token 0 = first generated token).
* **Execution reward**: the completion runs sandboxed (read-only, authoriser, timeout, row cap) and is
  compared with the gold result (Spider semantics: ordered iff the gold has ORDER BY). Correct ->
  ``correct_reward``, wrong result -> ``wrong_reward``, error / empty / unparseable -> ``failure_reward``.
  Garbage never raises: it is a failed sample with one unit (``layout_rewards``' fallback).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from caper_jax.models.sampler import SampleOutput
from caper_jax.parallel import multihost
from caper_jax.parallel.multihost import fetch
from caper_jax.policy.clause_ends import clause_token_ends, pad_clause_ends
from caper_jax.policy.sampling import completion_tokens, decode, decode_with_offsets
from caper_jax.sql.contract import policy_prompt
from caper_jax.sql.execution import ExecResult, Executors, order_matters, results_equal
from caper_jax.utils.subset import seeded_subset


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    correct_reward: float = 1.0
    wrong_reward: float = 0.0
    failure_reward: float = 0.0      # execution error, empty or unparseable SQL
    semantics: str = "spider"        # results_equal semantics: "spider" | "bird"


@dataclasses.dataclass(frozen=True)
class ScoredCompletion:
    text: str
    clause_ends: np.ndarray   # int32 [k], token index (completion coordinates) of each clause's last token
    parse_ok: bool            # split_clauses accepted the text
    executed: bool            # SQLite ran it without error
    correct: bool             # result equals the gold result
    reward: float             # execution reward (RewardConfig)


def execution_reward(executors: Executors, db_id: str, gold_sql: str, gold: ExecResult, sql: str,
                     config: RewardConfig) -> tuple[float, bool, bool]:
    """(reward, executed, correct) of ``sql`` against the gold result; never raises on bad SQL."""
    result = executors.execute(db_id, sql)
    if not result.ok:
        return config.failure_reward, False, False
    correct = results_equal(gold, result, semantics=config.semantics, ordered=order_matters(gold_sql))
    return (config.correct_reward if correct else config.wrong_reward), True, correct


def score_completion(tokenizer, executors: Executors, ids: Sequence[int], db_id: str, gold_sql: str,
                     gold: ExecResult, config: RewardConfig, stop_index: int | None = None) -> ScoredCompletion:
    """``stop_index``: the completion's stop token, when it stopped. The last clause then ends there,
    so the PRM reads it after the end of the query, as it was trained (``caper_jax.sql.tuples``)."""
    text, offsets = decode_with_offsets(tokenizer, ids)
    ends, parse_ok = clause_token_ends(text, offsets)
    if parse_ok and stop_index is not None:
        ends = ends.copy()
        ends[-1] = stop_index
    if not text.strip():
        reward, executed, correct = config.failure_reward, False, False
    else:
        reward, executed, correct = execution_reward(executors, db_id, gold_sql, gold, text, config)
    if not parse_ok:  # sqlglot refused it: whatever SQLite made of it, it is a format failure
        reward = config.failure_reward
    return ScoredCompletion(text, ends, parse_ok, executed, correct, float(reward))


@dataclasses.dataclass
class RolloutBatch:
    """One rollout, host-side numpy, rows = prompts x group (consecutive rows share a prompt)."""

    input_ids: np.ndarray        # int32 [B, P + N]: left-padded prompt, then completion (pad after stop)
    attention_mask: np.ndarray   # int32 [B, P + N]
    completion_mask: np.ndarray  # int32 [B, N]: generated tokens, stop token included
    old_logp: np.ndarray         # float32 [B, N]: sampler log-probs (tempered), 0 off the mask
    clause_ends: np.ndarray      # int32 [B, K]: completion coordinates, -1 padded
    exec_rewards: np.ndarray     # float32 [B]
    parse_ok: np.ndarray         # bool [B]
    executed: np.ndarray         # bool [B]
    correct: np.ndarray          # bool [B]
    texts: list[str]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]


def assemble_rollout(prompt_ids: np.ndarray, prompt_mask: np.ndarray, output: SampleOutput, tokenizer,
                     executors: Executors, db_ids: Sequence[str], gold_sqls: Sequence[str],
                     golds: Sequence[ExecResult], stop_tokens: Sequence[int], reward: RewardConfig,
                     clause_multiple: int = 8) -> RolloutBatch:
    """Host side of a rollout: decode, split into clauses, execute. Row ``b`` answers ``db_ids[b]``."""
    tokens, lengths = fetch(output.tokens), fetch(output.lengths)
    log_probs = fetch(output.log_probs).astype(np.float32)
    batch, new = tokens.shape
    completion_mask = (np.arange(new)[None, :] < lengths[:, None]).astype(np.int32)
    scored = []
    for b in range(batch):
        ids = completion_tokens(tokens[b], lengths[b], stop_tokens)
        stopped = len(ids) < lengths[b]          # the stop token was generated (it ends the completion)
        scored.append(score_completion(tokenizer, executors, ids, db_ids[b], gold_sqls[b], golds[b], reward,
                                       stop_index=int(lengths[b]) - 1 if stopped else None))
    most = max([len(s.clause_ends) for s in scored] + [1])
    clause_ends = pad_clause_ends([s.clause_ends for s in scored], -(-most // clause_multiple) * clause_multiple)
    return RolloutBatch(
        input_ids=np.concatenate([np.asarray(prompt_ids, np.int32), tokens.astype(np.int32)], axis=1),
        attention_mask=np.concatenate([np.asarray(prompt_mask, np.int32), completion_mask], axis=1),
        completion_mask=completion_mask,
        old_logp=np.where(completion_mask > 0, log_probs, 0.0).astype(np.float32),
        clause_ends=clause_ends,
        exec_rewards=np.asarray([s.reward for s in scored], np.float32),
        parse_ok=np.asarray([s.parse_ok for s in scored]),
        executed=np.asarray([s.executed for s in scored]),
        correct=np.asarray([s.correct for s in scored]),
        texts=[s.text for s in scored],
    )


def greedy_ex(model, tokenizer, examples, executors: Executors, *, max_prompt_len: int, max_new_tokens: int,
              stop_tokens: Sequence[int], batch_size: int, semantics: str = "spider") -> tuple[dict, list[dict]]:
    """Execution accuracy of greedy decoding on ``examples`` (``SftExample``s); (summary, per-example rows).

    Examples whose gold SQL fails to execute are excluded and counted under ``excluded``.
    """
    usable, excluded = [], 0
    for ex in examples:
        gold = executors.execute(ex.db_id, ex.sql)
        if gold.ok:
            usable.append((ex, gold))
        else:
            excluded += 1
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex, _ in usable]
    preds, _ = decode(model, tokenizer, prompts, stop_tokens=stop_tokens, max_prompt_len=max_prompt_len,
                      max_new_tokens=max_new_tokens, batch_size=batch_size)
    reward = RewardConfig(semantics=semantics)
    rows = []
    for (ex, gold), pred in zip(usable, preds):
        _, executed, correct = execution_reward(executors, ex.db_id, ex.sql, gold, pred, reward) \
            if pred.strip() else (0.0, False, False)
        rows.append({"db_id": ex.db_id, "question": ex.question, "gold": ex.sql, "pred": pred,
                     "executed": executed, "correct": correct})
    n = len(rows)
    summary = {"ex": sum(r["correct"] for r in rows) / n if n else 0.0,
               "executable": sum(r["executed"] for r in rows) / n if n else 0.0,
               "n": n, "excluded": excluded}
    return summary, rows


def held_out_ex(model, tokenizer, examples, executors: Executors, *, num_examples: int, seed: int, split: str,
                max_prompt_len: int, max_new_tokens: int, stop_tokens: Sequence[int], batch_size: int,
                semantics: str = "spider") -> tuple[dict, list[dict]]:
    """A policy trainer's end-of-run greedy EX (SFT and GRPO): ``greedy_ex`` on ``num_examples`` of the
    held-out ``split``'s ``examples`` (``seeded_subset`` by ``seed``), logged as one line.

    Returns (the ``eval/*`` entries of the trainer's results.json, the per-example rows).
    """
    summary, rows = greedy_ex(model, tokenizer, seeded_subset(examples, num_examples, seed), executors,
                              max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                              batch_size=batch_size, semantics=semantics)
    multihost.log_main("greedy EX on %d held-out %s examples: %.3f (executable %.3f)", summary["n"], split,
                       summary["ex"], summary["executable"])
    return {"eval/greedy_ex": summary["ex"], "eval/executable": summary["executable"], "eval/n": summary["n"],
            "eval/excluded": summary["excluded"]}, rows
