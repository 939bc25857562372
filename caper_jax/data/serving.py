"""What a server needs beside an export's weights: token ids, generation defaults and the chat template.

vLLM and transformers read three things next to ``model.safetensors``:

* ``config.json``'s ``eos_token_id`` / ``pad_token_id``: here the tokenizer's ``END_OF_SQL`` id (the token
  the policy ends its SQL with) and the pad id the run padded with (``resolve_pad_id``);
* ``generation_config.json``: ``eos_token_id`` = ``END_OF_SQL`` then ``<|endoftext|>`` (each one the
  tokenizer has as one token), ``pad_token_id``, and the run's sampling defaults (``generation_defaults``);
* the tokenizer's ``chat_template`` (written into ``tokenizer_config.json``, which every transformers
  release since 4.34 and vLLM read): ChatML as ``policy_prompt`` writes it, no default system turn and no
  thinking block, so ``apply_chat_template(policy_messages(q, schema), add_generation_prompt=True)``
  tokenises to exactly the ids the policy trained on. A tokenizer's own template (a release's, with its
  ``<think>`` block) is replaced: the exported weights were trained on this prompt, not on that one.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from caper_jax.data.clause_encoder import resolve_pad_id
from caper_jax.sql.contract import END_OF_SQL, policy_prompt

IM_START = "<|im_start|>"
END_OF_TEXT = "<|endoftext|>"
GENERATION_CONFIG = "generation_config.json"
# ChatML as caper_jax.sql.contract.policy_prompt writes a turn: role line, content, END_OF_SQL, newline.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + END_OF_SQL + "\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + IM_START + "assistant\\n' -}}{%- endif -%}"
)
_USER_OPEN = f"{IM_START}user\n"
_ASSISTANT_OPEN = f"{END_OF_SQL}\n{IM_START}assistant\n"


def policy_messages(question: str, schema_text: str, evidence: str = "") -> list[dict[str, str]]:
    """The chat messages whose template rendering (``add_generation_prompt=True``) is
    ``policy_prompt(question, schema_text, evidence)``: one user turn, cut out of that very prompt."""
    prompt = policy_prompt(question, schema_text, evidence)
    if not (prompt.startswith(_USER_OPEN) and prompt.endswith(_ASSISTANT_OPEN)):
        raise ValueError(f"policy_prompt is no longer one ChatML user turn and an open assistant turn: {prompt[:40]!r}")
    return [{"role": "user", "content": prompt[len(_USER_OPEN):-len(_ASSISTANT_OPEN)]}]


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def eos_token_ids(tokenizer) -> list[int]:
    """``END_OF_SQL``'s id (the sampler's stop token, ``caper_jax.policy.prompts.stop_token_id``'s rule: the
    one token it encodes to), then ``<|endoftext|>``'s where it is one token too."""
    end_of_sql = _single_token(tokenizer, END_OF_SQL)
    if end_of_sql is None:
        raise ValueError(f"END_OF_SQL {END_OF_SQL!r} is not one token for this tokenizer: an export needs it as eos")
    end_of_text = _single_token(tokenizer, END_OF_TEXT)
    return [end_of_sql] + ([end_of_text] if end_of_text not in (None, end_of_sql) else [])


def generation_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling a run's policy was trained or evaluated with, from its saved config (``as_dict``):
    GRPO's rollout sampling (``sampling.*``); SFT's greedy held-out decoding (``eval.max_new_tokens``);
    none for a converted checkpoint (its release's own generation_config is the reference)."""
    trainer = config["trainer"]
    if trainer == "grpo":
        sampling = config["sampling"]
        # top_k 0 = off, in caper_jax's sampler, transformers' and vLLM's alike
        return {"do_sample": True, "temperature": float(sampling["temperature"]), "top_p": float(sampling["top_p"]),
                "top_k": int(sampling["top_k"]), "max_new_tokens": int(sampling["max_new_tokens"])}
    if trainer == "sft":
        return {"do_sample": False, "max_new_tokens": int(config["eval"]["max_new_tokens"])}
    if trainer == "convert":
        return {}
    raise ValueError(f"no generation defaults for a {trainer!r} run (a policy run is 'sft', 'grpo' or 'convert')")


def add_serving_files(out_dir: str | pathlib.Path, tokenizer, *, generation: Mapping[str, Any] | None,
                      chat_template: bool = True) -> pathlib.Path:
    """Completes an export directory (``to_hf``, ``export_prm_to_hf``) for serving: the token ids into its
    config.json, ``generation_config.json`` from ``generation`` (None: none written, as for the PRM's
    sequence classifier), and the tokenizer, with the policy's chat template when ``chat_template``.
    Process 0 only."""
    out = pathlib.Path(out_dir)
    eos = eos_token_ids(tokenizer)
    pad = resolve_pad_id(tokenizer, None)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.update(eos_token_id=eos[0], pad_token_id=pad, bos_token_id=None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    if generation is not None:
        record = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, **generation}
        (out / GENERATION_CONFIG).write_text(json.dumps(record, indent=2, sort_keys=True))
    own_template = tokenizer.chat_template
    try:   # the run's tokenizer object is lent, not changed
        if chat_template:
            tokenizer.chat_template = CHAT_TEMPLATE
        # save_jinja_files=False: the template goes into tokenizer_config.json, which transformers 5 reads
        # too; its default, chat_template.jinja, is unseen by older releases and by tools reading the JSON
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
    finally:
        tokenizer.chat_template = own_template
    return out
