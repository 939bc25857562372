"""The text-to-SQL policy's own code, one job per module, shared by SFT, GRPO, evaluation and the
reproduction:

* ``build``: a policy created in its sharded layout (HF weights or a random preset);
* ``logprobs``: chunked token log-probs, and those of a sequence or of a completion under the policy;
* ``prompts``: the prompt encoding (END_OF_SQL's token id, left-padded prompt batches);
* ``sampling``: the one path from prompts to text (greedy and k samples) through ``models.sampler``;
* ``clause_ends``: where each clause of a completion ends, in tokens (spans to token ends, padded);
* ``rollout``: GRPO's host side of a rollout (text, clause ends, execution rewards) and greedy EX
  (the trainers' end-of-run ``held_out_ex``).

Loading a trained policy from a run directory is ``caper_jax.eval.policy.load_policy``.
"""
