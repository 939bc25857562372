#!/usr/bin/env bash
# The Clause-PRM as a plug-and-play verifier on Spider, from nothing (configs/spider_verifier.py):
#
#   bash launch/spider_verifier.sh runs/spider_verifier [--config.x=y ...]
#   bash launch/spider_verifier.sh runs/sv_fast :fast          # every stage at toy size
#
# SFT of a tiny policy on Spider's training questions -> its samples -> a Clause-PRM (backbone from
# the SFT run) trained on the training split only -> localisation of the six published systems' real
# dev failures against the gold-free baselines, and EX of each system, MV@6, every PRM reranker
# (the one picked on training questions marked), oracle@6. Results: OUTDIR/results.md and
# results.json; the full log goes to OUTDIR/spider_verifier.log. Rerunning resumes.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash launch/spider_verifier.sh OUTDIR [:fast] [--config.key=value ...]" >&2
  exit 2
fi
out="$1"
shift
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
.venv/bin/python -m caper_jax.train --config="configs/spider_verifier.py${variant}" --workdir="$out" "$@" 2>&1 \
  | tee -a "$out/spider_verifier.log"
echo "spider_verifier: $(( $(date +%s) - start )) s wall; results in $out/results.md"
