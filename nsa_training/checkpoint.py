"""Checkpoints: torch.distributed.checkpoint (DCP) directories under `<run_dir>/checkpoints`, written atomically.

Every rank writes `step-XXXXXXXX.partial`; only after all ranks finished does rank 0 rename it to `step-XXXXXXXX`.
So a complete name always holds a complete checkpoint: a crash during a save leaves at most a `.partial`
directory, which resume ignores and the next save removes. Model and optimizer states go through
`torch.distributed.checkpoint.state_dict`, so a checkpoint reshards between plain, DDP and FSDP2 models.
"""

from __future__ import annotations

import io
import os
import random
import re
import shutil
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

_COMPLETE_NAME = re.compile(r"step-\d{8}")
_META_KEY = "checkpoint"  # {"step", "world_size"}, saved next to the caller's states


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
        return get_optimizer_state_dict(self.model, self.optimizer)

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


class CheckpointManager:
    """Saves, finds and loads the run's checkpoints. Every method is collective: call it on every rank."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path) -> None:
        if cfg.interval < 1:
            raise ConfigError(
                f"checkpoint.interval {cfg.interval}: must be >= 1; use checkpoint.enable=false to disable saving"
            )
        if cfg.keep < 0:
            raise ConfigError(f"checkpoint.keep {cfg.keep}: must be >= 0 (0 keeps all)")
        self.cfg = cfg
        self.folder = Path(run_dir) / "checkpoints"
        self._last_step: int | None = None  # saved or loaded: saving it again would only rewrite the same state

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (zero-padded names sort by step)."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if _COMPLETE_NAME.fullmatch(p.name) and p.is_dir())

    def resume_path(self) -> Path | None:
        """`checkpoint.load_path` if set, else (with `checkpoint.resume`) the run's latest complete checkpoint."""
        if self.cfg.load_path:
            path = Path(self.cfg.load_path)
            if not (path / ".metadata").is_file():
                raise ConfigError(
                    f"checkpoint.load_path {path}: not a complete checkpoint directory (no .metadata); "
                    "fix the path or leave it empty to resume from the run directory"
                )
            return path
        complete = self.complete_checkpoints() if self.cfg.resume else []
        return complete[-1] if complete else None

    def save(self, step: int, states: dict[str, Stateful], *, final: bool = False) -> None:
        """Write `states` (and `step`) at every `checkpoint.interval` steps and at the end (`final`)."""
        if not self.cfg.enable or step == self._last_step or not (final or step % self.cfg.interval == 0):
            return
        is_rank0 = dist.get_rank() == 0
        path = self.folder / f"step-{step:08d}"
        partial = path.with_name(path.name + ".partial")
        if is_rank0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
            partial.mkdir(parents=True)
        dist.barrier()  # nobody writes into the directory while rank 0 is still clearing it
        dcp.save({**states, _META_KEY: {"step": step, "world_size": dist.get_world_size()}}, checkpoint_id=partial)
        dist.barrier()  # every rank's shards are on disk
        if is_rank0:
            shutil.rmtree(path, ignore_errors=True)  # an earlier run in this run_dir (resume off) saved this step
            partial.rename(path)
            _fsync_dir(self.folder)
            self._prune()
        dist.barrier()  # nobody lists or saves again before the rename and pruning are done
        self._last_step = step

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
        if dist.get_rank() == 0:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".partial")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        dist.barrier()  # the file exists for every rank once this returns
