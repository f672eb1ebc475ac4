"""train.py / run.sh end to end: tensorboard tags, falling loss, bitwise resume after SIGKILL, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_training.config import ConfigError
from nsa_training.trainer import Trainer, _importable
from tests.conftest import needs_flash_attn_4

REPO = Path(__file__).resolve().parents[1]
# Small steps: 4 sequences of 128 tokens of the debug model.
FAST = ["--data.seq_len", "128", "--training.global_batch_tokens", "512", "--training.micro_batch_size", "4",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--training.eval_interval", "5",
        "--training.eval_batches", "1"]
TAGS = {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "perf/tokens_per_s", "perf/step_time_s",
        "perf/data_time_s", "memory/max_allocated_gib"}


def env() -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "NGPU": "1"}


def scalars(event_file: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of one tensorboard event file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict[str, dict[int, float]] = {}
    for event in EventFileLoader(str(event_file)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "scalars":  # the loader yields scalars as tensors
                out.setdefault(value.tag, {})[event.step] = value.tensor.float_val[0]
    return out


def event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)


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


def test_resume_after_sigkill_is_bitwise_exact(tmp_path):
    common = [sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "20", "--checkpoint.interval",
              "5", *FAST]
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


def test_importable_checks_submodules_without_failing_on_a_missing_parent():
    """The window-package check: a dotted module whose parent package is missing reads as not installed."""
    assert _importable("json.decoder")
    assert not _importable("json.no_such_module")
    assert not _importable("no_such_package.cute")


def fa4_plan(key: str, compute_dtype: torch.dtype) -> SimpleNamespace:
    """What `Trainer._check_nsa_backend` reads of a CUDA run whose model.nsa.<key> is 'flash_attn_4'."""
    nsa = NSAArgs(backend="triton", **{key: "flash_attn_4"})
    return SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(attention="nsa", nsa=nsa)),
                           device=torch.device("cuda"), compute_dtype=compute_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("key,instead", [("window_backend", "'flex'"), ("cmp_backend", "'triton'")])
def test_flash_attn_4_needs_bf16_compute(key: str, instead: str):
    """FA4 takes bf16 only: an fp32 plan is a one-line config error before anything is built."""
    needs_flash_attn_4()
    from nsa_models.nsa.core import BACKENDS

    with pytest.raises(ConfigError, match=f"{key} = 'flash_attn_4' runs bf16 only.* or {key} = {instead}"):
        Trainer._check_nsa_backend(fa4_plan(key, torch.float32), BACKENDS)
    Trainer._check_nsa_backend(fa4_plan(key, torch.bfloat16), BACKENDS)


def test_a_missing_library_is_one_line_naming_the_key(monkeypatch):
    """A library backend whose package is not installed: a config error naming the key, the package and the
    built-in choices (before anything is built)."""
    from nsa_training import trainer as train

    monkeypatch.setattr(train, "_importable", lambda name: False)
    for key, message in [("window_backend", "model.nsa.window_backend = 'flash_attn_4' needs the flash-attn-4 "
                                            "package (pip install flash-attn-4); or set it to 'flex' or 'sdpa'"),
                         ("cmp_backend", "model.nsa.cmp_backend = 'flash_attn_4' needs the flash-attn-4 package "
                                         "(pip install flash-attn-4); or set it to 'triton'")]:
        with pytest.raises(ConfigError) as error:
            Trainer._check_nsa_backend(fa4_plan(key, torch.bfloat16), {"triton": None})
        assert str(error.value) == message


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
    no compiled graph is left uncaptured, and the losses are the default mode's."""
    logged = {}
    for mode in ("default", "reduce-overhead"):
        run_dir = tmp_path / mode
        result = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "10",
                                 "--job.run_dir", str(run_dir), *FAST, "--training.global_batch_tokens", "1024",
                                 "--training.device", "cuda", "--compile.enable", "true", "--compile.mode", mode,
                                 "--model.nsa.backend", "triton"],
                                cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        (events,) = event_files(run_dir)
        logged[mode] = scalars(events)
    assert logged["reduce-overhead"]["compile/cudagraph_skips"] == {2: 0}
    for tag in ("train/loss", "eval/loss"):
        want, got = logged["default"][tag], logged["reduce-overhead"][tag]
        assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in want), tag
