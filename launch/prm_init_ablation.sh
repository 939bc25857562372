#!/usr/bin/env bash
# Where the Clause-PRM's backbone starts (issue 21 item 2): the miniature reproduction's PRM stage
# trained four times on the same annotated samples and tested on the same held-out failures:
# random init or the SFT policy (the stand-in for the paper's pretrained LLM), each without and with
# the auxiliary SQL LM term.
#
#   bash launch/prm_init_ablation.sh REPRODUCTION_WORKDIR OUTDIR
#
# REPRODUCTION_WORKDIR is a finished (or at least past its "confidence" stage) run of
# `bash launch/reproduce_cpu.sh`: its world/, sft/ and prm_data/ are read, never written. Each
# variant is the reproduction's own PRM stage config (configs/reproduce.py: 200 steps, no HF export,
# seed 0) given on the command line, so OUTDIR/<variant>/results.json holds the same localisation
# table as the reproduction's Table 1. About 6 minutes per variant on 2 quiet cores.
set -euo pipefail

if [[ $# -ne 2 || "$1" == -* ]]; then
  echo "usage: bash launch/prm_init_ablation.sh REPRODUCTION_WORKDIR OUTDIR" >&2
  exit 2
fi
[[ -d "$1" ]] || { echo "error: $1 is not a directory" >&2; exit 2; }
run="$(cd "$1" && pwd)"
for part in world/tokenizer sft prm_data/dev.json; do   # checked before OUTDIR is made: a refusal writes nothing
  [[ -e "$run/$part" ]] || { echo "error: $run/$part is missing: not a reproduction workdir past its confidence stage" >&2; exit 2; }
done
mkdir -p "$2"
out="$(cd "$2" && pwd)"
cd "$(dirname "$0")/.."
for init in random sft; do
  for lm in 0 1; do
    name="${init}_lm${lm}"
    init_from=""
    [[ "$init" == sft ]] && init_from="$run/sft"
    .venv/bin/python -m caper_jax.train --config=configs/prm.py:model=tiny --workdir="$out/$name" \
      --config.seed=0 --config.data.kind=spider --config.data.dir="$run/prm_data" \
      --config.model.tokenizer_dir="$run/world/tokenizer" --config.model.init_from="$init_from" \
      --config.optim.total_steps=200 --config.loss.lm_coef="$lm" --config.export_hf=False \
      > "$out/$name.log" 2>&1
    echo "$name done"
  done
done
.venv/bin/python - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| PRM backbone start | LM term | top-1 | MRR | held-out pair accuracy |")
print("|---|---|---|---|---|")
for name in ("random_lm0", "random_lm1", "sft_lm0", "sft_lm1"):
    r = json.loads((out / name / "results.json").read_text())
    prm = r["localization"]["prm"]
    init, lm = name.split("_")
    print(f"| {init} | {'yes' if lm == 'lm1' else 'no'} | {100 * prm['top1']:.1f} | {100 * prm['mrr']:.1f} | "
          f"{100 * r['metrics']['eval/pair_accuracy']:.1f} |")
baselines = r["localization"]
for method, row in baselines.items():
    if method != "prm":
        print(f"| baseline: {method}{' (sees gold)' if row.get('sees_gold') else ''} | | {100 * row['top1']:.1f} | {100 * row['mrr']:.1f} | |")
EOF
