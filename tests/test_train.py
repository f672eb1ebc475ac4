"""train.py / run.sh end to end: tensorboard tags, falling loss, bitwise resume after SIGKILL, clear errors."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nsa_models.args import FLAVORS
from nsa_training.config import ConfigError, load_config
from nsa_training.exit_codes import OOM_EXIT_CODE
from nsa_training.optim import lr_multiplier
from nsa_training.trainer import Trainer
from nsa_training.watchdog import ReportFailures, RunFailed
from tests.helpers import FAST, REPO, env, event_files, merged, scalars

TAGS = {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "perf/tokens_per_s", "perf/step_time_s",
        "perf/data_time_s", "memory/peak_rss_gib" if not torch.cuda.is_available() else "memory/max_allocated_gib"}


def test_run_sh_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(["./run.sh", "recipes/debug.toml", "--training.steps", "25", "--job.run_dir",
                             str(run_dir), *FAST], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     25/25" in result.stdout
    (events,) = event_files(run_dir)
    logged = scalars(events)
    assert TAGS <= set(logged), f"missing tags: {TAGS - set(logged)}"
    losses = logged["train/loss"]
    assert sorted(losses) == list(range(1, 26))
    assert sum(losses[s] for s in range(21, 26)) < sum(losses[s] for s in range(1, 6))
    assert (run_dir / "config.toml").is_file() and (run_dir / "model.pt").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000025"]


# On a GPU: the triton backend, compiled (CUDA graphs), with determinism asked for; without it a GPU run does not
# repeat itself bitwise (a 4-GPU run drifted from its twin by step 74), so neither would a resumed one.
GPU_DETERMINISTIC = ["--training.device", "cuda", "--model.nsa.backend", "triton", "--compile.enable", "true",
                     "--debug.deterministic", "true"]


@pytest.mark.parametrize("device_args", [[], pytest.param(GPU_DETERMINISTIC, marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda-deterministic"])
def test_resume_after_sigkill_is_bitwise_exact(tmp_path, device_args):
    common = [sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "20", "--checkpoint.interval",
              "5", *FAST, *device_args]
    run_a = tmp_path / "a"
    subprocess.run(common + ["--job.run_dir", str(run_a)], cwd=REPO, env=env(), check=True, capture_output=True,
                   timeout=600)

    run_b = tmp_path / "b"
    proc = subprocess.Popen(common + ["--job.run_dir", str(run_b)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step     12/20"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (run_b / "checkpoints" / "step-00000010").is_dir()
    resumed = subprocess.run(common + ["--job.run_dir", str(run_b)], cwd=REPO, env=env(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-00000010 at step 10" in resumed.stdout

    loss_a = scalars(event_files(run_a)[-1])["train/loss"]
    loss_b = scalars(event_files(run_b)[-1])["train/loss"]  # the resumed process's own events
    assert sorted(loss_b) == list(range(11, 21))
    assert [loss_b[s] for s in range(11, 21)] == [loss_a[s] for s in range(11, 21)]  # bitwise


@pytest.mark.parametrize("args,message", [
    pytest.param(["--training.device", "cuda"], "error: training.device = 'cuda' but no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["--data.source", "/nonexistent/corpus.jsonl"], "error: data.source"),
    (["--model.vocab_size", "100"], "error: model.vocab_size = 100 is smaller than the tokenizer's vocabulary (257"),
    (["--training.global_batch_tokens", "768", "--training.micro_batch_size", "2", "--data.seq_len", "256"],
     "error: training.global_batch_tokens"),
    pytest.param(["--model.nsa.backend", "triton"],
                 "error: model.nsa.backend = 'triton' needs a CUDA GPU (device is cpu)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["--checkpoint.load_path", "/nonexistent/step-00000010"], "error: checkpoint.load_path"),
])
def test_runtime_errors_are_one_line(tmp_path, args, message):
    result = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--job.run_dir",
                             str(tmp_path / "run"), *args], cwd=REPO, env=env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr[-2000:]
    assert not (tmp_path / "run" / "config.toml").exists()  # a start that fails writes nothing into the run


def run_train(run_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--job.run_dir", str(run_dir),
                           *merged(FAST, ["--checkpoint.interval", "3", "--training.eval_interval", "0"], args)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)


def logged_once(run_dir) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as tensorboard reads the whole run (every event file, purges applied); fails on a step
    logged twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        steps = [(e.step, e.value) for e in events.Scalars(tag)]
        assert len({step for step, _ in steps}) == len(steps), f"{tag}: a step logged twice: {steps}"
        out[tag] = dict(steps)
    return out


def test_resume_after_a_crash_logs_each_step_once_and_applies_changed_settings(tmp_path):
    """A run of 6 steps loses its last checkpoint (as a crash between logging step 6 and saving it would) and is
    resumed from step 3 with a new LR and length: tensorboard holds steps 4-6 once, the resumed steps train at the
    new LR with the schedule of the new length, config.toml says what ran; a resume with a changed model is refused
    without touching the run. Also: the logged LR is the one each step used, and the vocabulary follows the
    tokenizer."""
    run_dir = tmp_path / "run"
    first = run_train(run_dir, "--training.steps", "6", "--model.vocab_size", "0")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "vocab_size = 320\n" in (run_dir / "config.toml").read_text()  # the byte tokenizer's 257, rounded up
    schedule = load_config(["recipes/debug.toml", *FAST])[0].lr_scheduler
    lr = logged_once(run_dir)["train/lr"]
    assert lr == {s: pytest.approx(2e-3 * lr_multiplier(s - 1, schedule, 6)) for s in range(1, 7)}
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")

    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    refused = run_train(run_dir, "--training.steps", "6", "--model.vocab_size", "0", "--model.n_layers", "3")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [f"error: model.n_layers = 3 differs from the 2 this run was trained with "
                                           f"({run_dir / 'config.toml'}): set it back to resume, or start a new "
                                           "job.run_dir"]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing in the run touched

    resumed = run_train(run_dir, "--training.steps", "8", "--model.vocab_size", "0", "--optimizer.lr", "1e-3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from {run_dir / 'checkpoints' / 'step-00000003'} at step 3; changed since, applied: "
            "training.steps 6 -> 8, optimizer.lr 0.002 -> 0.001; the LR of step 4 is ") in resumed.stdout
    logged = logged_once(run_dir)
    assert sorted(logged["train/loss"]) == list(range(1, 9))
    assert logged["train/lr"] == {**{s: lr[s] for s in range(1, 4)},
                                  **{s: pytest.approx(1e-3 * lr_multiplier(s - 1, schedule, 8)) for s in range(4, 9)}}
    saved = load_config([str(run_dir / "config.toml")])[0]
    assert (saved.optimizer.lr, saved.training.steps, saved.model.vocab_size) == (1e-3, 8, 320)


def test_vocab_size_follows_the_tokenizer():
    """model.vocab_size = 0 is the tokenizer's vocabulary rounded up to 64; a set value stays, if large enough."""
    def resolve(vocab_size: int, tokenizer_vocab: int) -> int:
        plan = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(vocab_size=vocab_size),
                                                      data=SimpleNamespace(tokenizer="tokenizer.json")))
        Trainer._resolve_vocab_size(plan, tokenizer_vocab)
        return plan.config.model.vocab_size

    assert (resolve(0, 50257), resolve(0, 257), resolve(0, 320), resolve(264, 257)) == (50304, 320, 320, 264)
    with pytest.raises(ConfigError, match="model.vocab_size = 256 is smaller than the tokenizer's vocabulary"):
        resolve(256, 257)


