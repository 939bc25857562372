#!/usr/bin/env bash
# Cloud TPU VM pod: create it, install caper_jax on every worker, train on all workers at once.
#
#   export PROJECT=my-project ZONE=us-east5-a TPU_NAME=caper-v5p64 ACCELERATOR=v5p-64 \
#          RUNTIME=v2-alpha-tpuv5 BUCKET=my-bucket RUN=prm9b
#   launch/tpu_pod.sh create      # the TPU VM slice (skip if it exists)
#   launch/tpu_pod.sh setup       # copy this repo to every worker, venv + jax[tpu], mount the bucket
#   launch/tpu_pod.sh train       # python -m caper_jax.train on every worker (CAPER_DISTRIBUTED=auto)
#   launch/tpu_pod.sh dry_run     # compile the configured step on the pod's real devices, no weights
#   launch/tpu_pod.sh delete
#
# Variables (env): PROJECT, ZONE, TPU_NAME (required); ACCELERATOR (v5p-64), RUNTIME (TPU VM image,
# default v2-alpha-tpuv5; v5e: v2-alpha-tpuv5-lite); BUCKET (required for setup/train: the workdir
# lives at gs://$BUCKET/caper/$RUN); RUN (default prm); CONFIG (default
# configs/prm.py:model=qwen35_9b,data=spider); CAPER_ARGS (more --config.* overrides, e.g. the
# paths of the weights and data on the workers); SPOT=1 for spot capacity.
#
# Why Cloud Storage FUSE: caper_jax writes its workdir through POSIX file APIs (pathlib, SQLite,
# orbax on a local path), so the bucket is mounted at /gcs/$BUCKET on every worker and the workdir
# is /gcs/$BUCKET/caper/$RUN — the same path on every host, which orbax's multi-host save needs.
# Use a bucket with hierarchical namespace: its folder rename is atomic, which orbax's commit
# (rename of <step>.orbax-checkpoint-tmp to <step>) relies on.
set -euo pipefail

cmd="${1:-}"
: "${PROJECT:?set PROJECT}" "${ZONE:?set ZONE}" "${TPU_NAME:?set TPU_NAME}"
accelerator="${ACCELERATOR:-v5p-64}"
runtime="${RUNTIME:-v2-alpha-tpuv5}"
config="${CONFIG:-configs/prm.py:model=qwen35_9b,data=spider}"
run="${RUN:-prm}"
remote_repo='~/caper_jax'
jax_version="0.10.2"
repo_root="$(cd "$(dirname "$0")/.." && pwd)"

tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
on_all_workers() { tpu ssh "$TPU_NAME" --worker=all --command="$1"; }
workdir() { echo "/gcs/${BUCKET:?set BUCKET}/caper/$run"; }

case "$cmd" in
  create)
    tpu create "$TPU_NAME" --accelerator-type="$accelerator" --version="$runtime" ${SPOT:+--spot}
    ;;
  setup)
    : "${BUCKET:?set BUCKET}"
    # The working tree as it is (uncommitted edits included), without venvs, runs or caches.
    archive="$(mktemp -t caper_jax.XXXXXX.tar.gz)"
    tar -C "$repo_root" --exclude=.venv --exclude=.git --exclude=runs --exclude='__pycache__' -czf "$archive" .
    tpu scp "$archive" "$TPU_NAME:/tmp/caper_jax.tar.gz" --worker=all
    rm -f "$archive"
    on_all_workers "set -e
      mkdir -p $remote_repo && tar -C $remote_repo -xzf /tmp/caper_jax.tar.gz
      cd $remote_repo
      # jax $jax_version needs Python >= 3.11; TPU VM images ship 3.10.
      python3.11 -m venv .venv 2>/dev/null || {
        sudo apt-get update -q && sudo apt-get install -y -q python3.11 python3.11-venv && python3.11 -m venv .venv; }
      .venv/bin/pip install -q --upgrade pip
      .venv/bin/pip install -q -r requirements.txt 'jax[tpu]==$jax_version'
      if ! command -v gcsfuse >/dev/null; then
        curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
        echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" \\
          | sudo tee /etc/apt/sources.list.d/gcsfuse.list
        sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
      fi
      sudo mkdir -p /gcs/$BUCKET && sudo chown \$USER /gcs/$BUCKET
      mountpoint -q /gcs/$BUCKET || gcsfuse --implicit-dirs $BUCKET /gcs/$BUCKET
      .venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
    ;;
  train|dry_run)
    read -r -a extra <<<"${CAPER_ARGS:-}"
    if [[ "$cmd" == train ]]; then
      action="--workdir=$(workdir)"
    else
      action="--dry_run"
    fi
    # Every worker runs the same command; jax.distributed finds the pod topology by itself.
    # Logs: worker 0 prints the run's lines (the others log nothing but warnings).
    on_all_workers "cd $remote_repo && CAPER_DISTRIBUTED=auto .venv/bin/python -m caper_jax.train \
      --config='$config' $action ${extra[*]:-}"
    ;;
  delete)
    tpu delete "$TPU_NAME" --quiet
    ;;
  *)
    echo "usage: launch/tpu_pod.sh {create|setup|train|dry_run|delete}   (see the header for the env)" >&2
    exit 2
    ;;
esac
