"""nsa_training.checkpoint: exact resume, atomic saves, pruning, resume selection, weight export.

Single-process tests run in a 1-process gloo group. This file is also the worker of the subprocess tests:
`python tests/test_checkpoint.py kill TMP` and `torchrun ... tests/test_checkpoint.py fsdp TMP`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nsa_training.checkpoint import CheckpointManager, ModelState, OptimizerState, RankLocalState, RNGState
from nsa_training.config import CheckpointConfig, ConfigError

REPO = Path(__file__).resolve().parents[1]  # on PYTHONPATH of the subprocess workers, which run this file

DIM = 8


class TinyNet(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(n_blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Cursor:
    """Stands in for a data loader: per-rank position plus non-tensor values of every kind DCP must keep."""

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self.extras = {"counts": {"docs": 0, "big": 2**40}, "seen": [], "tag": b"\x00\xff", "pair": (1, (2.5, "x"))}

    def advance(self) -> None:
        self.position += 1
        self.extras["counts"]["docs"] += 3
        self.extras["seen"].append(self.position)

    def state_dict(self) -> dict:
        return {"position": self.position, "extras": self.extras}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.extras = state["position"], state["extras"]


class Run:
    """A tiny training run: model, AdamW, LambdaLR warmup, per-rank data cursor and RNG."""

    def __init__(self, seed: int, fsdp: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet()
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.cursor = Cursor(position=100 * dist.get_rank())
        self.states = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.opt),
            "lr_scheduler": self.sched,
            "data": RankLocalState(self.cursor),
            "rng": RankLocalState(RNGState()),
        }

    def step(self) -> float:
        # Data depends on the cursor, the torch RNG and python's RNG, so each must be restored exactly.
        x = torch.randn(4, DIM) + 0.01 * self.cursor.position + random.random()
        loss = (self.model(x) - 1).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.cursor.advance()
        return loss.item()


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def init_single_process_group(store_file: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(store_file), 1), rank=0, world_size=1)


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    init_single_process_group(tmp_path_factory.mktemp("pg") / "store")
    yield
    dist.destroy_process_group()


def names(mgr: CheckpointManager) -> list[str]:
    return sorted(p.name for p in mgr.folder.iterdir())


def test_round_trip_continues_bitwise(pg, tmp_path):
    mgr = CheckpointManager(CheckpointConfig(interval=3), tmp_path)
    ref = Run(seed=0)
    seed_rngs(1)
    for step in range(1, 4):
        ref.step()
        mgr.save(step, ref.states)
    ref_losses = [ref.step() for _ in range(3)]

    resumed = Run(seed=7)
    seed_rngs(2)  # different init and RNG state: all of it must come from the checkpoint
    path = mgr.resume_path()
    assert path == tmp_path / "checkpoints" / "step-00000003"
    assert mgr.load(path, resumed.states) == 3
    assert resumed.cursor.position == 3
    extras = {"counts": {"docs": 9, "big": 2**40}, "seen": [1, 2, 3], "tag": b"\x00\xff", "pair": (1, (2.5, "x"))}
    assert resumed.cursor.extras == extras  # non-tensor state comes back exactly, tuples included
    assert resumed.sched.last_epoch == 3 and resumed.sched.get_last_lr() == [1e-2]
    assert [resumed.step() for _ in range(3)] == ref_losses
    assert_same_params(full_params(resumed.model), full_params(ref.model))


@pytest.mark.parametrize("keep", [2, 0])
def test_keep_prunes_oldest(pg, tmp_path, keep):
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=keep), tmp_path)
    states = {"model": ModelState(TinyNet())}
    for step in range(1, 5):
        mgr.save(step, states)
    expected = [f"step-0000000{s}" for s in range(1, 5)]
    assert names(mgr) == (expected[-keep:] if keep else expected)


def test_saves_only_at_interval_or_final_and_once_per_step(pg, tmp_path, monkeypatch):
    import nsa_training.checkpoint as ckpt

    calls = []
    real_save = ckpt.dcp.save

    def counting_save(state_dict, checkpoint_id):
        calls.append(checkpoint_id)
        real_save(state_dict, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(ckpt.dcp, "save", counting_save)
    mgr = CheckpointManager(CheckpointConfig(interval=5, keep=0), tmp_path)
    states = {"model": ModelState(TinyNet())}
    for step in range(1, 13):
        mgr.save(step, states)
    mgr.save(12, states, final=True)
    mgr.save(12, states, final=True)
    assert names(mgr) == ["step-00000005", "step-00000010", "step-00000012"]
    assert len(calls) == 3

    disabled = CheckpointManager(CheckpointConfig(enable=False, interval=1), tmp_path / "off")
    disabled.save(1, states, final=True)
    assert not disabled.folder.exists()


def test_resume_path_selection(pg, tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=0), run)
    assert mgr.resume_path() is None
    states = {"model": ModelState(TinyNet())}
    mgr.save(1, states)
    mgr.save(2, states)
    (mgr.folder / "step-00000009.partial").mkdir()  # crashed save: never "latest"
    (mgr.folder / "step-123").mkdir()  # not an exact step-XXXXXXXX name
    assert mgr.resume_path() == mgr.folder / "step-00000002"
    assert CheckpointManager(CheckpointConfig(resume=False), run).resume_path() is None

    other = str(mgr.folder / "step-00000001")
    assert CheckpointManager(CheckpointConfig(load_path=other), run).resume_path() == Path(other)
    for bad in (tmp_path / "nope", mgr.folder):
        with pytest.raises(ConfigError, match="checkpoint.load_path"):
            CheckpointManager(CheckpointConfig(load_path=str(bad)), run).resume_path()


def test_export_weights_loads_into_plain_model(pg, tmp_path):
    mgr = CheckpointManager(CheckpointConfig(), tmp_path)
    torch.manual_seed(0)
    model = TinyNet()
    mgr.export_weights(model, tmp_path / "model.pt")
    fresh = TinyNet()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert_same_params(fresh.state_dict(), model.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]


def _worker_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_sigkill_during_save_keeps_previous_checkpoint(pg, tmp_path):
    proc = subprocess.run([sys.executable, __file__, "kill", str(tmp_path)], env=_worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    mgr = CheckpointManager(CheckpointConfig(interval=1), tmp_path / "run")
    assert names(mgr) == ["step-00000001", "step-00000002.partial"]
    assert any((mgr.folder / "step-00000002.partial").iterdir())  # it died with shards half-written
    assert mgr.resume_path() == mgr.folder / "step-00000001"

    torch.manual_seed(0)
    saved = TinyNet()
    model = TinyNet()
    assert mgr.load(mgr.resume_path(), {"model": ModelState(model)}) == 1
    assert_same_params(model.state_dict(), saved.state_dict())

    mgr.save(2, {"model": ModelState(model)})  # clears the leftover and completes
    assert names(mgr) == ["step-00000001", "step-00000002"]


def _kill_during_save(tmp: Path) -> None:
    """Save step 1, then die by SIGKILL inside DCP's writer while saving step 2, after the shards were written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    init_single_process_group(tmp / "store")
    torch.manual_seed(0)
    model = TinyNet()
    mgr = CheckpointManager(CheckpointConfig(interval=1), tmp / "run")
    mgr.save(1, {"model": ModelState(model)})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die
    mgr.save(2, {"model": ModelState(model)})


