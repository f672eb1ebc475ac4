#!/usr/bin/env bash
# ./run.sh [RECIPE.toml] [--section.key value ...]
#
# Trains a recipe (default recipes/debug.toml); several processes go through torchrun. The first run creates
# .venv and installs the project (scripts/ensure_venv.sh).
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
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
    RDZV=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK for multi-node runs}"
          --master_addr "${MASTER_ADDR:?set MASTER_ADDR for multi-node runs}" --master_port "${MASTER_PORT:-29500}")
else
    RDZV=(--standalone --nnodes 1)
fi

if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
    # One process needs no launcher (train.py makes a one-rank group itself): errors stay one clean line.
    exec "$PY" train.py "$RECIPE" "$@"
fi
# Check the recipe before launching, so a typo is one line instead of a report from every rank.
"$PY" train.py "$RECIPE" "$@" --print-config >/dev/null
# torchrun forwards SIGTERM/SIGINT to the workers (they checkpoint and print how to resume), then dies with its own
# traceback and status 1. Launched through this, it exits 128 + signal number (143, 130) instead, as one process does.
TORCHRUN='import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
try:
    main()
except SignalException as e:
    sys.exit(128 + e.sigval)'
exec "$PY" -c "$TORCHRUN" "${RDZV[@]}" --nproc_per_node "$NGPU" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    train.py "$RECIPE" "$@"
