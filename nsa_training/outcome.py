"""A training step's outcome, read on the host without stopping the host at every step.

Deciding on the host whether a step's update is applied (`.item()` of its finite flag) makes the host wait for the
GPU at every step; without CUDA graphs (FSDP2, `compile.mode = "default"`) the host enqueues a step about as fast as
the GPU runs it, so each wait leaves the GPU idle while the host enqueues the optimizer and the next forward. Instead
the update is skipped on the device (fused AdamW's `found_inf`), and what the host needs of the step (the LR
schedule's count of applied updates, the skip counters, the logged scalars) is read one step later: its values are
copied behind the step's work into pinned memory, and by the time the next step's gradients are queued the copy has
long finished (`PendingOutcome.settle` then waits on an event that is already past).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step as the host sees it."""
    step: int
    loss: float          # the step's loss (the mean over its micro-batches), averaged over the ranks
    grad_norm: float     # before clipping
    applied: bool        # False: the loss or gradient norm was not finite on some rank; the update was skipped
    lr: float            # the LR this step's update used (or would have)
    data_time: float     # seconds the host waited for this rank's batches
    nsa_stats: list[list[float]] | None  # the model's NSA telemetry rows (`nsa_models.telemetry`), where asked for


class PendingOutcome:
    """A step's device scalars on their way to the host: `settle()` returns its `StepOutcome`."""

    def __init__(self, step: int, loss: Tensor, grad_norm: Tensor, skipped: Tensor, lr: float, data_time: float,
                 nsa_stats: Tensor | None = None) -> None:
        values = torch.stack([loss.float(), grad_norm.float(), skipped.float()])
        self._scalars, self._nsa_stats = _to_host(values), None if nsa_stats is None else _to_host(nsa_stats)
        self._ready: torch.cuda.Event | None = None
        if values.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._step, self._lr, self._data_time = step, lr, data_time

    def settle(self) -> StepOutcome:
        if self._ready is not None:
            self._ready.synchronize()
        loss, grad_norm, skipped = self._scalars.tolist()
        nsa_stats = None if self._nsa_stats is None else self._nsa_stats.tolist()
        return StepOutcome(self._step, loss, grad_norm, not skipped, self._lr, self._data_time, nsa_stats)


def _to_host(x: Tensor) -> Tensor:
    """x itself on the CPU; else a pinned copy queued behind the work that produces x (read it after an event)."""
    if not x.is_cuda:
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)
