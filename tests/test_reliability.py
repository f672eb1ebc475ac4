"""Never hang silently, never lose work: hang watchdog, non-finite step guard, SIGTERM checkpoint, clear errors,
a dead or stalled rank, out-of-memory, the NCCL flight recorder's settings."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, env, event_files, merged, scalars

COMMON = [sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "12", "--checkpoint.interval", "5",
          "--checkpoint.export_weights", "false", *FAST]


def train(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(merged(COMMON, ["--job.run_dir", str(run_dir)], args), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> dict[str, dict[int, float]]:
    """An uninterrupted run of COMMON: its scalars, and its checkpoints under `run_dir`."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"run_dir": run_dir, "stderr": result.stderr, **scalars(event_files(run_dir)[-1])}


def test_tflops_logged_and_no_mfu_without_a_known_peak(clean_run):
    from nsa_models.flops import flops_per_token
    from nsa_training.config import load_config

    run_config = load_config([str(clean_run["run_dir"] / "config.toml")])[0]  # the vocabulary the run resolved
    per_token = flops_per_token(run_config.model, run_config.data.seq_len).total
    for step, tflops in clean_run["perf/tflops"].items():
        assert tflops == pytest.approx(per_token * clean_run["perf/tokens_per_s"][step] / 1e12, rel=1e-5)
    assert "perf/mfu" not in clean_run
    # MFU is a GPU's measure: a CPU run logs none and says nothing about it.
    assert [line for line in clean_run["stderr"].splitlines() if line.startswith("warning:")] == []


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_peak_tflops_by_device_name(monkeypatch, name, peak):
    import torch

    from nsa_training.metrics import peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0)) == peak
    assert peak_tflops(torch.device("cpu")) is None


def test_hang_watchdog_dumps_stacks_and_exits(tmp_path):
    """Step 1 stalls: the watchdog fires after debug.init_timeout_s (the first step's allowance), not after the
    steady-state debug.hang_timeout_s. No step can complete before it fires, whatever the machine's speed."""
    run_dir = tmp_path / "run"
    result = train(run_dir, "--debug.sleep_at_step", "1", "--debug.sleep_s", "600", "--debug.init_timeout_s", "5",
                   "--debug.hang_timeout_s", "1000", timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    stack_file = run_dir / "hang" / "rank0.txt"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: rank 0 stalled: the first step did not complete in (\d+) s \(debug.init_timeout_s = 5\); stacks "
        rf"in {re.escape(str(stack_file))}", errors[0]), result.stderr[-3000:]
    assert int(re.search(r"in (\d+) s", errors[0])[1]) >= 5
    stacks = stack_file.read_text()
    assert 'trainer.py", line' in stacks and " in _update" in stacks  # the main thread, caught in the step
    assert "in _watch" in stacks  # every thread, not only the stuck one


WATCHDOG = """import sys, time
from nsa_training.watchdog import HangWatchdog
init_timeout_s, timeout_s, first_step_s = map(float, sys.argv[2:])
with HangWatchdog(init_timeout_s, timeout_s, sys.argv[1], rank=0) as watchdog:
    time.sleep(first_step_s)
    watchdog.beat(1)
    time.sleep(600)
"""


