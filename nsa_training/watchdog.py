"""Never hang silently, never lose work: a hang watchdog, a stop-on-signal flag, one-line reports of a dead peer or
of out-of-memory (with an allocator snapshot), where the launcher finds them, workers that die with the launcher,
and the NCCL flight recorder's settings."""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from nsa_training.config import Config, ConfigError
from nsa_training.exit_codes import BAD_INPUT_EXIT_CODE, COLLECTIVE_EXIT_CODE, HANG_EXIT_CODE, OOM_EXIT_CODE
from parallelisms.compile import CUDA_GRAPH_MODES

LAUNCHER_PID = "NSA_LAUNCHER_PID"  # set by nsa_training/launch.py for its workers
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def report_error(message: str, exit_code: int) -> None:
    """Report the failure that ends this process with `exit_code`: one `error: <message>` line.

    Under torchrun both also go into the worker's error file (TORCHELASTIC_ERROR_FILE, which torch's `@record`
    writes and torchrun's failure report reads); under nsa_training/launch.py only there: the launcher prints the
    one line of the rank whose failure caused the others'.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # Written beside it and renamed: the launcher reads the file as soon as this process ends, which another
        # rank's failure can make happen mid-write, and torchrun fails on a file it cannot parse.
        partial = f"{error_file}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time()), "exitcode": exit_code}, f)
        os.replace(partial, error_file)
    if not (error_file and LAUNCHER_PID in os.environ):
        # One write of the whole line: ranks share a log, and print()'s separate newline lets lines run together.
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()


def exit_with_launcher() -> None:
    """Under nsa_training/launch.py, make the kernel kill this worker (SIGKILL) the moment the launcher ends.

    torchrun starts each worker in a session of its own, so a signal to the launcher's process group misses the
    workers, and a launcher killed by SIGKILL forwards nothing: they would go on training, and writing checkpoints,
    beside a restart of the run. SIGKILL, not SIGTERM: a launcher that died without forwarding a stop had no time
    to wait for a checkpoint either. Linux only (PR_SET_PDEATHSIG); call it first thing in the worker.
    """
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):  # the launcher ended before the call above armed the signal
        os.kill(os.getpid(), signal.SIGKILL)


class HangWatchdog:
    """Kills this rank when no training step completes in time, leaving every thread's stack.

    A stalled collective (a dead peer, a NCCL deadlock) otherwise blocks forever without a word. A daemon thread
    checks the time since the last `beat(step)`; past the allowance it writes all Python stacks to
    `<run_dir>/hang/rank<R>.txt`, reports one line and exits with status 3. The clock starts at `__enter__`
    (training start). The first step (compilation, warm-up, the first checkpoint) gets `init_timeout_s`, every
    later one `timeout_s`, as TorchTitan separates its init and train timeouts: a cold compile may take longer than
    a stalled step should. `timeout_s = 0` disables the watchdog.
    """

    def __init__(self, init_timeout_s: float, timeout_s: float, run_dir: str | Path, rank: int) -> None:
        self.init_timeout_s, self.timeout_s, self.rank = init_timeout_s, timeout_s, rank
        self.stack_file = Path(run_dir) / "hang" / f"rank{rank}.txt"
        self._last_beat, self._last_step = time.monotonic(), None
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
        poll_s = min(self.init_timeout_s, self.timeout_s) / 10  # fires at most 10% late
        while not self._stopped.wait(min(poll_s, 30.0)):
            idle = time.monotonic() - self._last_beat
            if idle > (self.init_timeout_s if self._last_step is None else self.timeout_s):
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stack_file, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        if self._last_step is None:
            what = f"the first step did not complete in {idle:.0f} s (debug.init_timeout_s = {self.init_timeout_s:g})"
        else:
            what = (f"no step completed for {idle:.0f} s after step {self._last_step} "
                    f"(debug.hang_timeout_s = {self.timeout_s:g})")
        report_error(f"rank {self.rank} stalled: {what}; stacks in {self.stack_file}", HANG_EXIT_CODE)
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


class RunFailed(Exception):
    """A run ended by a known failure: train.py prints `error: <message>` and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def report_failure(error: ConfigError | RunFailed) -> int:
    """End a command on `error`: its one `error:` line (`report_error`), and its exit status: BAD_INPUT_EXIT_CODE for
    bad input (ConfigError), a RunFailed's own otherwise. Every command (train.py, scripts/, bench/) ends this way."""
    code = BAD_INPUT_EXIT_CODE if isinstance(error, ConfigError) else error.exit_code
    report_error(str(error), code)
    return code


