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

source "$(dirname "$0")/_cpu_job.sh"
run_cpu_job "launch/reproduce_cpu.sh" configs/reproduce.py "$@"
