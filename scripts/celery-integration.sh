#!/usr/bin/env bash
# Celery's own integration suite (t/integration of the celery sdist) against kombu-pgskip,
# with Redis as the broker in the same run for comparison.
#
#   bash scripts/celery-integration.sh                       # all four configurations
#   bash scripts/celery-integration.sh --configs pgskip/redis -- -k test_inspect
#
# Configurations are broker/backend pairs: pgskip/redis, pgskip/postgresql, redis/redis,
# redis/postgresql. Takes about 25-30 minutes per configuration on 2 cores; not part of the
# default test run. Exit status 1 when a pgskip configuration has a failure that
# docs/celery-compatibility.md does not list as expected.
#
# Needs: PostgreSQL binaries (scripts/bootstrap.sh installs them) and redis-server (started
# here with `redis-server --daemonize yes --port 6379 --save "" --appendonly no` when nothing
# answers on 127.0.0.1:6379; installed from apt when missing). The suite's own dependencies go
# into a separate virtualenv, .venv-celery-integration, so the default suite's stays as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-celery-integration"
STAMP="$VENV/.pgskip-stamp"

bash "$ROOT/scripts/bootstrap.sh"

if ! command -v redis-server >/dev/null 2>&1; then
    echo "celery-integration: installing redis-server (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends redis-server >/dev/null
fi
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    echo "celery-integration: starting redis-server on 127.0.0.1:6379"
    redis-server --daemonize yes --port 6379 --save "" --appendonly no >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$ROOT/.venv/bin/python" -c 'import sys; print(sys.executable)' >/dev/null
    py="$(readlink -f "$ROOT/.venv/bin/python")"
    echo "celery-integration: creating $VENV"
    "$py" -m venv "$VENV"
fi
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$want" != "$(cat "$STAMP" 2>/dev/null || true)" ]; then
    echo "celery-integration: installing kombu-pgskip[binary,test,celery-integration] into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e "${ROOT}[binary,test,celery-integration]"
    echo "$want" >"$STAMP"
fi

cd "$ROOT"
exec "$VENV/bin/python" -m tests.celery_integration.run "$@"