class MemorySnapshots:
    """Records the CUDA allocator's history and dumps it for https://pytorch.org/memory_viz.

    `<run_dir>/memory/rank<R>_step<N>.pickle` after step N (`debug.memory_snapshot_step`), and
    `rank<R>_oom.pickle` when an allocation fails (see ReportFailures). Recording keeps a stack trace per
    allocation, which slows training: a debugging switch, off by default.
    """

    MAX_ENTRIES = 100_000  # allocator events kept (a ring buffer): several steps of a large model, bounded memory

    def __init__(self, run_dir: str | Path, rank: int, device, dump_after_step: int) -> None:
        import torch

        if device.type != "cuda":
            raise ConfigError(f"debug.memory_snapshot = true needs CUDA (device is {device.type}): run on a GPU or "
                              "set --debug.memory_snapshot false")
        self.folder, self.rank, self.dump_after_step = Path(run_dir) / "memory", rank, dump_after_step
        torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)

    def after_step(self, step: int) -> None:
        if step == self.dump_after_step:
            self.dump(f"step{step}")

    def dump(self, name: str) -> Path:
        import torch

        path = self.folder / f"rank{self.rank}_{name}.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective or store operation that failed: a peer died, or a timeout passed."""
    import torch.distributed as dist

    # NCCL and the store raise DistError; gloo raises a plain RuntimeError whose message starts with the gloo
    # source location ("[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer").
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "/gloo/" in str(error))


def out_of_memory_advice(config: Config, device_type: str, world_size: int) -> str:
    """What to change after running out of memory, naming only settings this run does not already use, each with its
    current value: one clause list for the line of an out-of-memory failure (`device_type` as torch.device.type,
    `world_size` processes)."""
    training, nsa, parallelism = config.training, config.model.nsa, config.parallelism
    # data.seq_len comes last: it changes what is trained, every other clause only how.
    clauses: list[str] = []
    if training.micro_batch_size > 1:
        clauses.append(f"lower training.micro_batch_size (now {training.micro_batch_size})")
    if config.model.attention == "nsa" and nsa.backend == "triton" and nsa.window_backend == "sdpa":
        clauses.append("set model.nsa.window_backend = 'flex' (now 'sdpa', which materialises a seq_len x seq_len "
                       "mask)")
    if config.model.attention == "nsa" and nsa.backend == "reference" and device_type == "cuda":
        clauses.append("set model.nsa.backend = 'triton' (now 'reference', which is memory hungry)")
    if config.activation_checkpoint.mode != "full":
        clauses.append(f"set activation_checkpoint.mode = 'full' (now {config.activation_checkpoint.mode!r})")
    if parallelism.data_parallel != "ddp":  # fsdp / hsdp shard already: only more GPUs make each share smaller
        clauses.append(f"shard over more GPUs (now {world_size})")
    elif world_size > 1:  # each ddp rank holds the whole model; fsdp shards it over these ranks already
        clauses.append(f"set parallelism.data_parallel = 'fsdp' (now 'ddp') to shard over the {world_size} ranks, "
                       "or more")
    else:
        clauses.append("shard over more GPUs with parallelism.data_parallel = 'fsdp' (now 'ddp')")
    if config.compile.enable and config.compile.mode in CUDA_GRAPH_MODES:  # resolved: `auto` is one of these or not
        clauses.append(f"set compile.mode = 'default' (now {config.compile.mode!r}, whose CUDA graphs keep a memory "
                       "pool of their own)")
    if training.micro_batch_size == 1:
        clauses.append(f"lower data.seq_len (now {config.data.seq_len})")
    # Always two clauses at least: one size (micro_batch_size or seq_len) and one sharding.
    return ", ".join(clauses[:-1]) + (", or " if len(clauses) > 2 else " or ") + clauses[-1]


