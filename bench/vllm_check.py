"""Does vLLM serve caper_jax's exports as written? Greedy tokens, log-probs, chat, and the Clause-PRM.

Two halves in two virtual environments (vLLM pins its own torch and transformers and is kept out of the
project's requirements, docs/operations.md "vLLM check"):

* ``reference`` (the project's .venv, JAX_PLATFORMS=cpu): caper_jax's sampler (``models.sampler.
  generate``, fp32, greedy, stop at END_OF_SQL) and transformers' ``Qwen3_5ForCausalLM`` (fp32 greedy,
  plus fp32 and bf16 log-probs of caper_jax's tokens) on demo-world dev prompts (``policy_prompt``), the
  ids of each prompt and of its chat rendering; then a Clause-PRM export (``prm.export.export_prm_to_hf``,
  bf16) of the policy's backbone with a seeded random head, and caper_jax's fp32 PRM score at every
  token and at each clause end (``data.prm_scoring_batches.score_batch``). Arrays go to
  ``reference.npz``, the rest to ``reference.json``.
* the driver (vLLM's venv, this file without a sub-command): runs the reference half as a subprocess
  with the project's Python, then loads the export in vLLM (bf16: vLLM-CPU's DeltaNet kernel takes
  nothing else) and (1) generates greedily from the same prompt ids (``logprobs=0``: the chosen token's
  log-prob, from the raw logits), (2) scores caper_jax's greedy tokens as prompt tokens
  (``prompt_logprobs=0``), so log-probs compare position by position even past a divergence, (3) runs
  ``LLM.chat`` through the export's chat template, with explicit greedy parameters and with the
  export's generation_config.json defaults, (4) tries the Clause-PRM export through vLLM's pooling
  runner (``token_classify``: one score per token, gathered at the clause ends here). It prints a
  table and writes every figure to ``--json``.

The policy is an end-of-run export of the ``small`` preset (tiny's 32-wide DeltaNet heads fail vLLM-CPU's
kernel: it takes 64 and 128), trained briefly so that it ends its SQL with ``<|im_end|>`` (a random
model never stops, and its near-uniform logits make greedy ties a coin flip):

    # 1. the policy: 50 SFT steps of `small` on the demo world, exported in bf16 (18 min on 2 busy cores)
    JAX_PLATFORMS=cpu .venv/bin/python -m caper_jax.train --config=configs/sft.py:model=small,steps=50 \
        --config.export_dtype=bfloat16 --config.eval.num_examples=8 --workdir=runs/sft_small
    # 2. the check, from the repository root, in vLLM's venv (it starts the reference half itself; ~5 min)
    VLLM_CPU_KVCACHE_SPACE=1 /work/venvs/vllm/bin/python bench/vllm_check.py --run runs/sft_small \
        --json runs/vllm_check.json
    # the reference half alone (what the driver runs; --out DIR --reuse_reference reads it back):
    JAX_PLATFORMS=cpu .venv/bin/python bench/vllm_check.py reference --run runs/sft_small --out DIR

vLLM's venv: docs/operations.md "vLLM check". An engine whose worker fails to start (the PRM export as written)
reports only "Engine core initialization failed" here; the root cause is in the log above it.
Figures are numerics, not timings; the load average is printed with them all the same (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"
sys.path.insert(0, str(ROOT))   # `python bench/vllm_check.py reference` imports caper_jax from this checkout
PRM_HEAD_SEED = 0


# -- comparisons (numpy only: both halves and the tests import them) ------------------------------


def until_stop(tokens, stop_ids) -> list[int]:
    """The generated tokens up to and including the first stop token (all of them if none)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in stop_ids:
            break
    return out


