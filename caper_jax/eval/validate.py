"""configs/eval.py's values checked before any model or data is loaded (policy evaluation and the
reproduction's evaluation stage, caper_jax/experiments/miniature.py, both read that config)."""
from __future__ import annotations

import pathlib

import jax

from caper_jax.parallel import mesh as mesh_lib
from caper_jax.parallel import rules as rules_lib
from caper_jax.prm.aggregates import AGGREGATES
from caper_jax.sql.semantics import check_semantics


def validate_eval_config(config) -> None:
    """Every value of configs/eval.py checked before any model or data is loaded."""
    if bool(config.policy.workdir) == bool(config.policy.hf_dir):
        raise ValueError("set exactly one of policy.workdir and policy.hf_dir")
    for key, path in (("policy.workdir", config.policy.workdir), ("policy.hf_dir", config.policy.hf_dir),
                      ("prm.path", config.prm.path), ("data.dir", config.data.dir)):
        if path and not pathlib.Path(path).exists():
            raise ValueError(f"{key}={path!r} does not exist")
    check_semantics(config.data.semantics, what="data.semantics")
    unknown = [a for a in config.prm.aggregates if a not in AGGREGATES]
    if unknown or not config.prm.aggregates:
        raise ValueError(f"prm.aggregates={tuple(config.prm.aggregates)}; expected a non-empty subset of {AGGREGATES}")
    s = config.sampling
    if s.k < 0 or s.batch_size < 1 or s.max_new_tokens < 1 or s.max_prompt_len < 1 or config.prm.batch_size < 1:
        raise ValueError("sampling.k must be >= 0; sampling.batch_size, max_new_tokens, max_prompt_len and "
                         "prm.batch_size >= 1")
    if s.temperature <= 0 and s.k > 0:
        raise ValueError("sampling.temperature must be > 0 for k samples (greedy decoding is always evaluated)")
    if not 0 < s.top_p <= 1 or s.top_k < 0:
        raise ValueError(f"sampling.top_p={s.top_p} must be in (0, 1] and sampling.top_k={s.top_k} >= 0")
    if config.data.num_examples < 0 or config.prm.max_len < 0 or config.timeout_s <= 0:
        raise ValueError("data.num_examples and prm.max_len must be >= 0, timeout_s > 0")
    mesh_lib.resolve_mesh_shape(tuple(config.mesh_shape.values()), jax.device_count())
    rules_lib.rules_dict(config.sharding_rules)
