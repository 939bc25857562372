"""How far a Clause-PRM moves with its seed alone, next to two of its levers (issue 21 items 2-3).

    python launch/prm_seed_spread.py REPRODUCTION_WORKDIR OUTDIR     # ~3.5 min per PRM on 2 cores

REPRODUCTION_WORKDIR is a finished run of `bash launch/reproduce_cpu.sh` with the default config
(held-back pick); it is read, never written, except that its own PRM (``prm/``) is seed 0 of the
first row. For seeds 0, 1, 2 it trains the reproduction's own PRM stage config
(``miniature.stage_settings(...)["prm"]``) three ways: the default (SFT-initialised backbone, pick
questions held back), a random backbone, and the SFT backbone with the pick questions' samples and
golds kept in (``OUTDIR/prm_data_insample``). The seed changes the fault-injection draws, the head's
initialisation and the data order. For each PRM it records the trainer's localisation of the
held-out failures, the reranker pick on the held-back questions (``rerankers.pick_reranker``) and the
SFT policy's test samples reranked (``miniature.rerank_saved_samples`` on a copy of ``eval/sft``) in
``OUTDIR/<row>_s<seed>.json``, then prints the table of docs/reproduce_results/prm_seeds.md.
Every PRM resumes: a rerun skips what is done.
"""
import json
import pathlib
import shutil
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from caper_jax.experiments import miniature, rerankers, samples  # noqa: E402
from caper_jax.prm import trainer  # noqa: E402
from caper_jax.settings import replace  # noqa: E402
from configs.reproduce import get_config  # noqa: E402

ROWS = ("heldback_sft", "heldback_random", "insample_sft")
SEEDS = (0, 1, 2)


def in_sample_data(run: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The run's PRM data with the pick questions' golds and samples kept in (an in-sample pick)."""
    data = out / "prm_data_insample"
    if not data.exists():
        samples.build_prm_data(run / "world", run / "samples" / "train.jsonl", run / "eval" / "sft" / "predictions.jsonl",
                               data, "train", "dev")   # no held_back: the pick questions train the PRM too
        # The held-out rows with the confidence stage's clause log-probs (the confidence baseline reads them).
        shutil.copyfile(run / "prm_data" / "predictions_dev.jsonl", data / "predictions_dev.jsonl")
    return data


def measure(config, run: pathlib.Path, out: pathlib.Path, row: str, seed: int) -> dict:
    summary = out / f"{row}_s{seed}.json"
    if summary.exists():
        return json.loads(summary.read_text())
    world = run / "world"
    prm_dir = run / "prm" if (row, seed) == ("heldback_sft", 0) else out / f"{row}_s{seed}"
    if not (prm_dir / "results.json").exists():
        stage = miniature.stage_settings(config, run, world, str(world / "tokenizer"))["prm"]
        trainer.run(replace(stage, {
            "seed": seed, "data.dir": str(in_sample_data(run, out) if row.startswith("insample") else run / "prm_data"),
            "model.init_from": "" if row.endswith("random") else str(run / "sft")}), str(prm_dir))
    prm = json.loads((prm_dir / "results.json").read_text())
    pick = rerankers.pick_reranker(config, world, run / "samples" / "train.jsonl", prm_dir)
    eval_copy = out / f"eval_sft_{row}_s{seed}"
    shutil.rmtree(eval_copy, ignore_errors=True)
    shutil.copytree(run / "eval" / "sft", eval_copy)
    test = miniature.rerank_saved_samples(config, world, eval_copy, prm_dir)["metrics"]
    loc = prm["localization"]["prm"]
    result = {"row": row, "seed": seed, "top1": loc["top1"], "mrr": loc["mrr"], "n": loc["n"],
              "pair_accuracy": prm["metrics"].get("eval/pair_accuracy"), "pick": pick,
              "sft_test": {"majority_vote": test["majority_vote"], "prm": test["prm"]}}
    summary.write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(results: dict) -> str:
    lines = ["| PRM data, backbone | seed | top-1 | MRR | pair acc. | picked (its EX / MV@8 on the pick questions) "
             "| SFT test: picked − MV@8 |", "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        for r in results[row]:
            how, pick, test = r["pick"]["picked"], r["pick"], r["sft_test"]
            lines.append(f"| {row} | {r['seed']} | {100 * r['top1']:.1f} | {100 * r['mrr']:.1f} | "
                         f"{100 * r['pair_accuracy']:.1f} | {how} ({100 * pick['ex'][how]:.1f} / "
                         f"{100 * pick['majority_vote']:.1f}) | {100 * (test['prm'][how] - test['majority_vote']):+.1f} |")
        tops = [100 * r["top1"] for r in results[row]]
        lines.append(f"| {row} | mean ± sd | {statistics.mean(tops):.1f} ± {statistics.stdev(tops):.1f} | | | | |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[1].startswith("-"):
        sys.exit("usage: python launch/prm_seed_spread.py REPRODUCTION_WORKDIR OUTDIR")
    run, out = pathlib.Path(argv[1]).resolve(), pathlib.Path(argv[2]).resolve()
    for part in ("world/tokenizer", "sft", "prm/results.json", "prm_data", "samples/train.jsonl", "eval/sft"):
        if not (run / part).exists():
            sys.exit(f"error: {run / part} is missing: not a finished reproduction workdir")
    config = miniature.validate(get_config())
    if not config.report.pick_held_back:
        sys.exit("error: configs/reproduce.py's default no longer holds the pick back; this script assumes it does")
    out.mkdir(parents=True, exist_ok=True)
    results = {row: [measure(config, run, out, row, seed) for seed in SEEDS] for row in ROWS}
    print(table(results))


if __name__ == "__main__":
    main(sys.argv)
