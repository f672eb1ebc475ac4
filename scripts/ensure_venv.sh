#!/usr/bin/env bash
# scripts/ensure_venv.sh [EXTRAS]  -- create .venv and install the project (and optional extras) once.
# torch==2.13.0 goes in first: the project's torch range accepts it, so pip never swaps in another build.
# Re-installs when pyproject.toml changes (the stamp holds its hash). An install with extras also satisfies a
# plain request, so `./run.sh` after `./test.sh` installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
want=$(sha256sum pyproject.toml | cut -d' ' -f1)

installed() {  # true if a stamp covering the requested extras holds the current hash
    local stamp stamps=(".venv/.installed-$extras")
    [ -n "$extras" ] || stamps=(.venv/.installed*)  # a plain request: any install will do
    for stamp in "${stamps[@]}"; do
        [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
    done
    return 1
}

installed && exit 0
# Several launches at once (the nodes of a simulated multi-node run) must not run pip side by side in one venv:
# the first installs, the rest wait on the lock and then find its stamp.
exec 9<"$0"
if command -v flock >/dev/null; then flock 9; fi
installed && exit 0
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
echo "$want" > ".venv/.installed${extras:+-$extras}"
