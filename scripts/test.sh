#!/usr/bin/env bash
# Run the test suite: bootstrap the machine (idempotent), then pytest from the repo root.
# Arguments go to pytest after `-q`, e.g. `scripts/test.sh tests/unit -k envelope`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"

rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
