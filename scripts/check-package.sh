#!/usr/bin/env bash
# Build the sdist and the wheel with `python -m build` and check them:
#   1. the build prints no setuptools deprecation warning (SetuptoolsDeprecationWarning);
#   2. the wheel and the sdist carry LICENSE;
#   3. the wheel, with its dependencies and the `binary` extra, installs into a fresh virtualenv,
#      where `import kombu_pgskip` gives the version the distribution was built with and
#      `python -m kombu_pgskip --version` prints it;
#   4. the wheel has kombu_pgskip.pth at its top, listed in RECORD, and in the virtualenv a fresh
#      interpreter resolves `pgskip://` with nothing imported by hand, while one that never
#      imports kombu does not get kombu imported by it;
#   5. pytest in that virtualenv loads the pytest plugin by its entry point, with -W error.
# Uses .venv (scripts/bootstrap.sh) for `build`, installing it there when missing.
# Environment:
#   PGSKIP_CHECK_DIR  where to build and create the virtualenv (default: a temporary directory,
#                     removed afterwards)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "check-package: no $ROOT/.venv; run scripts/bootstrap.sh" >&2; exit 1; }

step() { echo "check-package: $*"; }
die() { echo "check-package: error: $*" >&2; exit 1; }

if [ -n "${PGSKIP_CHECK_DIR:-}" ]; then
    WORK="$PGSKIP_CHECK_DIR"
    rm -rf "$WORK"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
fi

"$PY" -c 'import build' 2>/dev/null || {
    step "installing build into .venv"
    "$PY" -m pip install -q build
}

# Built from a copy of the tracked and new files: an in-tree build would reuse build/ and
# *.egg-info left by earlier builds and editable installs.
step "copying the source tree"
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) \
    | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK/src" 2>/dev/null || true)
[ -f "$WORK/src/pyproject.toml" ] || die "copying the source tree failed"

step "python -m build (sdist, then the wheel from the sdist)"
if ! "$PY" -m build --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1; then
    cat "$WORK/build.log" >&2
    die "python -m build failed"
fi
if grep -in "deprecat" "$WORK/build.log"; then
    die "the build printed the deprecation warnings above"
fi
SDIST="$(ls "$WORK"/dist/kombu_pgskip-*.tar.gz)"
WHEEL="$(ls "$WORK"/dist/kombu_pgskip-*.whl)"
step "built $(basename "$SDIST") and $(basename "$WHEEL")"

"$PY" - "$SDIST" "$WHEEL" <<'PYCHECK'
import sys
import tarfile
import zipfile

sdist, wheel = sys.argv[1], sys.argv[2]
sdist_names = tarfile.open(sdist).getnames()
wheel_names = zipfile.ZipFile(wheel).namelist()
assert any(n.endswith("/LICENSE") for n in sdist_names), "LICENSE missing from the sdist"
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names), (
    "LICENSE missing from the wheel"
)
metadata = zipfile.ZipFile(wheel).read(
    next(n for n in wheel_names if n.endswith(".dist-info/METADATA"))
).decode()
assert "License-Expression: MIT" in metadata, "no License-Expression in the wheel's METADATA"
print("check-package: LICENSE in both; METADATA has License-Expression: MIT")

import base64
import hashlib

whl = zipfile.ZipFile(wheel)
assert "kombu_pgskip.pth" in wheel_names and "_kombu_pgskip_alias.py" in wheel_names, (
    "kombu_pgskip.pth or _kombu_pgskip_alias.py missing from the top of the wheel"
)
pth = whl.read("kombu_pgskip.pth")
assert pth == b"import _kombu_pgskip_alias; _kombu_pgskip_alias.install()\n", pth
digest = base64.urlsafe_b64encode(hashlib.sha256(pth).digest()).rstrip(b"=").decode()
record = whl.read(next(n for n in wheel_names if n.endswith(".dist-info/RECORD"))).decode()
assert f"kombu_pgskip.pth,sha256={digest},{len(pth)}" in record.splitlines(), (
    "kombu_pgskip.pth is not in RECORD with its hash"
)
print("check-package: kombu_pgskip.pth at the top of the wheel, in RECORD")
PYCHECK

VENV="$WORK/venv"
step "installing the wheel with the binary extra into a fresh virtualenv"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${WHEEL}[binary]"

WANT="$(basename "$WHEEL" | cut -d- -f2)"
# From / so that the source tree is not what gets imported.
GOT="$(cd / && "$VENV/bin/python" -c 'import kombu_pgskip; print(kombu_pgskip.__version__)')"
[ "$GOT" = "$WANT" ] || die "import kombu_pgskip gives version $GOT, the wheel is $WANT"
CLI="$(cd / && "$VENV/bin/python" -m kombu_pgskip --version)"
[ "$CLI" = "kombu-pgskip $WANT" ] || die "python -m kombu_pgskip --version printed: $CLI"
# Fresh interpreters, nothing of kombu_pgskip imported by hand: kombu_pgskip.pth does it.
(cd / && "$VENV/bin/python" -c 'import sys
assert "kombu" not in sys.modules and "kombu_pgskip" not in sys.modules, sorted(sys.modules)
assert "_kombu_pgskip_alias" in sys.modules, "kombu_pgskip.pth did not run"') \
    || die "a bare interpreter imports kombu, or kombu_pgskip.pth did not run"
(cd / && "$VENV/bin/python" -c 'import sys
from kombu import Connection
from kombu.transport import get_transport_cls
conn = Connection("pgskip://u@127.0.0.1:1/db")
cls = get_transport_cls(conn.transport_cls)
assert f"{cls.__module__}:{cls.__qualname__}" == "kombu_pgskip.transport:Transport", cls
assert sys.modules[cls.__module__].__file__.startswith(sys.prefix), sys.modules[cls.__module__]
assert conn.transport.driver_type == "pgskip"') \
    || die "pgskip:// does not resolve in a fresh interpreter of the virtualenv"
# The pytest plugin loads by its entry point, and pytest -W error starts with it (the .pth
# module it finds imported already must not be marked for assertion rewriting).
"$VENV/bin/python" -m pip install -q pytest
mkdir -p "$WORK/usertests"
cat >"$WORK/usertests/test_plugin_loaded.py" <<'PYTEST'
def test_the_plugin_is_loaded(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("pgskip")
PYTEST
(cd "$WORK/usertests" && "$VENV/bin/python" -m pytest -q -W error -p no:cacheprovider) \
    || die "pytest -W error with the pytest plugin from the wheel failed"
step "ok: kombu_pgskip $GOT imports from the wheel, pgskip:// resolves without importing it, the pytest plugin loads"
