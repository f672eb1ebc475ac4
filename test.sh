#!/usr/bin/env bash
# ./test.sh [pytest args]  -- install the project with its test extras (first run), then run the CPU test suite.
# GPU tests (-m gpu) are skipped without CUDA; run them on a GPU machine with `./test.sh -m gpu`.
set -euo pipefail
cd "$(dirname "$0")"
scripts/ensure_venv.sh test
exec .venv/bin/python -m pytest -q "$@"