def common_prefix(a, b) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy agreement of two implementations over the same prompts: sequences equal to the stop
    token, and tokens equal before the first divergence (out of the reference's tokens)."""
    same = sum(r == o for r, o in zip(reference, other, strict=True))
    shared = sum(common_prefix(r, o) for r, o in zip(reference, other, strict=True))
    return {"sequences_equal": same, "sequences": len(reference), "tokens_before_divergence": shared,
            "tokens": sum(len(r) for r in reference)}


def logprob_deltas(a: list[np.ndarray], b: list[np.ndarray], lengths: list[int] | None = None) -> dict:
    """max and mean |a - b| over the first ``lengths[i]`` positions of each pair (all: None)."""
    diffs = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = min(len(x), len(y)) if lengths is None else lengths[i]
        diffs.append(np.abs(np.asarray(x[:n], np.float64) - np.asarray(y[:n], np.float64)))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return {"max": float(d.max()) if d.size else None, "mean": float(d.mean()) if d.size else None, "n": int(d.size)}


def load_line() -> str:
    return "load average: " + open("/proc/loadavg").read().strip()


# -- the reference half (project .venv) ----------------------------------------------------------


def reference(run: pathlib.Path, out: pathlib.Path, n_prompts: int, new_tokens: int) -> None:
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from caper_jax.data.clause_encoder import resolve_pad_id
    from caper_jax.data.prm_scoring_batches import score_batch
    from caper_jax.models import from_hf
    from caper_jax.models.sampler import SamplingConfig, generate
    from caper_jax.data import serving
    from caper_jax.policy.prompts import prompt_batch, stop_token_id
    from caper_jax.prm.export import export_prm_to_hf, load_prm_from_hf
    from caper_jax.prm.model import ClausePRM, backbone_config
    from caper_jax.sft.data import examples_from_split
    from caper_jax.sql.contract import policy_prompt

    export = run / "hf_export"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    examples = examples_from_split(run / "demo_world", "dev")[:n_prompts]
    prompts = [policy_prompt(ex.question, ex.schema, ex.evidence) for ex in examples]
    prompt_ids = [list(x) for x in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    stop = stop_token_id(tokenizer)
    stops = serving.eos_token_ids(tokenizer)
    exported = json.loads((export / "config.json").read_text())
    info = {"export": str(export), "export_dtype": exported.get("dtype") or exported.get("torch_dtype"),
            "config_eos_token_id": exported.get("eos_token_id"), "stop_ids": stops,
            "has_generation_config": (export / "generation_config.json").exists(),
            "has_chat_template": bool(getattr(tokenizer, "chat_template", None)), "questions": [], "sql": []}
    # The chat rendering of each prompt, as a server would build it (None: the export has no template).
    chat_ids = []
    for ex, ids in zip(examples, prompt_ids, strict=True):
        info["questions"].append(ex.question)
        info["sql"].append(ex.sql)
        if info["has_chat_template"]:
            rendered = tokenizer.apply_chat_template(serving.policy_messages(ex.question, ex.schema, ex.evidence),
                                                     add_generation_prompt=True, tokenize=False)
            chat_ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    info["messages"] = [serving.policy_messages(ex.question, ex.schema, ex.evidence) for ex in examples]
    info["chat_ids_equal_prompt_ids"] = (sum(c == p for c, p in zip(chat_ids, prompt_ids)) if chat_ids else None)

    # caper_jax: fp32 compute over the export's (bf16-valued) weights, greedy to END_OF_SQL.
    model, config = from_hf(str(export), dtype="float32")
    width = max(map(len, prompt_ids))
    ids, mask = prompt_batch(prompts, tokenizer, max_prompt_len=width, multiple=1)
    sample = generate(model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                      SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_tokens=(stop,),
                                     pad_id=resolve_pad_id(tokenizer, None)))
    tokens, lengths, logps = (np.asarray(x) for x in (sample.tokens, sample.lengths, sample.log_probs))
    jax_tokens = [tokens[b, :lengths[b]].tolist() for b in range(len(prompts))]
    jax_logp = [logps[b, :lengths[b]] for b in range(len(prompts))]

    # transformers: its own greedy generation (fp32) and its log-probs of caper_jax's tokens (fp32, bf16).
    torch.manual_seed(0)
    hf = {dtype: transformers.Qwen3_5ForCausalLM.from_pretrained(str(export), dtype=getattr(torch, dtype)).eval()
          for dtype in ("float32", "bfloat16")}
    hf_tokens, hf_logp, forced = [], [], {"float32": [], "bfloat16": []}
    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=stop,
                                           pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        for p, jt in zip(prompt_ids, jax_tokens, strict=True):
            g = hf["float32"].generate(torch.tensor([p]), generation_config=greedy, output_logits=True,
                                       return_dict_in_generate=True)
            new = g.sequences[0, len(p):].tolist()
            hf_tokens.append(until_stop(new, {stop}))
            steps = torch.log_softmax(torch.stack(g.logits)[:, 0].float(), -1)
            hf_logp.append(steps[torch.arange(len(new)), torch.tensor(new)].numpy()[:len(hf_tokens[-1])])
            full = torch.tensor([p + jt])
            for dtype, m in hf.items():
                logits = m(full).logits[0, len(p) - 1:-1].float()
                forced[dtype].append(torch.log_softmax(logits, -1)[torch.arange(len(jt)), torch.tensor(jt)].numpy())

    # Clause-PRM: the policy's backbone and a seeded random head, exported in bf16 and read back (fp32
    # compute), so that vLLM and caper_jax score with the same weights.
    backbone, _ = from_hf(str(export), dtype="float32")
    backbone.config = backbone_config(config)
    prm = ClausePRM(config, rngs=nnx.Rngs(PRM_HEAD_SEED), backbone=backbone)
    prm_dir = export_prm_to_hf(prm, out / "prm_export", tokenizer, dtype="bfloat16")
    prm = load_prm_from_hf(prm_dir, dtype="float32")
    rows = [{"question": ex.question, "schema": ex.schema, "sql": ex.sql} for ex in examples]
    batch = score_batch(rows, tokenizer, max_len=1024)
    every = np.asarray(nnx.jit(lambda m, i, k: m.token_scores(i, k))(
        prm, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["mask"])))
    prm_ids, prm_scores, clause_pos = [], [], []
    for b in range(len(rows)):
        n = int(batch["mask"][b].sum())      # right-padded: a row's tokens are its first n
        prm_ids.append(batch["input_ids"][b, :n].tolist())
        prm_scores.append(every[b, :n])
        clause_pos.append([int(p) for p in batch["clause_pos"][b] if p >= 0])
    architecture = json.loads((prm_dir / "config.json").read_text())["architectures"][0]
    info.update(prm_export=str(prm_dir), prm_architecture=architecture, prm_ids=prm_ids, clause_pos=clause_pos,
                prompt_ids=prompt_ids, chat_ids=chat_ids, jax_tokens=jax_tokens, hf_tokens=hf_tokens)
    arrays = {}
    for name, values in (("jax_logp", jax_logp), ("hf_logp", hf_logp), ("hf32_forced", forced["float32"]),
                         ("hf16_forced", forced["bfloat16"]), ("prm_scores", prm_scores)):
        for i, v in enumerate(values):
            arrays[f"{name}_{i}"] = np.asarray(v, np.float32)
    np.savez(out / "reference.npz", **arrays)
    (out / "reference.json").write_text(json.dumps(info, indent=1))


