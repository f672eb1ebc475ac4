"""Checkpoints: torch.distributed.checkpoint (DCP) directories under `<run_dir>/checkpoints`, written atomically
and verified before they are loaded.

Every rank writes `step-XXXXXXXX.partial`; the ranks then hash the files (sha256, the work spread over them) and
rank 0 writes `checksums.json` last; only then does rank 0 rename the directory to `step-XXXXXXXX`. So a complete
name always holds a complete checkpoint: a crash during a save leaves at most a `.partial` directory, which resume
ignores and the next save removes. A save that fails for lack of disk space or permission is one line (exit
status 7) and leaves the previous checkpoint the one a restart uses. Resume verifies sizes and checksums first
and, when the newest checkpoint was damaged since, says so and takes the newest one that verifies (or refuses,
with `checkpoint.strict_resume`). Model and optimizer states go through `torch.distributed.checkpoint.state_dict`,
so a checkpoint reshards between plain, DDP and FSDP2 models.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from nsa_training.config import CheckpointConfig, ConfigError
from nsa_training.exit_codes import WRITE_FAILED_EXIT_CODE
from nsa_training.watchdog import RunFailed

_COMPLETE_NAME = re.compile(r"step-\d{8}")
_META_KEY = "checkpoint"  # {"step", "world_size"}, saved next to the caller's states
MANIFEST = "checksums.json"  # {"files": {name: {"bytes", "sha256"}}}: written last, before the rename
LEGACY = f"no {MANIFEST} (a checkpoint of an older version, or its manifest was removed)"
_WRITE_PROBLEMS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                   errno.EROFS: "the file system is read-only", errno.EACCES: "no permission to write there",
                   errno.EPERM: "no permission to write there"}


class CheckpointWriteFailed(RunFailed):
    """A checkpoint (or the exported weights) could not be written: the disk is full, read-only, or not ours."""

    def __init__(self, message: str) -> None:
        super().__init__(message, WRITE_FAILED_EXIT_CODE)


class ModelState(Stateful):
    """The model's parameters and buffers (sharded under FSDP2, without DDP/compile name prefixes)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's state keyed by parameter names, so it survives a change of parallelism."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        # Before the first step this dict is what a resume loads into, so it must hold every state tensor. torch
        # creates them (a zero-LR step on zero gradients) only while no parameter holds a gradient, and a run under
        # CUDA graphs holds its own from the start: left as they are, the load would restore no Adam moment.
        # Later calls find the state there; setting the gradients aside costs them nothing.
        held = {p: p.grad for p in self.model.parameters()}
        for p in held:
            p.grad = None
        try:
            return get_optimizer_state_dict(self.model, self.optimizer)
        finally:
            for p, grad in held.items():
                p.grad = grad

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class RNGState:
    """This process's generators: python `random`, torch CPU and, when present, the current CUDA device."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda"])


class RankLocalState(Stateful):
    """Wraps an object whose state differs per rank (data position, RNG): saved under `rank<N>`, one per rank.

    DCP would otherwise deduplicate equal keys across ranks and give every rank the same copy back. Each rank's
    state is stored as one serialized blob: its nested structure may change from step to step (a data loader's
    position), and DCP can only load into a structure that matches the saved one.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.obj.state_dict(), buffer)
        return {f"rank{dist.get_rank()}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict[f"rank{dist.get_rank()}"]
        self.obj.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the rename is what marks a checkpoint complete)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(action: Callable[[], None]) -> None:
    """Run `action` on rank 0 only; its OSError is raised on every rank (the others would otherwise wait for rank 0
    in their next collective until the timeout). Also a barrier: no rank returns before rank 0 is done."""
    outcome: list[OSError | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as error:
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]


def _rank0_value(compute: Callable[[], Any]) -> Any:
    """`compute()` on rank 0, returned on every rank (one reading of the disk, the same answer everywhere)."""
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sha256(path: Path) -> str | None:
    """The file's sha256 (hex); None if it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)  # releases the GIL: the watchdog's and other threads keep running
    except OSError:
        return None
    return digest.hexdigest()


def _file_digests(folder: Path, names: list[str]) -> dict[str, str | None]:
    """sha256 of each named file, each rank hashing every world_size-th; the whole dict on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[dict[str, str | None]] = [{}] * world
    dist.all_gather_object(parts, {name: _sha256(folder / name) for name in names[rank::world]})
    return {name: digest for part in parts for name, digest in part.items()}