# Byte-level by design: the CPU default and the retrieval demo (a small model; the vocabulary follows the bytes).
BYTE_LEVEL_RECIPES = ("debug.toml", "retrieval_nsa.toml")


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.toml")))
def test_gpu_recipes_size_the_vocabulary_by_a_subword_tokenizer(recipe):
    """No recipe pairs the 257 byte ids with a GPT-2-sized embedding: the vocabulary follows the tokenizer, a
    subword one but in the byte-level recipes."""
    config = load_config([str(REPO / "recipes" / recipe)])[0]
    if recipe in BYTE_LEVEL_RECIPES:  # about the 257 byte ids (0: they, rounded up to 320), not GPT-2's 50304
        assert config.data.tokenizer == "byte" and config.model.vocab_size <= 320
    else:
        assert config.model.vocab_size == 0 and config.data.tokenizer.endswith(".json")
        assert FLAVORS[config.model.flavor].vocab_size == 0


@pytest.mark.parametrize("args, advice", [
    (("--data.seq_len", "4096", "--training.micro_batch_size", "1024"),
     "lower training.micro_batch_size (now 1024), set activation_checkpoint.mode = 'full' (now 'none'), or shard "
     "over more GPUs (now 1)"),
    # Already at one sequence per micro-batch, checkpointing every block: only the sharding and seq_len are left.
    (("--data.seq_len", "262144", "--model.max_seq_len", "262144", "--training.micro_batch_size", "1",
      "--activation_checkpoint.mode", "full", "--parallelism.data_parallel", "ddp"),
     "shard over more GPUs with parallelism.data_parallel = 'fsdp' (now 'ddp') or lower data.seq_len (now 262144)"),
])
def test_a_run_that_cannot_fit_says_so_before_it_starts(tmp_path, args, advice):
    """nsa-1b at these sizes needs terabytes: one line, the out-of-memory status, advice that fits the run, and no
    run directory, instead of the kernel's out-of-memory killer ending it without a word."""
    run_dir = tmp_path / "run"
    flags = dict(zip(args[::2], args[1::2]))
    micro_batch, seq_len = flags["--training.micro_batch_size"], flags["--data.seq_len"]
    result = run_train(run_dir, "--model.flavor", "nsa-1b", *args, "--training.global_batch_tokens",
                       str(int(micro_batch) * int(seq_len)), "--training.device", "cpu")
    assert result.returncode == OOM_EXIT_CODE
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: out of memory before the start: nsa-1b at {micro_batch} x {seq_len} tokens per "
                           "micro-batch needs about ") and line.endswith(f" GiB free; {advice}")
    assert not (run_dir / "config.toml").exists()


