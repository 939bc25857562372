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

source "$(dirname "$0")/_cpu_job.sh"
run_cpu_job "launch/spider_verifier.sh" configs/spider_verifier.py "$@"
