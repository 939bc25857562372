#!/usr/bin/env bash
# The miniature CAPER reproduction on a CPU machine, from a fresh clone (24 minutes measured on 2 cores, 2026-12-02):
#
#   bash launch/reproduce_cpu.sh runs/reproduce [--config.x=y ...]
#   bash launch/reproduce_cpu.sh runs/rep_fast :fast           # every stage at toy size
#
# Creates .venv and installs requirements.txt when there is no .venv yet, then runs every stage of
# configs/reproduce.py (SFT -> samples -> annotation -> Clause-PRM -> GRPO sparse/token/clause x 5 seeds
# -> greedy EX, MV@8, PRM best-of-8, localisation). Results: OUTDIR/results.md, OUTDIR/results.json
# and the plots beside them; the full log goes to OUTDIR/reproduce.log. Rerunning the same command
# after an interruption resumes where it stopped. Extra arguments are passed on as config overrides.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash launch/reproduce_cpu.sh OUTDIR [:variant] [--config.key=value ...]" >&2
  exit 2
fi
out="$1"
shift
# A second --config would define every override flag twice: a variant (configs/reproduce.py's :arg,
# e.g. :seeds=3 or :fast) is passed as an argument of its own instead.
variant=""
if [[ $# -ge 1 && "$1" == :* ]]; then
  variant="$1"
  shift
fi
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3.11 -m venv .venv
  .venv/bin/pip install -q -r requirements.txt
fi
mkdir -p "$out"
start=$(date +%s)
.venv/bin/python -m caper_jax.train --config="configs/reproduce.py${variant}" --workdir="$out" "$@" 2>&1 | tee -a "$out/reproduce.log"
echo "reproduce: $(( $(date +%s) - start )) s wall; results in $out/results.md"
