"""A checkpoint written under one data-parallel plan resumes under another (train.py on 2 gloo ranks): FSDP2's
sharded DCP checkpoint continues under DDP, and DDP's under FSDP2, with the losses of the uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, env, event_files, scalars

STEPS = 6
COMMON = ["recipes/debug.toml", "--data.source", "synthetic", "--data.seq_len", "128", "--training.steps", str(STEPS),
          "--training.global_batch_tokens", "1024", "--training.micro_batch_size", "2", "--training.eval_interval",
          "0", "--checkpoint.interval", "3", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]


def train(run_dir: Path, plan: str, *extra: str) -> dict[int, float]:
    """Per-step losses of a 2-rank train.py run of `plan`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           *COMMON, "--job.run_dir", str(run_dir), "--parallelism.data_parallel", plan, *extra]
    # One thread per rank: 2 ranks share 2 cores.
    result = subprocess.run(cmd, cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return scalars(event_files(run_dir)[-1])["train/loss"]


@pytest.mark.parametrize("saved, resumed", [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_checkpoint_resumes_under_the_other_plan(tmp_path, saved, resumed):
    uninterrupted = train(tmp_path / saved, saved)
    halfway = tmp_path / saved / "checkpoints" / "step-00000003"
    continued = train(tmp_path / "resumed", resumed, "--checkpoint.load_path", str(halfway))
    assert sorted(continued) == list(range(4, STEPS + 1))  # it started from step 3's state
    for step, loss in continued.items():
        want = uninterrupted[step]
        assert abs(loss - want) <= 1e-5 * abs(want), (step, continued, uninterrupted)