def read_reference(out: pathlib.Path) -> tuple[dict, dict]:
    info = json.loads((out / "reference.json").read_text())
    with np.load(out / "reference.npz") as z:
        arrays = {k: z[k] for k in z.files}
    n = len(info["prompt_ids"])
    series = {name: [arrays[f"{name}_{i}"] for i in range(n)]
              for name in ("jax_logp", "hf_logp", "hf32_forced", "hf16_forced", "prm_scores")}
    return info, series


# -- the vLLM half (vLLM's venv) -----------------------------------------------------------------


def run_reference(args: argparse.Namespace, out: pathlib.Path) -> None:
    """The reference half in the project's venv, as a subprocess (vLLM's venv has no JAX)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [str(args.project_python), str(pathlib.Path(__file__).resolve()), "reference", "--run", str(args.run),
               "--out", str(out), "--prompts", str(args.prompts), "--new_tokens", str(args.new_tokens)]
    subprocess.run(command, check=True, cwd=ROOT, env=env)


def shut_down(llm) -> None:
    """Stops an engine's core and worker processes now: left to garbage collection, they outlived ``del llm``
    and kept the driver from exiting after its table."""
    llm.llm_engine.engine_core.shutdown()


def vllm_policy(info: dict, series: dict, new_tokens: int) -> dict:
    """Greedy generation, log-probs of caper_jax's tokens, and chat, all through one vLLM engine."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=info["export"], dtype="bfloat16", seed=0, max_model_len=1024, enable_prefix_caching=False,
              max_num_seqs=8)
    n = len(info["prompt_ids"])
    stops = set(info["stop_ids"])
    prompts = [{"prompt_token_ids": p} for p in info["prompt_ids"]]
    # (1) greedy from the same prompt ids; logprobs=0: the chosen token's log-prob (raw logits, T = 1)
    generated = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0))
    v_tokens, v_logp, finish = [], [], []
    for o in generated:
        c = o.outputs[0]
        v_tokens.append(list(c.token_ids))
        v_logp.append(np.asarray([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], np.float32))
        finish.append(c.finish_reason)
    # (2) caper_jax's greedy tokens scored as prompt tokens: log-probs at every position, divergence or not
    forced_prompts = [{"prompt_token_ids": p + t} for p, t in zip(info["prompt_ids"], info["jax_tokens"])]
    forced = llm.generate(forced_prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    v_forced = []
    for o, p, t in zip(forced, info["prompt_ids"], info["jax_tokens"]):
        # prompt_logprobs[i] is position i's token given the tokens before it (None at i = 0)
        v_forced.append(np.asarray([o.prompt_logprobs[len(p) + i][tok].logprob for i, tok in enumerate(t)], np.float32))
    jax_tokens, hf_tokens = info["jax_tokens"], info["hf_tokens"]
    result = {
        "greedy": {"vllm_vs_caper_jax": agreement(jax_tokens, v_tokens),
                   "vllm_vs_transformers": agreement(hf_tokens, v_tokens),
                   "caper_jax_vs_transformers": agreement(jax_tokens, hf_tokens),
                   "vllm_finish_reasons": finish,
                   "vllm_ends_at_stop": sum(bool(t) and t[-1] in stops for t in v_tokens),
                   "caper_jax_ends_at_stop": sum(bool(t) and t[-1] in stops for t in jax_tokens)},
        # log-probs of the greedy tokens each implementation chose, over the positions before the first
        # divergence (where both read the same prefix)
        "logp_own_greedy": {
            "vllm_vs_caper_jax": logprob_deltas(v_logp, series["jax_logp"],
                                                [common_prefix(a, b) for a, b in zip(v_tokens, jax_tokens)]),
            "vllm_vs_transformers": logprob_deltas(v_logp, series["hf_logp"],
                                                   [common_prefix(a, b) for a, b in zip(v_tokens, hf_tokens)]),
            "caper_jax_vs_transformers": logprob_deltas(series["jax_logp"], series["hf_logp"],
                                                        [common_prefix(a, b) for a, b in zip(jax_tokens, hf_tokens)])},
        # log-probs of caper_jax's greedy tokens, every position (teacher-forced)
        "logp_caper_jax_tokens": {
            "vllm_bf16_vs_caper_jax_fp32": logprob_deltas(v_forced, series["jax_logp"]),
            "vllm_bf16_vs_transformers_fp32": logprob_deltas(v_forced, series["hf32_forced"]),
            "vllm_bf16_vs_transformers_bf16": logprob_deltas(v_forced, series["hf16_forced"]),
            "transformers_bf16_vs_fp32": logprob_deltas(series["hf16_forced"], series["hf32_forced"]),
            "caper_jax_fp32_vs_transformers_fp32": logprob_deltas(series["jax_logp"], series["hf32_forced"])},
        "prompts": n,
    }
    result["chat"] = vllm_chat(llm, info, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    shut_down(llm)
    return result


def vllm_chat(llm, info: dict, greedy) -> dict:
    """``LLM.chat`` on the policy's messages: the prompt ids it built against the training prompt's, where
    greedy generation stopped, and what the export's generation_config.json makes of a request that names
    no sampling parameters (vLLM's defaults come from it)."""
    if not info["has_chat_template"]:
        try:
            llm.chat(info["messages"][:1], greedy, use_tqdm=False)
        except Exception as error:  # noqa: BLE001 - the point is which error a template-less export gives
            return {"error": f"{type(error).__name__}: {error}"[:300]}
        return {"error": None, "note": "chat worked without a chat_template in the export"}
    outputs = llm.chat(info["messages"], greedy, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    rows = []
    for o, p, jt in zip(outputs, info["prompt_ids"], info["jax_tokens"]):
        c = o.outputs[0]
        rows.append({"prompt_ids_equal": list(o.prompt_token_ids) == p, "text": c.text,
                     "last_token": tokenizer.convert_ids_to_tokens(c.token_ids[-1]) if c.token_ids else None,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "equals_caper_jax_greedy": list(c.token_ids) == jt})
    defaults = llm.get_default_sampling_params()
    sampled = llm.chat(info["messages"], None, use_tqdm=False)     # the export's generation defaults
    return {"rows": rows, "prompt_ids_equal": sum(r["prompt_ids_equal"] for r in rows),
            "stopped_at_im_end": sum(r["last_token"] == "<|im_end|>" and r["finish_reason"] == "stop" for r in rows),
            "equals_caper_jax_greedy": sum(r["equals_caper_jax_greedy"] for r in rows),
            "default_sampling_params": repr(defaults),
            "default_params_equal_greedy": sum(list(s.outputs[0].token_ids) == jt
                                               for s, jt in zip(sampled, info["jax_tokens"]))}


def vllm_prm(info: dict, series: dict) -> dict:
    """The Clause-PRM export through vLLM's pooling runner: as written, then with an architecture name vLLM
    resolves. One engine serves one pooling task (vLLM 0.32: ``PoolerConfig.task``; ``classify`` is the default of a
    sequence classifier): ``classify`` gives the head at the last token (transformers' reading), ``token_classify``
    (ALL pooling) the head at every token, gathered here at the clause ends. ``use_activation=False``: the raw head,
    as caper_jax's score."""
    from vllm import LLM
    from vllm.config import PoolerConfig
    from vllm.pooling_params import PoolingParams

    # vLLM resolves ``XForSequenceClassification`` by converting its ``XForCausalLM`` (as_seq_cls_model: the
    # checkpoint's ``score.weight`` is the head) and registers ``Qwen3_5ForCausalLM``, not ``Qwen3_5TextForCausalLM``:
    # the other attempts list transformers' name first and vLLM's second, as an export could write them.
    resolvable = {"hf_overrides": {"architectures": [info["prm_architecture"], "Qwen3_5ForSequenceClassification"]}}
    attempts = (("as written", {}, "classify"),
                ("+Qwen3_5ForSequenceClassification", resolvable, "classify"),
                ("+Qwen3_5ForSequenceClassification, task token_classify",
                 {**resolvable, "pooler_config": PoolerConfig(task="token_classify")}, "token_classify"))
    prompts = [{"prompt_token_ids": p} for p in info["prm_ids"]]
    ours_last = [np.asarray([s[-1]]) for s in series["prm_scores"]]
    ours_clauses = [s[pos] for s, pos in zip(series["prm_scores"], info["clause_pos"])]
    result = {}
    for name, extra, task in attempts:
        try:
            llm = LLM(model=info["prm_export"], runner="pooling", dtype="bfloat16", seed=0, max_model_len=1024,
                      enable_prefix_caching=False, max_num_seqs=8, **extra)
        except Exception as error:  # noqa: BLE001 - which error vLLM gives for the export as written is the finding
            result[name] = {"loads": False, "error": f"{type(error).__name__}: {error}"[:400]}
            continue
        outputs = llm.encode(prompts, PoolingParams(use_activation=False), pooling_task=task, use_tqdm=False)
        data = [np.asarray(o.outputs.data, np.float32).reshape(-1) for o in outputs]
        r = {"loads": True, "task": task, "supported_tasks": sorted(llm.supported_tasks),
             "score_range": [float(min(map(np.min, ours_clauses))), float(max(map(np.max, ours_clauses)))]}
        if task == "classify":
            r["last_token_vs_caper_jax"] = logprob_deltas(data, ours_last)
        else:
            r["scores_per_token_equal_lengths"] = sum(len(d) == len(p) for d, p in zip(data, info["prm_ids"]))
            r["every_token_vs_caper_jax"] = logprob_deltas(data, series["prm_scores"])
            r["clause_ends_vs_caper_jax"] = logprob_deltas([d[pos] for d, pos in zip(data, info["clause_pos"])],
                                                           ours_clauses)
            r["clauses"] = sum(map(len, info["clause_pos"]))
        result[name] = r
        shut_down(llm)
    return result


def print_table(result: dict) -> None:
    def d(x: dict) -> str:
        return f"max {x['max']:.4f} / mean {x['mean']:.4f} (n={x['n']})" if x.get("n") else "-"

    g, own, forced = result["greedy"], result["logp_own_greedy"], result["logp_caper_jax_tokens"]
    print(f"\n| check | result |\n|---|---|")
    for pair, a in g.items():
        if isinstance(a, dict):
            print(f"| greedy {pair} | {a['sequences_equal']}/{a['sequences']} sequences equal, "
                  f"{a['tokens_before_divergence']}/{a['tokens']} tokens before the first divergence |")
    print(f"| greedy ends at a stop token (vLLM, caper_jax) | {g['vllm_ends_at_stop']}, {g['caper_jax_ends_at_stop']} "
          f"of {result['prompts']} |")
    for pair, x in own.items():
        print(f"| |Δ log-prob| own greedy tokens, {pair} | {d(x)} |")
    for pair, x in forced.items():
        print(f"| |Δ log-prob| caper_jax's tokens, {pair} | {d(x)} |")
    chat = result["chat"]
    if "rows" in chat:
        n = result["prompts"]
        print(f"| LLM.chat prompt ids = training prompt ids | {chat['prompt_ids_equal']}/{n} |")
        print(f"| LLM.chat greedy stops at <|im_end|> (finish_reason stop) | {chat['stopped_at_im_end']}/{n} |")
        print(f"| LLM.chat greedy = caper_jax greedy | {chat['equals_caper_jax_greedy']}/{n} |")
        print(f"| LLM.chat with the export's defaults = greedy | {chat['default_params_equal_greedy']}/{n} |")
        print(f"| LLM.chat output (first prompt) | `{chat['rows'][0]['text']!r}` |")
    else:
        print(f"| LLM.chat | {chat} |")
    for name, r in result["prm"].items():
        if not r["loads"]:
            print(f"| PRM in vLLM, {name} | does not load: {r['error'][:200]} |")
        elif r["task"] == "classify":
            print(f"| PRM in vLLM, {name}: classify (last token) vs caper_jax | {d(r['last_token_vs_caper_jax'])} |")
        else:
            print(f"| PRM in vLLM, {name}: at the {r['clauses']} clause ends vs caper_jax | "
                  f"{d(r['clause_ends_vs_caper_jax'])} (caper_jax's scores {r['score_range'][0]:.2f} .. "
                  f"{r['score_range'][1]:.2f}) |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="check", choices=("check", "reference"),
                        help="check: the whole comparison (vLLM's venv); reference: the caper_jax half (.venv)")
    parser.add_argument("--run", type=pathlib.Path, required=True,
                        help="an SFT/GRPO workdir: its hf_export/ and demo_world/ are read")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="where the reference half writes")
    parser.add_argument("--prompts", type=int, default=8, help="demo-world dev prompts")
    parser.add_argument("--new_tokens", type=int, default=64, help="greedy tokens at most (SFT's eval length)")
    parser.add_argument("--project_python", type=pathlib.Path, default=PROJECT_PYTHON)
    parser.add_argument("--reuse_reference", action="store_true",
                        help="read --out's reference half from an earlier run instead of running it again")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write every figure here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.run = args.run.resolve()
    if args.mode == "reference":
        reference(args.run, args.out, args.prompts, args.new_tokens)
        return
    print(load_line(), "(start)", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm_check_") as tmp:
        out = args.out or pathlib.Path(tmp)
        if not (args.reuse_reference and (out / "reference.json").exists()):
            run_reference(args, out)
        info, series = read_reference(out)
        result = vllm_policy(info, series, args.new_tokens)
        result["prm"] = vllm_prm(info, series)
    result["export"] = {k: info[k] for k in ("export", "export_dtype", "config_eos_token_id", "stop_ids",
                                             "has_generation_config", "has_chat_template", "chat_ids_equal_prompt_ids")}
    result["load_end"] = load_line()
    print_table(result)
    print(load_line(), "(end)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
