"""Gradient accumulation under DDP, FSDP2 and HSDP on 2 gloo ranks (tests/dist/accum_worker.py, through torchrun
with a timeout, so a hang fails the test): the same parameters as one big micro-batch, and gradients reduced once
per optimizer step, in the last micro-batch's backward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.accum_worker import PLANS, STEPS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("accum") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests/dist/accum_worker.py"), str(out), *PLANS]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("plan", list(PLANS))
def test_accumulation_gives_the_parameters_of_one_big_micro_batch(plan, results):
    result = results[plan]
    assert result["moved"] > 1e-2  # SGD moved the parameters far beyond the tolerance below
    assert result["max_diff"] <= 1e-6  # fp32 rounding of a sum taken in another order


# Per step, per micro-batch: (gradient reductions, all-gathers). DDP all-gathers once, building itself.
EXPECTED = {
    # DDP and FSDP2 reduce in the last micro-batch only; FSDP2 gathers each unit (2 blocks + root) once per step.
    "ddp": [[(0, 1), (1, 0)]] + [[(0, 0), (1, 0)]] * (STEPS - 1),
    "fsdp": [[(0, 3), (3, 0)]] * STEPS,
    # Memory kept as plain FSDP2: every micro-batch gathers (3 in forward, the blocks again in backward) and
    # reduce-scatters each unit.
    "fsdp_sharded_accumulation": [[(3, 5), (3, 5)]] * STEPS,
    # HSDP over 2 replicas of one shard: nothing to reduce-scatter, and the replicas all-reduce once per step.
    "hsdp_2x1_sharded_accumulation": [[(0, 0), (3, 0)]] * STEPS,
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_gradients_are_reduced_once_per_step(plan, results):
    got = [[tuple(counts) for counts in step] for step in results[plan]["collectives"]]
    assert got == EXPECTED[plan]
