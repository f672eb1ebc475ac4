"""Several training processes through torchrun, ending the way one process does (run.sh uses it for NGPU x NNODES > 1).

    NGPU=2 python -m nsa_training.launch [RECIPE.toml] [--section.key value ...]

Environment, as run.sh documents it: NGPU (processes on this node), NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
LOG_RANK (the ranks whose output is shown).

- Before any process starts, the recipe and the rules that depend on the process count (the data- and
  context-parallel degrees, the global batch's split over the data-parallel ranks) are checked: a bad one is one
  `error:` line and exit status 2 instead of one per rank.
- The exit status is train.py's whichever rank failed, with one `error:` line, that of the failure that caused the
  others, instead of torchrun's traceback, failure table and status 1 (see `explain`).
- SIGTERM / SIGINT: torchrun forwards them, every rank checkpoints, and the status is 128 + the signal number.
- Workers die with the launcher, however it ends (watchdog.exit_with_launcher).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from nsa_training.config import Config, ConfigError, config_to_toml, help_text, help_topic, load_config
from nsa_training.exit_codes import BAD_INPUT_EXIT_CODE, COLLECTIVE_EXIT_CODE
from nsa_training.watchdog import LAUNCHER_PID

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
STOPPED = {128 + signal.SIGTERM, 128 + signal.SIGINT}  # every rank stopped by a signal, after its checkpoint


def main(argv: list[str]) -> int:
    try:
        topic = help_topic(argv)
        if topic is not None:  # as train.py answers it
            print(help_text(topic), end="")
            return 0
        nproc, nnodes = _env_int("NGPU", "1"), _env_int("NNODES", "1")
        rendezvous = _rendezvous(nnodes)
        config, print_only = load_config(argv)
        check_world_size(config, nproc * nnodes)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return BAD_INPUT_EXIT_CODE
    if print_only:
        print(config_to_toml(config), end="")
        return 0
    log_dir = tempfile.mkdtemp(prefix="nsa-launch-")  # every rank's stdout/stderr/error.json, kept after the run
    return launch([*rendezvous, "--nproc-per-node", str(nproc), "--local-ranks-filter",
                   os.environ.get("LOG_RANK", "0"), "--role", "rank", "--tee", "3", "--log-dir", log_dir,
                   str(TRAIN_PY), *argv], log_dir)


def check_world_size(config: Config, world_size: int) -> None:
    """The plan rules that depend on the process count; the ranks check them again, each for itself."""
    from nsa_training.trainer import check_log_rank, grad_accum_steps
    from parallelisms import ParallelDims, PlanError, check_data_parallel

    check_log_rank(config, world_size)
    try:
        check_data_parallel(config.parallelism, config.compile, world_size)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    grad_accum_steps(config, ParallelDims.from_config(config.parallelism, world_size).dp_size)


def launch(torchrun_args: list[str], log_dir: str) -> int:
    """Run torchrun in this process (its workers are this process's children); return the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers inherit it
    # torchrun logs each failure and each worker it stops; explain() says what matters in one line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(torchrun_args))
    except SignalException as e:  # torchrun forwarded it and the workers stopped
        return 128 + e.sigval
    except ChildFailedError as e:
        message, status = explain(e.failures, log_dir)
        if message:
            sys.stderr.write(f"error: {message}\n")
        return status
    return 0


def explain(failures: dict, log_dir: str) -> tuple[str | None, int]:
    """The `error:` message (None: the ranks said it) and exit status of a launch whose ranks `failures` failed.

    The cause goes first: a rank that ended for a reason of its own (stalled, diverged, bad input, out of memory, a
    bug). Then, the earlier of a rank killed by a signal without a word and a rank whose collective failed (status
    5: another rank died or stalled): a killed rank is the cause if it died first, a casualty if torchrun killed it
    after the failure (it sends SIGTERM, and SIGKILL 30 s later). Last, ranks stopped by a signal after a checkpoint.
    """
    def status(failure) -> int:
        return _report(failure).get("exitcode", failure.exitcode)

    def order(rank: int) -> tuple:
        failure = failures[rank]
        code = status(failure)
        if code in STOPPED:
            return 3, 0, rank
        if code == -signal.SIGTERM:
            return 2, 0, rank
        if code < 0:  # torchrun's time, in whole seconds, of when it noticed the death: the death was earlier
            return 1, failure.timestamp - 1, rank
        return int(code == COLLECTIVE_EXIT_CODE), _when(failure), rank

    rank = min(failures, key=order)
    failure, code = failures[rank], status(failures[rank])
    killed = sorted(r for r in failures if status(failures[r]) < 0)
    if code in STOPPED:  # each rank printed where it stopped and how to resume
        return None, code
    if code < 0:
        return (f"rank {rank} was killed by {signal.Signals(-code).name} without a word (the out-of-memory killer "
                "sends SIGKILL); the other ranks were stopped; rerun to resume from the latest checkpoint",
                COLLECTIVE_EXIT_CODE)
    message = _report(failure).get("message")
    if message is None:
        message = f"rank {rank} exited with status {code}; its output: {_stderr_log(log_dir, failure.local_rank)}"
    elif code == COLLECTIVE_EXIT_CODE and killed:
        message += f" (rank {killed[0]} ended by {signal.Signals(-status(failures[killed[0]])).name})"
    return message, code


def _report(failure) -> dict:
    """What the rank wrote with watchdog.report_error ({} if nothing)."""
    data = failure.error_file_data if os.path.isfile(failure.error_file) else {}
    return data if isinstance(data.get("message"), str) else {}


def _when(failure) -> float:
    """When the rank reported its failure (torchrun's timestamp, in whole seconds, if it did not)."""
    return os.path.getmtime(failure.error_file) if os.path.isfile(failure.error_file) else failure.timestamp


def _stderr_log(log_dir: str, local_rank: int) -> str:
    logs = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"))
    return str(logs[-1]) if logs else log_dir


def _env_int(name: str, default: str) -> int:
    value = os.environ.get(name, default)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name} = {value!r}: must be a positive integer")
    return int(value)


def _rendezvous(nnodes: int) -> list[str]:
    if nnodes == 1:
        return ["--standalone", "--nnodes", "1"]
    missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"NNODES = {nnodes} needs {' and '.join(missing)} in the environment: set them on each node")
    return ["--nnodes", str(nnodes), "--node-rank", os.environ["NODE_RANK"], "--master-addr",
            os.environ["MASTER_ADDR"], "--master-port", os.environ.get("MASTER_PORT", "29500")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