class ReportFailures:
    """Turns the two failures of a correct program into RunFailed (one line, no traceback): a collective that failed
    because another rank died or stalled past the timeout (exit status 5), and out-of-memory (exit status 6, after
    dumping `rank<R>_oom.pickle` when `memory` records). Any other exception passes unchanged: it is a bug.

    `beat(step)` after each step; until the first beat, the failing collective ran under `debug.init_timeout_s`.
    `oom_advice` ends the out-of-memory line (out_of_memory_advice).
    """

    def __init__(self, rank: int, start_step: int, init_timeout_s: float, collective_timeout_s: float,
                 memory: MemorySnapshots | None, oom_advice: str) -> None:
        self.rank, self.memory, self.oom_advice = rank, memory, oom_advice
        self.timeouts = {"debug.init_timeout_s": init_timeout_s, "debug.collective_timeout_s": collective_timeout_s}
        self._start_step = self._last_step = start_step

    def __enter__(self) -> ReportFailures:
        return self

    def beat(self, step: int) -> None:
        self._last_step = step

    def __exit__(self, exc_type, error, traceback) -> None:
        import torch

        where = f"rank {self.rank}: step {self._last_step + 1}"
        cause = str(error).strip().split("\n")[0] if error is not None else ""
        # CPU: torch's allocator raises a plain RuntimeError (where the kernel lets malloc fail at all)
        cpu_oom = isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)
        if isinstance(error, torch.OutOfMemoryError) or cpu_oom:
            if self.memory is not None:
                snapshot = f"allocator snapshot {self.memory.dump('oom')} (open it at https://pytorch.org/memory_viz)"
            else:
                snapshot = "rerun with --debug.memory_snapshot true for an allocator snapshot"
            raise RunFailed(f"{where}: out of memory ({cause}); {snapshot}; {self.oom_advice}",
                            OOM_EXIT_CODE) from None
        if error is not None and is_collective_failure(error):
            key = "debug.collective_timeout_s" if self._last_step > self._start_step else "debug.init_timeout_s"
            raise RunFailed(f"{where}: a collective failed ({cause}): another rank died, or stalled longer than "
                            f"{key} = {self.timeouts[key]:g} s; its own output says why; rerun to resume from the "
                            "latest checkpoint", COLLECTIVE_EXIT_CODE) from None


def enable_flight_recorder(run_dir: str | Path) -> dict[str, str]:
    """Make NCCL dump every rank's last collectives to `<run_dir>/flight_recorder/rank<R>` when a collective times
    out (read them with `python -m torch.distributed.flight_recorder.fr_trace <that folder>`).

    Sets each setting the user has not set under any of its names; returns what it set. Call it before
    init_process_group, which reads them. torch writes `<prefix><global rank>` but does not create the folder.
    """
    folder = Path(run_dir) / "flight_recorder"
    # torch 2.13's name: (value, older names it still reads, with a deprecation warning)
    settings = {
        "TORCH_FR_BUFFER_SIZE": ("2000", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1",),
        "TORCH_FR_DUMP_TEMP_FILE": (str(folder / "rank"), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
    }
    chosen = {name: value for name, (value, *others) in settings.items()
              if not any(n in os.environ for n in (name, *others))}
    if "TORCH_FR_DUMP_TEMP_FILE" in chosen:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"job.run_dir = {str(run_dir)!r} is not writable ({e.strerror}): choose another "
                              "directory") from None
    os.environ.update(chosen)
    return chosen
