#!/usr/bin/env bash
# Run the demo (examples/demo.py) after bootstrapping the machine; arguments go to the demo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/python -m examples.demo "$@"
