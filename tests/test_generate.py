"""scripts/generate.py: samples from a run's latest checkpoint, checked against a plain argmax loop."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_models import get_flavor
from nsa_models.model import Transformer
from nsa_training.config import load_config
from nsa_training.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "generate.py"


def _generate_module():
    spec = importlib.util.spec_from_file_location("generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A debug run of 4 steps with checkpoints at steps 2 and 4 and the final weights in model.pt."""
    path = tmp_path_factory.mktemp("generate") / "run"
    done = _run("train.py", "recipes/debug.toml", "--training.steps", "4", "--training.eval_interval", "0",
                "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "1", "--job.run_dir", str(path))
    assert done.returncode == 0, done.stderr
    return path


def test_greedy_equals_an_argmax_loop_over_full_forwards(run_dir):
    prompts = ["def main(", "The "]
    done = _run(str(SCRIPT), str(run_dir), "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu",
                *[arg for p in prompts for arg in ("--prompt", p)])
    assert done.returncode == 0, done.stderr
    assert "step-00000004" in done.stderr  # the latest checkpoint, not step 2

    config, _ = load_config([str(run_dir / "config.toml")])
    model = Transformer(config.model)
    model.load_state_dict(torch.load(run_dir / "model.pt"))  # the run's final weights, written apart from DCP
    tokenizer = build_tokenizer(config.data.tokenizer)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            n = len(ids)
            while len(ids) < n + 12 and (len(ids) == n or ids[-1] != tokenizer.eos_id):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            expected.append(prompt + tokenizer.decode(ids[n:]))
    assert done.stdout.splitlines() == expected


def test_top_k_samples_only_the_k_most_likely():
    next_token = _generate_module().next_token
    logits = torch.tensor([0.0, 5.0, 3.0, 4.0, -1.0])
    generator = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, 1.0, 2, generator) for _ in range(200)}
    assert drawn == {1, 3}
    assert {next_token(logits, 1.0, 0, generator) for _ in range(400)} >= {0, 1, 2, 3}
    assert next_token(logits, 0.0, 0, generator) == 1


def test_same_seed_same_text(run_dir):
    args = (str(SCRIPT), str(run_dir), "--prompt", "import ", "--max-new-tokens", "16", "--device", "cpu")
    first, again = _run(*args, "--seed", "3"), _run(*args, "--seed", "3")
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout


@pytest.mark.parametrize("case", ["no_run_dir", "no_checkpoint"])
def test_bad_run_dir_is_one_error_line(tmp_path, case):
    run_dir = tmp_path / "run"
    if case == "no_checkpoint":
        run_dir.mkdir()
        (run_dir / "config.toml").write_text((ROOT / "recipes" / "debug.toml").read_text())
    done = _run(str(SCRIPT), str(run_dir), "--prompt", "x", "--device", "cpu")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: RUN_DIR"), done.stderr


def test_no_cache_prints_the_same_text(run_dir):
    args = (str(SCRIPT), str(run_dir), "--prompt", "def ", "--max-new-tokens", "24", "--device", "cpu", "--seed", "5")
    cached, recomputed = _run(*args), _run(*args, "--no-cache")
    assert cached.returncode == 0 and recomputed.returncode == 0, cached.stderr + recomputed.stderr
    assert cached.stdout == recomputed.stdout


def test_empty_prompt_starts_from_end_of_text(run_dir):
    """An empty prompt used to end in a traceback (a float tensor of no ids); it now starts a document, as after the
    end-of-text token that precedes every training document, and prints only the generated text."""
    done = _run(str(SCRIPT), str(run_dir), "--prompt", "", "--max-new-tokens", "8", "--temperature", "0",
                "--device", "cpu")
    assert done.returncode == 0, done.stderr
    config, _ = load_config([str(run_dir / "config.toml")])
    model = Transformer(config.model)
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    tokenizer = build_tokenizer(config.data.tokenizer)
    out = _generate_module().generate(model.eval(), [tokenizer.eos_id], 8, temperature=0, eos_id=tokenizer.eos_id)
    assert done.stdout == tokenizer.decode(out[1:]) + "\n"


def test_long_generations_show_progress(monkeypatch, capsys):
    module = _generate_module()
    monkeypatch.setattr(module, "PROGRESS_MIN_TOKENS", 5)
    args = get_flavor("debug")
    args.max_seq_len = 16
    model = Transformer(args)
    model.init_weights()
    assert len(module.generate(model.eval(), [1, 2], 5, temperature=0)) == 7
    assert "tokens" in capsys.readouterr().err
    module.generate(model, [1, 2], 4, temperature=0)
    assert capsys.readouterr().err == ""
