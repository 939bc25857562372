#!/usr/bin/env bash
# The miniature CAPER reproduction on a CPU machine, from a fresh clone (28 minutes measured on 2 cores, 2026-12-01):
#
#   bash launch/reproduce_cpu.sh runs/reproduce [--config.x=y ...]
#
# Creates .venv and installs requirements.txt when there is no .venv yet, then runs every stage of
# configs/reproduce.py (SFT -> samples -> annotation -> Clause-PRM -> GRPO sparse/token/clause x 3 seeds
# -> greedy EX, MV@8, PRM best-of-8, localisation). Results: OUTDIR/results.md, OUTDIR/results.json
# and the plots beside them; the full log goes to OUTDIR/reproduce.log. Rerunning the same command
# after an interruption resumes where it stopped. Extra arguments are passed on as config overrides.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash launch/reproduce_cpu.sh OUTDIR [--config.key=value ...]" >&2
  exit 2
fi
out="$1"
shift
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3.11 -m venv .venv
  .venv/bin/pip install -q -r requirements.txt
fi
mkdir -p "$out"
start=$(date +%s)
.venv/bin/python -m caper_jax.train --config=configs/reproduce.py --workdir="$out" "$@" 2>&1 | tee -a "$out/reproduce.log"
echo "reproduce: $(( $(date +%s) - start )) s wall; results in $out/results.md"
