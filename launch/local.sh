#!/usr/bin/env bash
# Starts N JAX processes on this machine, wired together by jax.distributed on 127.0.0.1.
#
#   launch/local.sh -n 2 -d 4 -- python -m caper_jax.train --config=configs/prm.py --workdir=runs/mp
#
# Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT, JAX_NUM_PROCESSES=N and
# JAX_PROCESS_ID=i (read by caper_jax.parallel.multihost.initialize), so the command is exactly the
# one a pod or SLURM job runs. With -d D every process runs on D simulated CPU devices
# (JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=D, NPROC=4D unless set):
# N x D devices in all, the cheapest way to exercise multi-host code paths. Without -d the processes use whatever devices
# JAX finds (e.g. on one GPU machine, set CUDA_VISIBLE_DEVICES per process yourself).
#
# Fail fast: if any process exits non-zero, the others are stopped (a survivor would otherwise
# block forever in its next collective), and the script exits with that process's status.
# Ctrl-C / SIGTERM stop every process. Logs go to LOG_DIR/process_<i>.log, pids to
# LOG_DIR/process_<i>.pid (tests use them to kill one process on purpose).
set -euo pipefail

usage() {   # usage [STATUS]: asked for (-h, --help) on stdout with 0; a bad command line on stderr with 2
  local status="${1:-2}"
  local text='usage: launch/local.sh [-n NUM_PROCESSES] [-d CPU_DEVICES_PER_PROCESS] [-p PORT] [-l LOG_DIR] [-g SECONDS] -- COMMAND [ARGS...]
  -n  processes to start (default 2)
  -d  simulate this many CPU devices per process (default: use the real devices)
  -p  coordinator port on 127.0.0.1 (default: a free port)
  -l  directory for process_<i>.log and process_<i>.pid (default: a new temporary directory)
  -g  seconds a stopped process gets between SIGTERM and SIGKILL (default 10)'
  if [[ "$status" == 0 ]]; then echo "$text"; else echo "$text" >&2; fi
  exit "$status"
}

[[ "${1:-}" == "--help" ]] && usage 0
num_processes=2
cpu_devices=""
port=""
log_dir=""
grace=10
while getopts "n:d:p:l:g:h" opt; do
  case "$opt" in
    n) num_processes="$OPTARG" ;;
    d) cpu_devices="$OPTARG" ;;
    p) port="$OPTARG" ;;
    l) log_dir="$OPTARG" ;;
    g) grace="$OPTARG" ;;
    h) usage 0 ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || usage
[[ "$num_processes" =~ ^[1-9][0-9]*$ ]] || { echo "error: -n must be a positive integer" >&2; exit 2; }
[[ -z "$cpu_devices" || "$cpu_devices" =~ ^[1-9][0-9]*$ ]] || { echo "error: -d must be a positive integer" >&2; exit 2; }
[[ "$grace" =~ ^[0-9]+$ ]] || { echo "error: -g must be a whole number of seconds" >&2; exit 2; }

if [[ -z "$port" ]]; then
  # Ask the kernel for a free port; a fixed default would collide with a previous run in TIME_WAIT.
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
log_dir="${log_dir:-$(mktemp -d -t caper_local.XXXXXX)}"
mkdir -p "$log_dir"

pids=()
stop_all() {
  local signal="$1"
  for pid in "${pids[@]}"; do kill "-$signal" "$pid" 2>/dev/null || true; done
}
# A process blocked in a collective may ignore SIGTERM for a while (one whose peer crashed waits in it
# until killed); escalate to SIGKILL after the grace period.
stop_and_reap() {
  stop_all TERM
  for _ in $(seq $((5 * grace))); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && return
    sleep 0.2
  done
  stop_all KILL
}
trap 'stop_and_reap; exit 130' INT TERM

echo "local.sh: $num_processes processes, coordinator 127.0.0.1:$port, logs in $log_dir" >&2
for ((i = 0; i < num_processes; i++)); do
  (
    export JAX_COORDINATOR_ADDRESS="127.0.0.1:$port"
    export JAX_NUM_PROCESSES="$num_processes"
    export JAX_PROCESS_ID="$i"
    if [[ -n "$cpu_devices" ]]; then
      export JAX_PLATFORMS=cpu
      export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$cpu_devices"
      # XLA's CPU client sizes its intra-op thread pool from NPROC (else the core count). Every
      # simulated device runs on that pool, and jaxlib's LAPACK kernels (the triangular solve of
      # the chunked delta rule) wait there for sub-tasks: with as many devices as threads, all
      # threads wait and the step deadlocks (measured: 4 devices on 2 cores hang in step 1).
      export NPROC="${NPROC:-$((4 * cpu_devices))}"
    fi
    exec "$@"
  ) >"$log_dir/process_$i.log" 2>&1 &
  pids+=($!)
  echo "$!" >"$log_dir/process_$i.pid"
done

# Reap processes as they finish; the first failure stops the rest (bash >= 5.1 for wait -p).
status=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  set +e
  wait -n -p finished "${live[@]}"
  rc=$?
  set -e
  still=()
  for pid in "${live[@]}"; do if [[ "$pid" != "$finished" ]]; then still+=("$pid"); fi; done
  live=("${still[@]}")
  if ((rc != 0)); then
    status=$rc
    echo "local.sh: process $finished exited with status $rc; stopping the others" >&2
    stop_and_reap
    wait 2>/dev/null || true
    break
  fi
done
for ((i = 0; i < num_processes; i++)); do
  echo "--- process $i (tail of $log_dir/process_$i.log)" >&2
  tail -n 5 "$log_dir/process_$i.log" >&2 || true
done
exit "$status"