def _probe_write(folder: Path) -> OSError | None:
    """Why 1 MiB cannot be written (and synced) into `folder` now, or None if it can."""
    probe = folder / ".write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        return error
    finally:
        probe.unlink(missing_ok=True)
    return None


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: raised here, or by one rank inside DCP (a CheckpointException)."""
    causes = [error]
    if isinstance(error, CheckpointException):  # {rank: (exception, traceback)}
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
    for cause in causes:
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return cause
    return None


class CheckpointManager:
    """Saves, finds and loads the run's checkpoints. Every method is collective: call it on every rank."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.folder = Path(run_dir) / "checkpoints"
        self._last_step: int | None = None  # saved or loaded: saving it again would only rewrite the same state

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (zero-padded names sort by step)."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if _COMPLETE_NAME.fullmatch(p.name) and p.is_dir())

    def resume_path(self) -> Path | None:
        """`checkpoint.load_path` if set, else (with `checkpoint.resume`) the run's newest complete checkpoint that
        verifies. A damaged newer one is named in a warning and passed over, or refused with `strict_resume`."""
        if self.cfg.load_path:
            path = Path(self.cfg.load_path)
            if problem := self.verify(path):
                raise ConfigError(f"checkpoint.load_path {path}: {problem}; point it at an intact checkpoint "
                                  "directory, or leave it empty to resume from the run directory")
            return path
        if not self.cfg.resume:
            return None
        complete = self.complete_checkpoints()
        for path in reversed(complete):
            problem = self.verify(path)
            if problem is None:
                return path
            if self.cfg.strict_resume:
                raise ConfigError(f"checkpoint.strict_resume: the latest checkpoint {path} is damaged ({problem}); "
                                  "remove it to resume from the one before, or set checkpoint.strict_resume = false")
            if dist.get_rank() == 0:
                print(f"warning: checkpoint {path} is damaged ({problem}): not loaded; trying the one before",
                      file=sys.stderr, flush=True)
        if complete:
            raise ConfigError(f"checkpoint.resume: no checkpoint in {self.folder} verifies (see the warnings); "
                              "start over with --checkpoint.resume false or another job.run_dir")
        return None

    def verify(self, path: Path) -> str | None:
        """Why the checkpoint at `path` cannot be trusted, or None when every file has its recorded size and
        checksum. Collective: the hashing is spread over the ranks. Sizes are checked first (a truncated or
        missing file costs no hashing)."""
        problem, files = _rank0_value(lambda: _read_manifest(path))
        if problem == LEGACY and not self.cfg.strict_resume:  # written before checkpoints carried checksums
            if dist.get_rank() == 0:
                print(f"warning: checkpoint {path} has no {MANIFEST} (written by an older version): loaded "
                      "unverified", file=sys.stderr, flush=True)
            return None
        if problem:
            return problem
        digests = _file_digests(path, sorted(files))
        bad = sorted(name for name, entry in files.items() if digests[name] != entry.get("sha256"))
        return f"{', '.join(bad[:3])} does not match its checksum" if bad else None

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether `save` writes at this step: every `checkpoint.interval` steps and at the end (`final`)."""
        return self.cfg.enable and step != self._last_step and (final or step % self.cfg.interval == 0)

    def save(self, step: int, states: dict[str, Stateful], *, final: bool = False) -> None:
        """Write `states` (and `step`) when it is `due`."""
        if not self.due(step, final=final):
            return
        path = self.folder / f"step-{step:08d}"
        partial = path.with_name(path.name + ".partial")
        try:
            _on_rank0(lambda: self._clear(partial))  # nobody writes into it while rank 0 is still clearing it
            dcp.save({**states, _META_KEY: {"step": step, "world_size": dist.get_world_size()}},
                     checkpoint_id=partial)  # returns once every rank's files and the .metadata are on disk
            self._write_manifest(partial)
            _on_rank0(lambda: self._publish(partial, path))  # nobody lists or saves again before it is done
        except (OSError, CheckpointException) as error:
            # torch.save's writer reports a full disk as "unexpected pos": then a probe write finds the real cause.
            cause = _os_error(error) or _rank0_value(lambda: _probe_write(self.folder))
            if cause is None:
                raise
            if dist.get_rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)  # the space it took is what the run lacks
            raise self._write_failed(path, cause) from None
        self._last_step = step

    def _clear(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
        partial.mkdir(parents=True)

    def _write_manifest(self, partial: Path) -> None:
        """Hash every file of the finished DCP save (spread over the ranks); rank 0 writes the manifest."""
        names = _rank0_value(lambda: sorted(p.name for p in partial.iterdir()))
        digests = _file_digests(partial, names)
        unreadable = [name for name in names if digests[name] is None]
        if unreadable:
            raise OSError(errno.EIO, "cannot read back what was written", str(partial / unreadable[0]))

        def write() -> None:
            files = {name: {"bytes": (partial / name).stat().st_size, "sha256": digests[name]} for name in names}
            with open(partial / MANIFEST, "w") as f:
                json.dump({"files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())

        _on_rank0(write)

    def _publish(self, partial: Path, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)  # an earlier run in this run_dir (resume off) saved this step
        partial.rename(path)
        _fsync_dir(self.folder)
        self._prune()

    def _write_failed(self, path: Path, error: OSError) -> CheckpointWriteFailed:
        complete = self.complete_checkpoints()
        kept = f"the latest complete checkpoint {complete[-1]} is kept" if complete else "no earlier checkpoint exists"
        what, fix = _disk_problem(error, self.folder)
        return CheckpointWriteFailed(f"cannot write checkpoint {path}: {what}; {kept}; {fix} or choose another "
                                     "job.run_dir, then rerun to resume")

    def _prune(self) -> None:
        """Drop all but the newest `checkpoint.keep` checkpoints, and `.partial` leftovers of crashed saves."""
        stale = [p for p in self.folder.iterdir() if p.name.endswith(".partial")]
        if self.cfg.keep:
            stale += self.complete_checkpoints()[: -self.cfg.keep]
        for p in stale:
            shutil.rmtree(p)

    def load(self, path: Path, states: dict[str, Stateful]) -> int:
        """Load `states` in place from the checkpoint at `path`; returns the step it was saved at."""
        try:
            return self._load(path, states)
        except CheckpointException as e:  # DCP's planner: a missing key or a shape mismatch, as a long traceback
            raise self._does_not_fit(path, " ".join(str(next(iter(e.failures.values()))[0]).split())) from None

    def _load(self, path: Path, states: dict[str, Stateful]) -> int:
        meta = {"step": -1, "world_size": -1}
        dcp.load({_META_KEY: meta}, checkpoint_id=path)
        world_size = dist.get_world_size()
        if meta["world_size"] != world_size and any(isinstance(s, RankLocalState) for s in states.values()):
            raise ConfigError(
                f"{self._source_key()}: {path} was saved by {meta['world_size']} ranks but this run has "
                f"{world_size}, so the per-rank state (data position, RNG) has no exact counterpart; run with "
                f"{meta['world_size']} processes or start a new run_dir"
            )
        if "model" in states:
            self._check_model_keys(path, states["model"])
        dcp.load(dict(states), checkpoint_id=path)
        self._last_step = meta["step"]
        return meta["step"]

    def _source_key(self) -> str:
        """The config key that chose the checkpoint being loaded."""
        return "checkpoint.load_path" if self.cfg.load_path else "checkpoint.resume"

    def _does_not_fit(self, path: Path, cause: str) -> ConfigError:
        return ConfigError(f"{self._source_key()}: {path} does not fit this model ({cause}); load a checkpoint saved "
                           "with the same model.* settings, or start a new job.run_dir")

    def _check_model_keys(self, path: Path, model_state: Stateful) -> None:
        """DCP loads the keys the target asks for and ignores the rest: a checkpoint of a larger model would
        load partly and silently. Both sets of parameter names must be the same."""
        saved = {key.removeprefix("model.") for key in
                 dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if key.startswith("model.")}
        wanted = set(model_state.state_dict())
        if saved != wanted:
            extra, missing = sorted(saved - wanted), sorted(wanted - saved)
            raise self._does_not_fit(path, f"only in the checkpoint: {extra[:3]}, only in the model: {missing[:3]}")

    def export_weights(self, model: nn.Module, path: str | Path) -> None:
        """Write the full (unsharded) model state dict as one `torch.save` file, atomically, on rank 0."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0 only
        state = get_model_state_dict(model, options=options)
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                try:
                    torch.save(state, f)
                except RuntimeError as error:  # its writer reports a failed write as "unexpected pos"
                    raise _os_error(error) or _probe_write(path.parent) or error from None
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)

        try:
            _on_rank0(write)  # the file exists for every rank once this returns
        except OSError as error:
            if dist.get_rank() == 0:
                tmp.unlink(missing_ok=True)
            what, fix = _disk_problem(error, path.parent)
            raise CheckpointWriteFailed(f"cannot write the weights {path}: {what}; the checkpoints in {self.folder} "
                                        f"hold them too; {fix} or set checkpoint.export_weights = false") from None


def _disk_problem(error: OSError, folder: Path) -> tuple[str, str]:
    """What went wrong and where ('the disk is full (No space left on device: <file>)'), and the fix."""
    what = f"{_WRITE_PROBLEMS.get(error.errno, 'the write failed')} ({error.strerror}: {error.filename or folder})"
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    return what, f"free space in {folder}" if full else f"make {folder} writable"


def _read_manifest(path: Path) -> tuple[str | None, dict[str, dict]]:
    """(problem, files) of the checkpoint at `path` from its manifest and the files' sizes, without hashing."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        for name, entry in files.items():
            if not (path / name).is_file():
                return f"{name} is missing", {}
            size = (path / name).stat().st_size
            if size != entry["bytes"]:
                return f"{name} has {size} of its {entry['bytes']} bytes", {}
    except FileNotFoundError:
        return (LEGACY if (path / ".metadata").is_file() else f"no {MANIFEST} and no .metadata"), {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable {MANIFEST} ({type(error).__name__}: {error})", {}
    return None, files
