#!/usr/bin/env bash
# Run the test suite: bootstrap the machine (idempotent), then pytest from the repo root, in
# PGSKIP_TEST_WORKERS processes (default 2; 0 runs everything in this one), each with its own
# throwaway PostgreSQL; a file's tests stay in one process (--dist loadfile).
# Arguments go to pytest after `-q`, e.g. `scripts/test.sh tests/unit -k envelope`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"

rc=0
.venv/bin/python -m pytest -q -n "${PGSKIP_TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
