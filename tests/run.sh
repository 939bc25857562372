#!/usr/bin/env bash
# The test command (README). Heavy measurements live in bench/, and tests marked `heavy` (a full-size
# run whose path a small sibling test checks) are deselected unless CAPER_HEAVY=1 (tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
# The 2-process test runs alone after the rest: XLA's Gloo collectives give a peer 30 s to reach
# the first collective, which a heavy end-to-end test on the other worker can exceed.
SERIAL=tests/parallel/test_multiprocess.py
# The test processes allocate as `python -m caper_jax.train` does after its re-exec: XLA:CPU's
# per-call temporaries in transparent huge pages (caper_jax/utils/host_memory.py). Kept if already set.
case "${GLIBC_TUNABLES:-}" in
  *glibc.malloc.hugetlb*) ;;
  *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
esac
# Whole files per worker (module fixtures build once), in collection order: tests/conftest.py puts the
# files with end-to-end tests first (xdist would otherwise start with the files holding the most tests).
python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests --ignore="$SERIAL" "$@"
rc=$?
python -m pytest -q -p no:xdist "$SERIAL" "$@"
rc2=$?
# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
[ "$rc" -ne 0 ] && exit $rc
exit $rc2