def test_fsdp2_two_ranks_resume_bitwise(pg, tmp_path):
    one_rank = CheckpointManager(CheckpointConfig(interval=1), tmp_path / "one_rank")
    one_rank.save(1, {"data": RankLocalState(Cursor())})  # for the world-size check of the worker
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "fsdp", str(tmp_path)]
    proc = subprocess.run(cmd, env=_worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "fsdp_ok").read_text() == "ok"


def _fsdp_resume(tmp: Path) -> None:
    """Under FSDP2 on 2 ranks: save, continue; reload into a fresh FSDP2 run, continue: identical, per rank."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager(CheckpointConfig(interval=3), tmp / "fsdp")
    ref = Run(seed=0, fsdp=True)
    seed_rngs(10 + rank)  # ranks draw different data: each must get its own RNG back
    for step in range(1, 4):
        ref.step()
        mgr.save(step, ref.states)
    saved_params = {k: v.clone() for k, v in full_params(ref.model).items()}
    ref_losses = [ref.step() for _ in range(3)]

    resumed = Run(seed=5, fsdp=True)
    seed_rngs(99)
    assert mgr.load(mgr.resume_path(), resumed.states) == 3
    assert resumed.cursor.position == 100 * rank + 3
    assert [resumed.step() for _ in range(3)] == ref_losses, rank
    assert_same_params(full_params(resumed.model), full_params(ref.model))

    # The sharded checkpoint also loads into a plain, unsharded model.
    plain = TinyNet()
    mgr.load(mgr.resume_path(), {"model": ModelState(plain)})
    assert_same_params(plain.state_dict(), saved_params)

    mgr.export_weights(ref.model, tmp / "model.pt")
    exported = TinyNet()
    exported.load_state_dict(torch.load(tmp / "model.pt", weights_only=True))
    assert_same_params(exported.state_dict(), full_params(ref.model))

    with_one_rank = CheckpointManager(CheckpointConfig(), tmp / "one_rank")
    try:
        with_one_rank.load(with_one_rank.resume_path(), {"data": RankLocalState(Cursor())})
        raise AssertionError("a 1-rank checkpoint with per-rank state loaded into 2 ranks")
    except ConfigError as e:
        assert "saved by 1 ranks but this run has 2" in str(e)

    dist.barrier()
    if rank == 0:
        (tmp / "fsdp_ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    {"kill": _kill_during_save, "fsdp": _fsdp_resume}[sys.argv[1]](Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # as train.exit_now: gloo can abort a finished process at interpreter teardown
