#!/usr/bin/env bash
# The test command (README). Fast tests only: heavy measurements live in bench/.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -n 2 --dist loadfile tests "$@"
rc=$?
# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
exit $rc
