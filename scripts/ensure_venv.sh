#!/usr/bin/env bash
# scripts/ensure_venv.sh [EXTRAS]  -- create .venv and install the project (and optional extras) once.
# torch==2.13.0 goes in first: the project's torch range accepts it, so pip never swaps in another build.
# Re-installs when pyproject.toml changes (the stamp holds its hash).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
stamp=.venv/.installed${extras:+-$extras}
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
echo "$want" > "$stamp"
