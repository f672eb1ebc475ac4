"""Multi-node, simulated on one machine: two `./run.sh` launches (NNODES=2, one CPU process each, gloo) train
an HSDP plan and match a single-process run of the same global batch, loss for loss."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.helpers import REPO, env, event_files, scalars

STEPS = 6
COMMON = ["recipes/debug.toml", "--data.source", "synthetic", "--data.seq_len", "128", "--training.steps", str(STEPS),
          "--training.global_batch_tokens", "1024", "--training.micro_batch_size", "2", "--training.eval_interval",
          "0", "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir) -> list[float]:
    logged = scalars(event_files(run_dir)[-1])["train/loss"]
    return [logged[s] for s in range(1, STEPS + 1)]


def test_two_node_hsdp_matches_single_process(tmp_path):
    single = subprocess.run([sys.executable, "train.py", *COMMON, "--job.run_dir", str(tmp_path / "single")],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

    port = str(free_port())
    run_dir = tmp_path / "hsdp"  # one directory for both nodes, as on a shared filesystem
    hsdp = ["--parallelism.data_parallel", "hsdp", "--parallelism.dp_replicate", "2"]
    nodes = [subprocess.Popen(["./run.sh", *COMMON, "--job.run_dir", str(run_dir), *hsdp], cwd=REPO,
                              env={**env(), "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "NGPU": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 rank(s)" in outputs[0]
    for got, want in zip(losses(run_dir), losses(tmp_path / "single")):
        assert abs(got - want) <= 1e-5 * abs(want), (losses(run_dir), losses(tmp_path / "single"))