@pytest.mark.parametrize("sizes, status, says", [
    (("--model.dim", str(10**11)), 2, "cannot be built with these sizes"),  # no storage can hold its tensors
    (("--model.max_seq_len", str(10**11)), OOM_EXIT_CODE, "out of memory before the start"),  # the RoPE table
    (("--model.n_layers", str(10**5)), OOM_EXIT_CODE, "out of memory before the start"),  # counted, not built
])
def test_model_sizes_beyond_the_machine_are_one_line(tmp_path, sizes, status, says):
    result = run_train(tmp_path / "run", *sizes, "--training.device", "cpu")
    assert result.returncode == status
    (line,) = result.stderr.splitlines()[-1:]
    assert line.startswith("error: ") and says in line and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_cpu_out_of_memory_is_one_line_and_its_exit_status():
    """An allocation that the CPU allocator refuses is reported as out of memory (status 6), not a traceback."""
    with pytest.raises(RunFailed) as failure, ReportFailures(0, 0, 60.0, 60.0, None, "advice"):
        torch.empty(2**62, dtype=torch.uint8)
    assert failure.value.exit_code == OOM_EXIT_CODE and "out of memory (" in str(failure.value)


def test_print_config_round_trips(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--print-config",
                             "--model.nsa.window_size=48"], cwd=REPO, env=env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    saved = tmp_path / "resolved.toml"
    saved.write_text(result.stdout)
    sys.path.insert(0, str(REPO))
    from nsa_training.config import load_config

    config, _ = load_config([str(saved)])
    assert config.model.nsa.window_size == 48


