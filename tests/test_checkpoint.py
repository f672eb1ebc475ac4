"""nsa_training.checkpoint: exact resume, atomic saves, pruning, resume selection, weight export, a full or
unwritable disk, damaged checkpoints, and the model keys a resume may change.

Single-process tests run in a 1-process gloo group. This file is also the worker of the subprocess tests:
`python tests/test_checkpoint.py kill TMP`, `... full_disk_train TMP` and `torchrun ... tests/test_checkpoint.py
fsdp TMP`.
"""

from __future__ import annotations

import builtins
import dataclasses
import errno
import io
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nsa_models.args import RESUMABLE, ModelArgs, NSAArgs, resumable_keys
from nsa_training.checkpoint import (
    MANIFEST,
    CheckpointManager,
    CheckpointWriteFailed,
    ModelState,
    OptimizerState,
    RankLocalState,
    RNGState,
)
from nsa_training.config import CheckpointConfig, Config, ConfigError, config_to_dict, config_to_toml, load_config
from nsa_training.exit_codes import WRITE_FAILED_EXIT_CODE
from nsa_training.trainer import Trainer

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

    def __init__(self, seed: int, fsdp: bool = False, own_grads: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet()
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.own_grads = own_grads  # gradients allocated up front and zeroed in place, as under CUDA graphs
        if own_grads:
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
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
        self.opt.zero_grad(set_to_none=not self.own_grads)
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


@pytest.mark.parametrize("own_grads", [False, True], ids=["grads-none", "grads-held"])
def test_round_trip_continues_bitwise(pg, tmp_path, own_grads):
    """Everything comes back; also when the parameters hold gradients before the load (the trainer under CUDA
    graphs), where torch does not initialise the optimizer state that the checkpoint is loaded into."""
    mgr = CheckpointManager(CheckpointConfig(interval=3), tmp_path)
    ref = Run(seed=0, own_grads=own_grads)
    seed_rngs(1)
    for step in range(1, 4):
        ref.step()
        mgr.save(step, ref.states)
    ref_losses = [ref.step() for _ in range(3)]

    resumed = Run(seed=7, own_grads=own_grads)
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


class FailingDisk:
    """Files opened for writing under `folder` take `free` bytes in all, then every write fails with `error`
    (ENOSPC: a full disk; EACCES: no permission), as the OS would; a stand-in that needs no root or tmpfs.
    `free=None`: no limit. `writes` records (file, bytes) of every write."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path, free: int | None,
                 error: int = errno.ENOSPC) -> None:
        self.folder, self.free, self.error = str(folder), free, error
        self.writes: list[tuple[str, int]] = []
        real_open = io.open

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return _Budgeted(f, self) if set(mode) & set("wax+") and str(file).startswith(self.folder) else f

        monkeypatch.setattr(io, "open", open_)  # pathlib's Path.open (DCP's writer) calls io.open
        monkeypatch.setattr(builtins, "open", open_)

    def take(self, n: int, name: str) -> None:
        if self.free is not None:
            if n > self.free:
                raise OSError(self.error, os.strerror(self.error), name)
            self.free -= n
        self.writes.append((name, n))


class _Budgeted:
    """A file whose writes draw on a FailingDisk's budget."""

    def __init__(self, f, disk: FailingDisk) -> None:
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        self._disk.take(len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes, self._f.name)
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self) -> _Budgeted:
        return self

    def __exit__(self, *exc_info) -> None:
        self._f.close()


def free_space(writes: list[tuple[str, int]], where: str) -> int:
    """The free space at which a save that makes `writes` fails at `where`."""
    if where == "start":
        return 0
    if where == "tensor":  # inside torch.save of the largest tensor: torch reports it as "unexpected pos"
        largest = max(range(len(writes)), key=lambda i: writes[i][1])
        return sum(n for _, n in writes[:largest]) + writes[largest][1] // 2
    return sum(n for name, n in writes if not name.endswith(MANIFEST))  # everything but the checksums fits


@pytest.mark.parametrize("where, error, what", [
    ("start", errno.ENOSPC, "the disk is full"),
    ("tensor", errno.ENOSPC, "the disk is full"),
    ("manifest", errno.ENOSPC, "the disk is full"),
    ("start", errno.EACCES, "no permission to write there"),
], ids=["full_at_start", "full_in_tensor_data", "full_at_manifest", "not_writable"])
def test_failed_save_is_one_line_and_keeps_the_previous_checkpoint(pg, tmp_path, monkeypatch, where, error, what):
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=1), tmp_path)
    torch.manual_seed(0)
    model = TinyNet()
    states = {"model": ModelState(model), "big": {"tensor": torch.randn(1 << 16)}}
    with monkeypatch.context() as patch:
        writes = FailingDisk(patch, mgr.folder, free=None).writes
        mgr.save(1, states)
    with monkeypatch.context() as patch:
        FailingDisk(patch, mgr.folder, free_space(writes, where), error)
        with pytest.raises(CheckpointWriteFailed) as failure:
            mgr.save(2, states)  # the same states: the same writes as step 1's
    message = str(failure.value)
    assert failure.value.exit_code == WRITE_FAILED_EXIT_CODE and "\n" not in message
    assert re.fullmatch(rf"cannot write checkpoint \S+step-00000002: {what} \({os.strerror(error)}: {tmp_path}\S*\); "
                        rf"the latest complete checkpoint \S+step-00000001 is kept; .*{mgr.folder}.*", message), message
    assert names(mgr) == ["step-00000001"]  # no partial left behind: its space is freed
    assert mgr.resume_path() == mgr.folder / "step-00000001"
    fresh = TinyNet()
    assert mgr.load(mgr.resume_path(), {"model": ModelState(fresh)}) == 1
    assert_same_params(fresh.state_dict(), model.state_dict())


