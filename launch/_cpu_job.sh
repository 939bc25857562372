# Sourced by the one-machine CPU launchers (reproduce_cpu.sh, spider_verifier.sh): runs one
# configs/*.py job into OUTDIR, creating .venv from requirements.txt first when there is none.
#
#   run_cpu_job LAUNCHER CONFIG OUTDIR [:variant] [--config.key=value ...]
#
# The log goes to OUTDIR/<config name>.log (appended: rerunning the same command resumes the job).
run_cpu_job() {
  local launcher="$1" config="$2"
  shift 2
  if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash $launcher OUTDIR [:variant] [--config.key=value ...]" >&2
    exit 2
  fi
  local out="$1"
  shift
  # A second --config would define every override flag twice: a variant (the config's :arg, e.g.
  # :seeds=3 or :fast) is passed as an argument of its own instead.
  local variant=""
  if [[ $# -ge 1 && "$1" == :* ]]; then
    variant="$1"
    shift
  fi
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  if [[ ! -x .venv/bin/python ]]; then
    python3.11 -m venv .venv
    .venv/bin/pip install -q -r requirements.txt
  fi
  mkdir -p "$out"
  local name start
  name="$(basename "$config" .py)"
  start=$(date +%s)
  .venv/bin/python -m caper_jax.train --config="${config}${variant}" --workdir="$out" "$@" 2>&1 | tee -a "$out/$name.log"
  echo "$name: $(( $(date +%s) - start )) s wall; results in $out/results.md"
}