@pytest.mark.parametrize("init_timeout_s, timeout_s, first_step_s, message", [
    # A first step (compilation, warm-up) longer than the steady-state timeout is no stall...
    (600, 1, 3, r"no step completed for \d+ s after step 1 \(debug.hang_timeout_s = 1\)"),
    # ...but one longer than the first step's own allowance is.
    (1, 600, 600, r"the first step did not complete in \d+ s \(debug.init_timeout_s = 1\)"),
])
def test_hang_watchdog_allows_the_first_step_init_timeout_then_hang_timeout(tmp_path, init_timeout_s, timeout_s,
                                                                           first_step_s, message):
    result = subprocess.run([sys.executable, "-c", WATCHDOG, str(tmp_path), str(init_timeout_s), str(timeout_s),
                             str(first_step_s)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.fullmatch(rf"error: rank 0 stalled: {message}; stacks in {re.escape(str(tmp_path))}/hang/rank0.txt\n",
                        result.stderr), result.stderr[-3000:]


def test_non_finite_step_is_skipped_never_checkpointed_and_training_goes_on(tmp_path, clean_run):
    run_dir = tmp_path / "nan"
    result = train(run_dir, "--debug.nan_at_step", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if "SKIPPED" in line]
    assert line.startswith("step      5/12  loss nan")
    logged = scalars(event_files(run_dir)[-1])
    assert math.isnan(logged["train/loss"][5]) and logged["train/skipped_steps"][5] == 1
    assert logged["train/skipped_steps"][12] == 1
    assert all(math.isfinite(logged["train/loss"][s]) for s in range(6, 13))
    # The skipped step left no checkpoint (the interval's step-5 is missing); the later ones were written.
    assert checkpoint_names(run_dir) == ["step-00000010", "step-00000012"]
    assert checkpoint_names(clean_run["run_dir"]) == ["step-00000005", "step-00000010", "step-00000012"]
    # The LR schedule did not advance on the skipped step: it runs one step behind the clean run from then on.
    lr, clean_lr = logged["train/lr"], clean_run["train/lr"]
    assert [lr[s] for s in range(5, 13)] == [clean_lr[s - 1] for s in range(5, 13)]
    assert clean_lr[11] != clean_lr[12]  # the comparison above covers a changing LR (the decay)

    # A later checkpoint loads and continues exactly as the run that wrote it.
    resumed_dir = tmp_path / "resumed"
    resumed = train(resumed_dir, "--debug.nan_at_step", "5", "--checkpoint.load_path",
                    str(run_dir / "checkpoints" / "step-00000010"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_loss = scalars(event_files(resumed_dir)[-1])["train/loss"]
    assert resumed_loss == {s: logged["train/loss"][s] for s in (11, 12)}


def test_too_many_non_finite_steps_in_a_row_stop_with_one_line(tmp_path):
    result = train(tmp_path / "run", "--debug.nan_at_step", "3", "--debug.nan_steps", "100",
                   "--training.max_skipped_steps", "2")
    assert result.returncode == 4, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("error: step 4: loss or gradient norm not finite for 2 steps in a row "
                                "(training.max_skipped_steps = 2); latest checkpoint none")
    assert "step      5/" not in result.stdout


def test_sigterm_checkpoints_the_current_step_and_resume_is_bitwise_exact(tmp_path, clean_run):
    run_dir = tmp_path / "run"
    command = COMMON + ["--job.run_dir", str(run_dir)]
    proc = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    for line in proc.stdout:
        if line.startswith("step      7/12"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    match = re.search(r"^stopped by SIGTERM at step (\d+); checkpoint (\S+); resume with the same command$", rest,
                      re.MULTILINE)
    assert match, rest
    step = int(match[1])
    assert 7 <= step < 10 and Path(match[2]) == run_dir / "checkpoints" / f"step-{step:08d}"
    assert Path(match[2], ".metadata").is_file()

    resumed = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{step:08d} at step {step}" in resumed.stdout
    loss = scalars(event_files(run_dir)[-1])["train/loss"]
    assert loss == {s: clean_run["train/loss"][s] for s in range(step + 1, 13)}  # bitwise


def test_second_sigterm_exits_at_once_without_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    command = COMMON + ["--job.run_dir", str(run_dir), "--debug.sleep_at_step", "3", "--debug.sleep_s", "60"]
    proc = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    for line in proc.stdout:
        if line.startswith("step      2/12"):
            break
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)  # the first one only raises the flag: step 3 is still sleeping
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - start < 20
    assert "stopped by" not in proc.stdout.read()
    assert not (run_dir / "checkpoints").exists()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# COMMON's run on 2 gloo ranks: FAST's micro-batch on each, 4 steps (before the first checkpoint and evaluation).
TWO_RANKS = merged(COMMON[1:], ["--training.global_batch_tokens", "1024", "--training.steps", "4"])


def run_two_ranks(run_dir: Path, *args: str, timeout: float = 120, monitor_interval_s: float = 0.1
                  ) -> tuple[int, str, float]:
    """torchrun's exit status, its output, and the seconds from rank 0's step-1 line to torchrun's exit.
    torchrun checks its workers every `monitor_interval_s` and sends SIGTERM to the rest once one has died."""
    log = run_dir.parent / f"{run_dir.name}.log"
    launcher = TORCHRUN + ["--monitor-interval", str(monitor_interval_s)]
    with open(log, "w") as out:
        proc = subprocess.Popen(launcher + merged(TWO_RANKS, ["--job.run_dir", str(run_dir)], args), cwd=REPO,
                                env=env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            while "step      1/" not in log.read_text() and proc.poll() is None:
                time.sleep(0.05)
            start = time.monotonic()
            status = proc.wait(timeout=timeout)
        finally:
            proc.kill()
    return status, log.read_text(), time.monotonic() - start


def processes_naming(path: Path) -> list[int]:
    """Pids of the live processes whose command line contains `path`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # it exited meanwhile
            pass
    return pids


def run_sh(run_dir: Path, *args: str, ngpu: int = 2) -> subprocess.CompletedProcess:
    """`./run.sh` of TWO_RANKS on `ngpu` processes, stdout and stderr together."""
    return subprocess.run(["./run.sh", *merged(TWO_RANKS[1:], ["--job.run_dir", str(run_dir)], args)], cwd=REPO,
                          env={**env(), "NGPU": str(ngpu), "NSA_PYTHON": sys.executable}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def _stalled_rank(tmp_path: Path) -> list[str]:
    # Rank 1 sleeps in step 2, so neither rank can complete it: whichever watchdog fires first, it is after step 1.
    return ["--debug.fault_rank", "1", "--debug.sleep_at_step", "2", "--debug.sleep_s", "600",
            "--debug.hang_timeout_s", "3"]


# What ./run.sh on two processes exits with when a rank fails, and its one error line (torchrun alone: status 1, a
# traceback and a failure table; the failed rank's own line only if it is a LOG_RANK).
RUN_SH_FAILURES = [
    # Rank 0 reports the failed collective unless torchrun noticed the death first and stopped it: either line is
    # right, and either way the status is 5.
    (lambda _: ["--debug.fault_rank", "1", "--debug.die_at_step", "3"], 5,
     r"rank 1 was killed by SIGKILL without a word .*|rank 0: step 3: a collective failed \(.+\): another rank died, "
     r"or stalled .* \(rank 1 ended by SIGKILL\)"),
    (_stalled_rank, 3,
     r"rank ([01]) stalled: no step completed for \d+ s after step 1 \(debug.hang_timeout_s = 3\); stacks in "
     r"(.+/hang/rank\1.txt)"),
    (lambda _: ["--debug.nan_at_step", "2", "--debug.nan_steps", "100", "--training.max_skipped_steps", "2"], 4,
     r"step 3: loss or gradient norm not finite for 2 steps in a row .*"),
    (lambda tmp_path: _empty_file(tmp_path), 2, r"data.source: .*"),  # every rank finds it empty
]


@pytest.mark.parametrize("make_args, status, message", RUN_SH_FAILURES, ids=["dead", "stalled", "diverged", "input"])
def test_run_sh_ends_like_one_process_whichever_rank_failed(tmp_path, make_args, status, message):
    run_dir = tmp_path / "run"
    result = run_sh(run_dir, *make_args(tmp_path))
    assert result.returncode == status, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stdout[-3000:]
    match = re.fullmatch(f"error: {message}", errors[0])
    assert match, result.stdout[-3000:]
    if status == 3:
        assert Path(match[2]).is_file()
    assert "Traceback" not in result.stdout and "ChildFailedError" not in result.stdout, result.stdout[-3000:]
    assert processes_naming(run_dir) == []


@pytest.mark.parametrize("args, message", [
    (["--parallelism.data_parallel", "hsdp", "--parallelism.dp_replicate", "3"],
     "error: parallelism.dp_replicate = 3 must divide the world size (2): set it to the node count"),
    (["--training.global_batch_tokens", "512"],  # a valid batch for one process
     "error: training.global_batch_tokens = 512 is not a multiple of micro_batch_size x seq_len x data-parallel ranks "
     "= 1024: pick a multiple"),
])
def test_run_sh_rejects_a_plan_for_the_process_count_before_launch(tmp_path, args, message):
    result = run_sh(tmp_path / "run", *args)
    assert result.returncode == 2 and result.stdout == message + "\n", result.stdout[-3000:]
    assert not (tmp_path / "run").exists()  # no rank started


def test_no_worker_outlives_the_launcher_and_a_restart_resumes(tmp_path):
    """SIGKILL to the launcher's process group (a scheduler's hard kill) ends the workers too: they are in sessions of
    their own, which the signal misses. A restart in the same run_dir then resumes from a complete checkpoint."""
    run_dir = tmp_path / "run"
    args = ["--training.steps", "1000", "--checkpoint.interval", "2"]
    launcher = subprocess.Popen(["./run.sh", *merged(TWO_RANKS[1:], ["--job.run_dir", str(run_dir)], args)], cwd=REPO,
                                env={**env(), "NGPU": "2", "NSA_PYTHON": sys.executable}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in launcher.stdout:
        if line.startswith("[rank0]:step      4/"):  # the step-4 checkpoint is being written
            break
    assert len(processes_naming(run_dir)) == 3  # the launcher and its two workers
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60  # the kernel kills them at once; this only bounds a failure
    while processes_naming(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_naming(run_dir)
    for pid in left:  # do not leave them training if they outlived it
        os.kill(pid, signal.SIGKILL)
    assert left == []

    resumed = run_sh(run_dir, "--training.steps", "6", "--checkpoint.interval", "2")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    step = int(re.search(r"resumed from \S+/step-(\d+) at step", resumed.stdout)[1])
    assert step in (2, 4) and "done: 6 steps" in resumed.stdout, resumed.stdout[-3000:]


@pytest.mark.parametrize("stall_step, fails", [(1, False), (3, True)])
def test_collectives_wait_init_timeout_in_step_1_then_collective_timeout(tmp_path, stall_step, fails):
    """Rank 1 stalls 8 s in one step: step 1 (compilation, first collectives) waits up to debug.init_timeout_s;
    any later step fails after debug.collective_timeout_s."""
    run_dir = tmp_path / "run"
    status, output, _ = run_two_ranks(run_dir, "--debug.fault_rank", "1", "--debug.sleep_at_step", str(stall_step),
                                      "--debug.sleep_s", "8", "--debug.init_timeout_s", "60",
                                      "--debug.collective_timeout_s", "4")
    assert (status != 0) == fails, output[-3000:]
    rank0_errors = [line for line in output.splitlines() if line.startswith("error: rank 0:")]
    if fails:
        assert len(rank0_errors) == 1 and re.fullmatch(
            r"error: rank 0: step 3: a collective failed \(.*Timed out waiting 4000ms.*\): another rank died, or "
            r"stalled longer than debug.collective_timeout_s = 4 s; .*", rank0_errors[0]), output[-3000:]
    else:
        assert rank0_errors == [] and "done: 4 steps" in output, output[-3000:]
    assert processes_naming(run_dir) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_sh_signal_stops_every_rank_with_a_checkpoint_and_exits_128_plus_signal(tmp_path, signum):
    """torchrun alone would die with a traceback and status 1 (see run.sh)."""
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr"
    command = ["./run.sh", *merged(TWO_RANKS[1:], ["--training.steps", "30", "--job.run_dir", str(run_dir)])]
    with open(stderr, "w") as err:
        proc = subprocess.Popen(command, cwd=REPO, env={**env(), "NGPU": "2", "NSA_PYTHON": sys.executable},
                                stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            if line.startswith("[rank0]:step      4/30"):
                proc.send_signal(signum)
                break
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 128 + signum, stderr.read_text()[-3000:]
    match = re.search(rf"^\[rank0\]:stopped by {signum.name} at step (\d+); checkpoint (\S+); resume with the same "
                      "command$", rest, re.MULTILINE)
    assert match, rest
    assert Path(match[2]) == run_dir / "checkpoints" / f"step-{int(match[1]):08d}"
    assert Path(match[2], ".metadata").is_file()
    assert "Traceback" not in stderr.read_text()
    assert processes_naming(run_dir) == []


def test_out_of_memory_dumps_the_allocator_history_and_is_one_line(tmp_path, monkeypatch):
    """The CUDA allocator calls are replaced by recorders (no GPU here): what is tested is when and where the
    snapshots go, and the line and status of an out-of-memory error."""
    import torch

    from nsa_training.watchdog import MemorySnapshots, ReportFailures, RunFailed

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", calls.append)
    memory = MemorySnapshots(tmp_path, rank=1, device=torch.device("cuda", 1), dump_after_step=2)
    assert calls == [{"max_entries": MemorySnapshots.MAX_ENTRIES}] and MemorySnapshots.MAX_ENTRIES > 0
    failures = ReportFailures(rank=1, start_step=0, init_timeout_s=60, collective_timeout_s=5, memory=memory,
                              oom_advice="lower training.micro_batch_size (now 8)")
    with pytest.raises(RunFailed) as raised, failures:
        for step in (1, 2, 3):
            memory.after_step(step)
            failures.beat(step)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore details")
    oom = tmp_path / "memory" / "rank1_oom.pickle"
    assert calls[1:] == [str(tmp_path / "memory" / "rank1_step2.pickle"), str(oom)]
    assert oom.parent.is_dir()
    assert raised.value.exit_code == 6
    assert str(raised.value) == (
        f"rank 1: step 4: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.); allocator snapshot {oom} "
        "(open it at https://pytorch.org/memory_viz); lower training.micro_batch_size (now 8)")

    with pytest.raises(RunFailed, match=r"^rank 0: step 1: out of memory \(CUDA out of memory\.\); rerun with "
                                        r"--debug.memory_snapshot true for an allocator snapshot; advice$"):
        with ReportFailures(rank=0, start_step=0, init_timeout_s=60, collective_timeout_s=5, memory=None,
                            oom_advice="advice"):
            raise torch.OutOfMemoryError("CUDA out of memory.")


def oom_config(micro_batch_size=4, seq_len=256, mode="none", attention="nsa", backend="triton",
               window_backend="flex", data_parallel="fsdp"):
    from nsa_training.config import Config

    config = Config()
    config.training.micro_batch_size, config.data.seq_len = micro_batch_size, seq_len
    config.activation_checkpoint.mode, config.parallelism.data_parallel = mode, data_parallel
    config.model.attention, config.model.nsa.backend, config.model.nsa.window_backend = (attention, backend,
                                                                                         window_backend)
    return config


def test_out_of_memory_advice_names_only_what_the_run_can_still_change():
    """A run at micro_batch_size 1 with full checkpointing (262,144 tokens, the SDPA window) was told to lower the
    one and set the other; the advice names what this run does not already use, with its current value."""
    from nsa_training.watchdog import out_of_memory_advice

    advice = out_of_memory_advice(oom_config(micro_batch_size=1, seq_len=262_144, mode="full",
                                             window_backend="sdpa"), "cuda", 8)
    assert advice == ("set model.nsa.window_backend = 'flex' (now 'sdpa', which materialises a seq_len x seq_len "
                      "mask), shard over more GPUs (now 8), or lower data.seq_len (now 262144)")
    assert "micro_batch_size" not in advice and "activation_checkpoint" not in advice
    # Everything left to change: the reference backend on a GPU, ddp on one process.
    assert out_of_memory_advice(oom_config(backend="reference", data_parallel="ddp"), "cuda", 1) == (
        "lower training.micro_batch_size (now 4), set model.nsa.backend = 'triton' (now 'reference', which is memory "
        "hungry), set activation_checkpoint.mode = 'full' (now 'none'), or shard over more GPUs with "
        "parallelism.data_parallel = 'fsdp' (now 'ddp')")
    # ddp over several ranks: fsdp shards over these; checkpointing every n blocks is not yet 'full'.
    assert out_of_memory_advice(oom_config(mode="every_n", data_parallel="ddp"), "cuda", 4) == (
        "lower training.micro_batch_size (now 4), set activation_checkpoint.mode = 'full' (now 'every_n'), or set "
        "parallelism.data_parallel = 'fsdp' (now 'ddp') to shard over the 4 ranks, or more")
    # The reference backend is the only one on CPU; dense attention has no NSA backend; hsdp shards already.
    for config, device in [(oom_config(backend="reference"), "cpu"),
                           (oom_config(attention="dense", window_backend="sdpa"), "cuda")]:
        assert out_of_memory_advice(config, device, 1) == (
            "lower training.micro_batch_size (now 4), set activation_checkpoint.mode = 'full' (now 'none'), or "
            "shard over more GPUs (now 1)")
    assert out_of_memory_advice(oom_config(micro_batch_size=1, mode="full", data_parallel="hsdp"), "cuda", 16) == (
        "shard over more GPUs (now 16) or lower data.seq_len (now 256)")
    # nsa-125m at one sequence of 524,288 tokens on one H200 ran out of memory in CUDA graphs' private pools (the
    # trainer's `auto` mode resolved to reduce-overhead), and trained with compile.mode = 'default'.
    config = oom_config(micro_batch_size=1, seq_len=524_288, mode="full", data_parallel="ddp")
    config.compile.enable, config.compile.mode = True, "reduce-overhead"
    assert out_of_memory_advice(config, "cuda", 1) == (
        "shard over more GPUs with parallelism.data_parallel = 'fsdp' (now 'ddp'), set compile.mode = 'default' (now "
        "'reduce-overhead', whose CUDA graphs keep a memory pool of their own), or lower data.seq_len (now 524288)")


def test_only_collective_failures_and_out_of_memory_become_one_line():
    import torch.distributed as dist

    from nsa_training.watchdog import ReportFailures, RunFailed

    with pytest.raises(RunFailed, match=r"^rank 2: step 8: a collective failed \(Watchdog caught collective "
                                        r"operation timeout\): .* debug.init_timeout_s = 60 s;") as raised:
        with ReportFailures(rank=2, start_step=7, init_timeout_s=60, collective_timeout_s=5, memory=None,
                            oom_advice=""):
            raise dist.DistBackendError("Watchdog caught collective operation timeout")  # before any step is done
    assert raised.value.exit_code == 5
    with pytest.raises(ValueError, match="a bug"):  # anything else is a bug: its traceback stays
        with ReportFailures(rank=0, start_step=0, init_timeout_s=60, collective_timeout_s=5, memory=None,
                            oom_advice=""):
            raise ValueError("a bug")


def test_the_error_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun reads a rank's error file the moment the rank ends, and fails on one it cannot parse (a 2-rank run
    exited 1 instead of 5 when rank 0 was stopped mid-write): a rank stopped while writing leaves no file."""
    import json

    from nsa_training import watchdog

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # the process ends between opening the file and writing it

    monkeypatch.setattr(watchdog.json, "dump", stopped)
    with pytest.raises(KeyboardInterrupt):
        watchdog.report_error("rank 0: step 3: a collective failed", 5)
    assert not error_file.exists()
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    watchdog.report_error("rank 0: step 3: a collective failed", 5)
    assert json.loads(error_file.read_text())["exitcode"] == 5


def test_flight_recorder_settings_fill_in_only_what_the_user_left_unset(tmp_path, monkeypatch):
    from nsa_training.watchdog import enable_flight_recorder

    names = ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})
    prefix = tmp_path / "run" / "flight_recorder" / "rank"
    assert enable_flight_recorder(tmp_path / "run") == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(prefix)}
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(prefix) and prefix.parent.is_dir()  # torch does not create it

    # The user's settings, under the older names torch also reads, stay.
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace_"}
    monkeypatch.setattr(os, "environ", dict(user))
    assert enable_flight_recorder(tmp_path / "other") == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert os.environ == {**user, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert not (tmp_path / "other").exists()


def _empty_file(tmp_path: Path) -> list[str]:
    (tmp_path / "empty.jsonl").write_text("")
    return ["--data.source", str(tmp_path / "empty.jsonl")]


def _file_as_run_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "file").write_text("not a directory")
    return ["--job.run_dir", str(tmp_path / "file")]


def _wrong_text_field(tmp_path: Path) -> list[str]:
    (tmp_path / "docs.jsonl").write_text('{"content": "hello world"}\n' * 50)
    return ["--data.source", str(tmp_path / "docs.jsonl")]


def _folder_without_data(tmp_path: Path) -> list[str]:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.md").write_text("# not training data\n")
    return ["--data.source", str(tmp_path / "data")]


def _directory_as_recipe(tmp_path: Path) -> list[str]:
    (tmp_path / "recipe.toml").mkdir()
    return [str(tmp_path / "recipe.toml")]


# Kinds of malformed input not already covered by tests/test_config.py (41 recipe/override errors, 5 through
# train.py) and tests/test_train.py (6 runtime errors): each is one `error:` line and exit status 2.
BAD_RUNS = [
    (lambda _: ["--debug.hang_timeout_s", "-1"], "error: debug.hang_timeout_s = -1.0: must be >= 0"),
    (lambda _: ["--training.max_skipped_steps", "0"], "error: training.max_skipped_steps = 0: must be > 0"),
    (lambda _: ["--debug.nan_steps", "0"], "error: debug.nan_steps = 0: must be > 0"),
    (lambda _: ["--debug.sleep_s", "-5"], "error: debug.sleep_s = -5.0: must be >= 0"),
    (lambda _: ["--debug.collective_timeout_s", "0"], "error: debug.collective_timeout_s = 0.0: must be > 0"),
    (lambda _: ["--debug.fault_rank", "-2"], "error: debug.fault_rank = -2: must be >= -1"),
    (lambda _: ["--debug.memory_snapshot", "true"],
     "error: debug.memory_snapshot = true needs CUDA (device is cpu): run on a GPU or set --debug.memory_snapshot "
     "false"),
    (lambda _: ["--data.seq_len", "4096"], "error: data.seq_len = 4096 exceeds model.max_seq_len"),
    (_directory_as_recipe, "error: recipe '"),
    (_file_as_run_dir, "error: job.run_dir = "),
    (_empty_file, "error: data.source: "),
    (_wrong_text_field, "error: data.text_field: no column 'text'"),
    (_folder_without_data, "error: data.source: folder "),
]


@pytest.mark.parametrize("make_args, message", BAD_RUNS, ids=[m[7:40] for _, m in BAD_RUNS])
def test_malformed_input_is_one_line(tmp_path, make_args, message):
    argv = make_args(tmp_path)
    if argv[0].endswith(".toml"):  # a recipe of its own
        command = [sys.executable, "train.py", *argv]
    else:
        command = [sys.executable, "train.py", "recipes/debug.toml", *merged(["--job.run_dir", str(tmp_path / "run")],
                                                                             argv)]
    result = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr[-3000:]


@pytest.mark.parametrize("model_args, mismatch", [
    (["--model.dim", "64"], "Size mismatch between saved torch.Size([320, 128]) and current: torch.Size([320, 64])"),
    (["--model.n_layers", "3"], "only in the checkpoint: [], only in the model: ['layers.2."),
    # A smaller model would load partly and silently if only missing keys were checked.
    (["--model.n_layers", "1"], "only in the checkpoint: ['layers.1."),
    (["--model.flavor", "dense-debug"], "only in the checkpoint: ['layers.0.attention.compress_k."),
])
def test_checkpoint_of_another_model_is_one_line(tmp_path, clean_run, model_args, mismatch):
    checkpoint = clean_run["run_dir"] / "checkpoints" / "step-00000010"
    result = train(tmp_path / "run", "--checkpoint.load_path", str(checkpoint), *model_args)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: checkpoint.load_path: {checkpoint} does not fit this model ({mismatch}")
    assert lines[0].endswith("load a checkpoint saved with the same model.* settings, or start a new job.run_dir")