def test_failed_weight_export_is_one_line(pg, tmp_path, monkeypatch):
    mgr = CheckpointManager(CheckpointConfig(), tmp_path)
    FailingDisk(monkeypatch, tmp_path, free=100)
    with pytest.raises(CheckpointWriteFailed, match=r"^cannot write the weights \S+model\.pt: the disk is full "):
        mgr.export_weights(TinyNet(), tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []


def test_train_py_exits_7_with_one_line_when_the_disk_is_full(tmp_path):
    proc = subprocess.run([sys.executable, __file__, "full_disk_train", str(tmp_path)], env=_worker_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == WRITE_FAILED_EXIT_CODE, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot write checkpoint "), proc.stderr[-3000:]
    assert "the disk is full" in errors[0] and "Traceback" not in proc.stderr


def _full_disk_train(tmp: Path) -> None:
    """train.py's main on a disk that fills up at the first checkpoint; exits with main's status."""
    sys.path.insert(0, str(REPO))
    import train

    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as patch:
        FailingDisk(patch, run_dir / "checkpoints", free=0)
        code = train.main(["recipes/debug.toml", "--job.run_dir", str(run_dir), "--data.source", "synthetic",
                           "--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--training.eval_interval",
                           "0", "--training.global_batch_tokens", "512", "--training.micro_batch_size", "2"])
    train.exit_now(code)


def damage(path: Path, how: str) -> None:
    """Damage the checkpoint at `path` as storage or people do."""
    shard = next(path.glob("*.distcp"))
    if how == "truncated_shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "missing_metadata":
        (path / ".metadata").unlink()
    elif how == "garbage_in_shard":  # same size: only the checksum can tell
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 3)
            f.write(os.urandom(min(4096, shard.stat().st_size // 3)))
    elif how == "garbage_in_metadata":
        size = (path / ".metadata").stat().st_size
        (path / ".metadata").write_bytes(os.urandom(size))
    elif how == "missing_manifest":
        (path / MANIFEST).unlink()
    else:
        (path / MANIFEST).write_text("{not json")


DAMAGES = ["truncated_shard", "missing_metadata", "garbage_in_shard", "garbage_in_metadata", "broken_manifest"]
PROBLEMS = {"truncated_shard": r"__0_0\.distcp has \d+ of its \d+ bytes", "missing_metadata": r"\.metadata is missing",
            "garbage_in_shard": r"__0_0\.distcp does not match its checksum",
            "garbage_in_metadata": r"\.metadata does not match its checksum",
            "broken_manifest": rf"unreadable {MANIFEST} \(JSONDecodeError"}


def three_checkpoints(tmp_path: Path) -> tuple[CheckpointManager, dict[int, dict[str, torch.Tensor]]]:
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep=0), tmp_path)
    run = Run(seed=0)
    params = {}
    for step in range(1, 4):
        run.step()
        mgr.save(step, run.states)
        params[step] = {k: v.clone() for k, v in run.model.state_dict().items()}
    return mgr, params


@pytest.mark.parametrize("how", DAMAGES)
def test_resume_passes_over_a_damaged_latest_checkpoint(pg, tmp_path, capfd, how):
    mgr, params = three_checkpoints(tmp_path)
    assert mgr.verify(mgr.folder / "step-00000003") is None
    damage(mgr.folder / "step-00000003", how)
    capfd.readouterr()
    assert mgr.resume_path() == mgr.folder / "step-00000002"
    warning = capfd.readouterr().err
    assert re.fullmatch(rf"warning: checkpoint \S+step-00000003 is damaged \({PROBLEMS[how]}.*\): not loaded; "
                        r"trying the one before\n", warning), warning
    resumed = Run(seed=5)
    assert mgr.load(mgr.resume_path(), resumed.states) == 2
    assert_same_params(resumed.model.state_dict(), params[2])

    strict = CheckpointManager(CheckpointConfig(strict_resume=True), tmp_path)
    with pytest.raises(ConfigError, match=rf"^checkpoint\.strict_resume: the latest checkpoint \S+step-00000003 is "
                                          rf"damaged \({PROBLEMS[how]}"):
        strict.resume_path()
    with pytest.raises(ConfigError, match=rf"^checkpoint\.load_path \S+step-00000003: {PROBLEMS[how]}"):
        CheckpointManager(CheckpointConfig(load_path=str(mgr.folder / "step-00000003")), tmp_path).resume_path()


def test_a_checkpoint_of_an_older_version_loads_unverified_unless_strict(pg, tmp_path, capfd):
    """Checkpoints written before checksums existed have no manifest: resume still loads them (with a warning),
    so an upgrade loses no run; strict_resume refuses them."""
    mgr, params = three_checkpoints(tmp_path)
    damage(mgr.folder / "step-00000003", "missing_manifest")
    capfd.readouterr()
    assert mgr.resume_path() == mgr.folder / "step-00000003"
    assert "has no checksums.json (written by an older version): loaded unverified" in capfd.readouterr().err
    resumed = Run(seed=5)
    assert mgr.load(mgr.resume_path(), resumed.states) == 3
    assert_same_params(resumed.model.state_dict(), params[3])
    with pytest.raises(ConfigError, match=r"^checkpoint\.strict_resume: the latest checkpoint \S+step-00000003 is "
                                          rf"damaged \(no {MANIFEST}"):
        CheckpointManager(CheckpointConfig(strict_resume=True), tmp_path).resume_path()


def test_resume_refuses_when_no_checkpoint_verifies(pg, tmp_path, capfd):
    mgr, _ = three_checkpoints(tmp_path)
    for step in range(1, 4):
        damage(mgr.folder / f"step-0000000{step}", "garbage_in_shard")
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: no checkpoint in \S+ verifies"):
        mgr.resume_path()
    assert capfd.readouterr().err.count("warning: checkpoint ") == 3


# The model keys a resume may change are marked where they are declared (nsa_models.args), not listed in the trainer.

# The trainer's hand-kept list before the marks replaced it: the migration keeps every key and adds none.
FORMER_RESUMABLE_MODEL_KEYS = {"model.flavor", "model.init_std", "model.nsa.backend", "model.nsa.window_backend",
                               "model.nsa.cmp_backend", "model.nsa.float_atomics", "model.nsa.query_chunk",
                               "model.nsa.selected_from_window", "model.nsa.selected_kernels"}


@dataclasses.dataclass
class GrownNSAArgs(NSAArgs):
    """NSAArgs as it would be with two keys more: one declared as any new key is, one marked."""

    new_hyper_parameter: int = 1
    new_kernel_choice: Annotated[str, RESUMABLE] = "a"


@dataclasses.dataclass
class GrownModelArgs(ModelArgs):
    new_width: int = 1
    nsa: GrownNSAArgs = dataclasses.field(default_factory=GrownNSAArgs)


def test_resumable_model_keys_are_the_fields_marked_where_declared():
    keys = resumable_keys()
    assert {f"model.{key}" for key in keys} == FORMER_RESUMABLE_MODEL_KEYS
    assert {f"model.{key}" for key in keys} <= set(config_to_dict(Config()))  # each one a real recipe key
    # A new field is not resumable until marked, in a nested section as at the top.
    assert resumable_keys(GrownModelArgs) == keys | {"nsa.new_kernel_choice"}
    assert resumable_keys(GrownNSAArgs) == resumable_keys(NSAArgs) | {"new_kernel_choice"}


@pytest.mark.parametrize("override, refused", [
    (["--model.nsa.query_chunk", "64", "--model.init_std", "0.01"], None),
    (["--model.nsa.query_chunk", "64", "--model.n_layers", "3"], "model.n_layers = 3 differs from the 2"),
    (["--model.nsa.n_selected", "5"], "model.nsa.n_selected = 5 differs from the 4"),
])
def test_a_resume_may_change_the_resumable_model_keys_and_no_other(tmp_path, override, refused):
    saved = tmp_path / "config.toml"
    saved.write_text(config_to_toml(load_config([str(REPO / "recipes" / "debug.toml")])[0]))
    resumed = Trainer.__new__(Trainer)  # _changed_settings needs the config alone
    resumed.config = load_config([str(REPO / "recipes" / "debug.toml"), *override])[0]
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    if refused:
        with pytest.raises(ConfigError, match=f"^{re.escape(refused)} this run was trained with"):
            resumed._changed_settings(checkpoint)
    else:
        assert resumed._changed_settings(checkpoint) == ["model.init_std 0.02 -> 0.01",
                                                         "model.nsa.query_chunk 256 -> 64"]


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
    workers = {"kill": _kill_during_save, "fsdp": _fsdp_resume, "full_disk_train": _full_disk_train}
    workers[sys.argv[1]](Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # as train.exit_now: gloo can abort a finished process at interpreter teardown
