#!/usr/bin/env bash
# ./run.sh [RECIPE.toml] [--section.key value ...]
#
# Trains a recipe (default recipes/debug.toml); several processes go through torchrun (nsa_training/launch.py: the
# exit status and the one error line are those of one process). The first run creates .venv and installs the
# project (scripts/ensure_venv.sh).
# Environment: NGPU (processes per node; default: visible GPUs, else 1), NNODES (default 1), NODE_RANK,
# MASTER_ADDR, MASTER_PORT (multi-node rendezvous), LOG_RANK (ranks whose output is shown; default 0),
# PYTHON (interpreter used to create the venv; default python3), NSA_PYTHON (use this interpreter's environment
# as it is instead of .venv).
set -euo pipefail
cd "$(dirname "$0")"

if [ -n "${NSA_PYTHON:-}" ]; then
    PY=$NSA_PYTHON  # an existing environment (cluster module, container): no venv, no install
else
    scripts/ensure_venv.sh
    PY=.venv/bin/python
fi

RECIPE=recipes/debug.toml
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
    RECIPE=$1
    shift
fi

if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
if [ "$NGPU" = 1 ] && [ "${NNODES:-1}" = 1 ]; then
    # One process needs no launcher (train.py makes a one-rank group itself).
    exec "$PY" train.py "$RECIPE" "$@"
fi
# torchrun, checking the plan for the process count first and ending with train.py's exit status and one error line.
NGPU=$NGPU exec "$PY" -m nsa_training.launch "$RECIPE" "$@"
