"""Never hang silently, never lose work: a hang watchdog and a stop-on-signal flag for the training loop."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 3


class HangWatchdog:
    """Kills this rank when no training step completes for `timeout_s` seconds, leaving every thread's stack.

    A stalled collective (a dead peer, a NCCL deadlock) otherwise blocks forever without a word. A daemon thread
    checks the time since the last `beat(step)`; past the timeout it writes all Python stacks to
    `<run_dir>/hang/rank<R>.txt`, prints one line and exits with status 3. The clock starts at `__enter__`
    (training start), so the first interval also covers the first batch and compilation. 0 disables it.
    """

    def __init__(self, timeout_s: float, run_dir: str | Path, rank: int) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.stack_file = Path(run_dir) / "hang" / f"rank{rank}.txt"
        self._last_beat, self._last_step = time.monotonic(), 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def __enter__(self) -> HangWatchdog:
        if self.timeout_s > 0:
            self._last_beat = time.monotonic()
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()

    def beat(self, step: int) -> None:
        """Record that `step` completed."""
        self._last_beat, self._last_step = time.monotonic(), step

    def _watch(self) -> None:
        poll_s = min(self.timeout_s / 10, 30.0)  # fires at most 10% (or 30 s) late
        while not self._stopped.wait(poll_s):
            idle = time.monotonic() - self._last_beat
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stack_file, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"error: rank {self.rank} stalled: no step completed for {idle:.0f} s after step {self._last_step}; "
              f"stacks in {self.stack_file}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)  # the main thread is stuck: only a hard exit ends the process


class StopOnSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current step (and checkpoint); a second one exits at once.

    Schedulers (SLURM, Kubernetes, torchrun forwarding) send SIGTERM some time before SIGKILL: that grace period
    is spent finishing the step and writing a checkpoint instead of losing everything since the last interval.
    Handlers are installed only in the main thread (Python allows no other) and restored on exit. The trainer
    reads `received` once per step on all ranks together, so every rank stops after the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received = 0  # number of the first signal received by this process; 0: none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received:  # the user insists: no checkpoint, exit the conventional 128 + signal number
            os._exit(128 + signum)
        self.received = signum