@pytest.mark.gpu
def test_cuda_graphs_capture_every_graph_and_train_as_default(tmp_path):
    """compile.mode = 'reduce-overhead' (two micro-batches per step, evaluation between steps, the triton backend):
    no compiled graph is left uncaptured or recorded again after warm-up, and the losses are the default mode's."""
    logged = {}
    for mode in ("default", "reduce-overhead"):
        run_dir = tmp_path / mode
        result = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "10",
                                 "--job.run_dir", str(run_dir),
                                 *merged(FAST, ["--training.global_batch_tokens", "1024"]),
                                 "--training.device", "cuda", "--compile.enable", "true", "--compile.mode", mode,
                                 "--model.nsa.backend", "triton", "--data.source", "synthetic"],
                                cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "warning:" not in result.stdout  # no recompile, no graph recorded again (evaluations included)
        (events,) = event_files(run_dir)
        logged[mode] = scalars(events)
    assert logged["reduce-overhead"]["compile/cudagraph_skips"] == {2: 0}
    for tag in ("train/loss", "eval/loss"):
        want, got = logged["default"][tag], logged["reduce-overhead"][tag]
        assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in want), tag


def test_a_recompile_after_warm_up_is_one_warning(tmp_path, monkeypatch, capsys):
    """Compiled on the CPU: evaluations after step 2 (their no_grad graphs) warn of nothing; a batch of another
    length at step 4 recompiles the blocks and the loss, which the trainer reports in one warning line naming the
    step and the counters' rise, and logs as compile/graphs_compiled at that step."""
    import train

    next_batch = Trainer._next_batch

    def shorter_from_step_4(self, loader):
        inputs, labels, doc_start = next_batch(self, loader)
        if loader is self.train_loader and self.step >= 4:
            return inputs[:, :64], labels[:, :64], doc_start
        return inputs, labels, doc_start

    monkeypatch.setattr(Trainer, "_next_batch", shorter_from_step_4)
    argv = merged(["recipes/debug.toml", "--job.run_dir", str(tmp_path / "run"), "--data.source", "synthetic",
                   "--training.steps", "5", "--compile.enable", "true", "--checkpoint.enable", "false"], FAST,
                  ["--training.eval_interval", "1"])
    assert train.main(argv) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 4 compiled again after warm-up "
                                                         "(graphs_compiled "), warnings
    logged = scalars(event_files(tmp_path / "run")[-1])["compile/graphs_compiled"]
    assert sorted(logged) == [2, 4] and logged[4] > logged[2]


# Runs train.main in a process of its own with sync debug mode "error" from step 3 until the run's end (which may
# wait: the weights' export).
SYNC_CHECKED_RUN = """import sys
import torch
import train
from nsa_training.trainer import Trainer

gradients, finish = Trainer._gradients, Trainer._finish


def checked_gradients(self):
    if self.step == 3:
        torch.cuda.set_sync_debug_mode("error")
    return gradients(self)


def unchecked_finish(self):
    torch.cuda.set_sync_debug_mode("default")
    return finish(self)


Trainer._gradients, Trainer._finish = checked_gradients, unchecked_finish
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.gpu
def test_steady_steps_make_no_synchronizing_cuda_call(tmp_path):
    """From the third step on, a step only queues its work and reads the previous step's outcome behind an event
    (`nsa_training.outcome`): no `.item()` and no blocking copy, which `torch.cuda.set_sync_debug_mode("error")`
    turns into an error. A log line every step, two micro-batches, and a skipped step (its update dropped on the
    device) still come as before. (The CPU tests check what a skipped step does to the LR schedule and checkpoints.)"""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", SYNC_CHECKED_RUN, "recipes/debug.toml", "--job.run_dir",
                             str(run_dir), "--training.steps", "8",
                             *merged(FAST, ["--training.global_batch_tokens", "1024", "--training.eval_interval", "0"]),
                             "--training.device", "cuda", "--model.nsa.backend", "triton", "--compile.enable", "true",
                             "--compile.mode", "default", "--data.source", "synthetic", "--checkpoint.enable", "false",
                             "--debug.nan_at_step", "5"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = scalars(event_files(run_dir)[-1])
    assert sorted(logged["train/loss"]) == list(range(1, 9))
    assert [logged["train/skipped_steps"][s] for s in (4, 5, 8)] == [0, 1, 1]
