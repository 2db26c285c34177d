#!/usr/bin/env bash
# Idempotent setup of a fresh Debian/Ubuntu machine for kombu-pgskip development:
#   1. PostgreSQL server binaries and pg_cron (apt), pgbouncer (tests/chaos), python3-venv when
#      missing;
#   2. .venv in the repo root with `pip install -e ".[binary,test,docs]"`.
# Run as root or as a user with sudo. A second run changes nothing and installs nothing
# (the pip step reruns only when pyproject.toml changes).
#
# Environment:
#   PGSKIP_PG_BINDIR  use the PostgreSQL binaries there instead of /usr/lib/postgresql/<major>/bin
#   PGSKIP_PG_MAJOR   PostgreSQL major version to install when none is installed (default 15)
#   PYTHON            interpreter to create .venv with (default: newest python3.x >= 3.10)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.pgskip-bootstrap"

step() { echo "bootstrap: $*"; }
die() { echo "bootstrap: error: $*" >&2; exit 1; }

# Run a command quietly; on failure show its output and stop.
quiet() {
    local what="$1"; shift
    local log
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "$what failed: $*"
    fi
    rm -f "$log"
}

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    SUDO=()
fi

# --- which PostgreSQL ------------------------------------------------------------------------
pg_major() {
    local bin
    if [ -n "${PGSKIP_PG_BINDIR:-}" ]; then
        [ -x "$PGSKIP_PG_BINDIR/postgres" ] || die "PGSKIP_PG_BINDIR=$PGSKIP_PG_BINDIR has no postgres binary"
        "$PGSKIP_PG_BINDIR/postgres" --version | sed -E 's/[^0-9]*([0-9]+).*/\1/'
        return
    fi
    # The newest installed server wins; then whatever pg_config reports; then the default.
    local servers=()
    shopt -s nullglob
    servers=(/usr/lib/postgresql/*/bin/postgres)
    shopt -u nullglob
    bin=""
    if [ "${#servers[@]}" -gt 0 ]; then
        bin="$(printf '%s\n' "${servers[@]}" | sort -V | tail -n 1)"
    fi
    if [ -n "$bin" ]; then
        basename "$(dirname "$(dirname "$bin")")"
    elif command -v pg_config >/dev/null 2>&1 && pg_config --version >/dev/null 2>&1; then
        pg_config --version | sed -E 's/[^0-9]*([0-9]+).*/\1/'
    else
        echo "${PGSKIP_PG_MAJOR:-15}"
    fi
}

MAJOR="$(pg_major)"
if [ -n "${PGSKIP_PG_BINDIR:-}" ]; then
    BINDIR="$PGSKIP_PG_BINDIR"
    LIBDIR="$("$BINDIR/pg_config" --pkglibdir 2>/dev/null || echo "$BINDIR/../lib")"
else
    BINDIR="/usr/lib/postgresql/$MAJOR/bin"
    LIBDIR="/usr/lib/postgresql/$MAJOR/lib"
fi

# --- which Python ----------------------------------------------------------------------------
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }

find_python() {
    local c
    if [ -n "${PYTHON:-}" ]; then
        py_ok "$PYTHON" || die "PYTHON=$PYTHON is not Python 3.10 or newer"
        command -v "$PYTHON"
        return
    fi
    for c in python3.13 python3.12 python3.11 python3.10 python3; do
        if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then
            command -v "$c"
            return
        fi
    done
}

# --- system packages -------------------------------------------------------------------------
missing=()
[ -x "$BINDIR/initdb" ] && [ -x "$BINDIR/pg_ctl" ] || missing+=("postgresql-$MAJOR")
[ -f "$LIBDIR/pg_cron.so" ] || missing+=("postgresql-$MAJOR-cron")
# The chaos suite runs workers through Debian's pgbouncer in transaction pooling.
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
PY=""
if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python || true)"
    if [ -z "$PY" ]; then
        missing+=(python3 python3-venv)
    elif ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi
fi

if [ "${#missing[@]}" -gt 0 ]; then
    if [ -n "${PGSKIP_PG_BINDIR:-}" ] && [[ " ${missing[*]} " == *" postgresql-$MAJOR "* ]]; then
        die "PGSKIP_PG_BINDIR=$PGSKIP_PG_BINDIR lacks initdb/pg_ctl"
    fi
    command -v apt-get >/dev/null 2>&1 \
        || die "missing ${missing[*]} and there is no apt-get; install them by hand"
    if [ "$(id -u)" -ne 0 ] && [ "${#SUDO[@]}" -eq 0 ]; then
        die "missing ${missing[*]}; run this script as root or install sudo"
    fi
    step "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    quiet "apt-get update" "${SUDO[@]}" apt-get update -q
    quiet "apt-get install (postgresql-$MAJOR packages need a repository that has them, e.g. apt.postgresql.org)" \
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    step "system packages present (PostgreSQL $MAJOR, pg_cron, pgbouncer, Python venv)"
fi

[ -x "$BINDIR/initdb" ] || die "initdb still missing in $BINDIR after installing"
[ -f "$LIBDIR/pg_cron.so" ] || die "pg_cron still missing in $LIBDIR after installing"
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] \
    || die "pgbouncer still missing after installing"

# --- virtualenv ------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    [ -n "$PY" ] || PY="$(find_python || true)"
    [ -n "$PY" ] || die "no Python 3.10 or newer found (set PYTHON=/path/to/python3.x)"
    step "creating .venv with $PY"
    quiet "creating the virtualenv" "$PY" -m venv "$VENV"
else
    py_ok "$VENV/bin/python" || die "$VENV is broken or older than Python 3.10; remove it and rerun"
fi

[ -f "$ROOT/pyproject.toml" ] || die "no pyproject.toml in $ROOT"
want="$(cat "$ROOT/pyproject.toml" <("$VENV/bin/python" -V 2>&1) | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
# Checked from / so that the source tree in the current directory does not count as installed.
if [ "$want" = "$have" ] && (cd / && "$VENV/bin/python" -c 'import kombu_pgskip') >/dev/null 2>&1; then
    step ".venv up to date"
else
    step "installing kombu-pgskip[binary,test,docs] into .venv (pip install -e)"
    quiet "upgrading pip" "$VENV/bin/python" -m pip install -q --upgrade pip
    quiet "pip install" "$VENV/bin/python" -m pip install -q -e "${ROOT}[binary,test,docs]"
    echo "$want" >"$STAMP"
fi
