"""scripts/export.py and scripts/import_hf.py: a run as a transformers model (safetensors, trust_remote_code) and back.

The exported model must compute exactly the repo's model (logits, greedy tokens), and export -> import -> export
must give the same bytes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nsa_models.args import get_flavor
from nsa_models.model import Transformer
from nsa_training import hf_export
from nsa_training.config import load_config
from nsa_training.inference import load_run
from nsa_training.tokenizer import ByteTokenizer, build_tokenizer
from nsa_training.trainer import Trainer
from tests.helpers import env

ROOT = Path(__file__).resolve().parents[1]
# The debug recipe at 4 sequences of 128 tokens a step, no evaluation: seconds per run.
TRAIN_ARGS = ["recipes/debug.toml", "--data.seq_len", "128", "--training.global_batch_tokens", "512",
              "--training.micro_batch_size", "4", "--training.eval_interval", "0", "--lr_scheduler.warmup_steps", "1",
              "--training.steps", "3", "--checkpoint.interval", "2"]


def _script(name: str):
    """scripts/<name>.py as a module: its main() runs in this process (no second torch import)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_script, import_script = _script("export"), _script("import_hf")


def _error_line(capsys) -> str:
    """The one `error:` line the last call wrote to stderr."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def _load(export_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A debug run trained for 3 steps, with checkpoints at steps 2 and 3."""
    path = tmp_path_factory.mktemp("export") / "run"
    done = subprocess.run([sys.executable, "train.py", *TRAIN_ARGS, "--job.run_dir", str(path)], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def export_dir(run_dir) -> Path:
    out = run_dir.parent / "export"
    assert export_script.main([str(run_dir), "--out", str(out)]) == 0
    return out


def test_trained_debug_logits_equal_the_repo_model(run_dir, export_dir):
    model, _, _, path = load_run(run_dir, torch.device("cpu"))
    assert path.name == "step-00000003"
    tokens = torch.randint(0, 257, (2, 160), generator=torch.Generator().manual_seed(0))  # > window, many blocks
    with torch.no_grad():
        expected, got = model(tokens), _load(export_dir)(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_nsa_125m_at_init_logits_equal_the_repo_model(tmp_path):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(get_flavor("nsa-125m"), vocab_size=320))  # the byte tokenizer's
    model.init_weights()
    hf_export.export_model(model.eval(), "byte", tmp_path, torch.float32)
    # 64 tokens: 3 compressed blocks, one selection block, the window; the reference backend gathers n x l' = 1024
    # keys per query whatever the length, so a longer sequence costs seconds per forward.
    tokens = torch.randint(0, 257, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(tokens), _load(tmp_path)(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_greedy_generate_equals_generate_py(run_dir, export_dir):
    model, *_ = load_run(run_dir, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(export_dir, trust_remote_code=True)
    prompt = "def main(\n    é = '€'"
    ids = tokenizer(prompt)["input_ids"]
    assert ids == ByteTokenizer().encode(prompt) and tokenizer.eos_token_id == ByteTokenizer.eos_id
    expected = _script("generate").generate(model, ids, 20, temperature=0, eos_id=ByteTokenizer.eos_id)
    exported = _load(export_dir)
    # Through the key/value cache: the prompt in one forward, then one cached step per new token but the last.
    modeling = sys.modules[type(exported).__module__]
    steps = []
    decode_step = modeling.decode_step
    modeling.decode_step = lambda *args: steps.append(1) or decode_step(*args)
    try:
        got = exported.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
        assert got[0].tolist() == expected and len(expected) == len(ids) + 20 and len(steps) == 19
        # A prompt that fills the context (debug: 256 positions): past it the window slides, as generate.py's does.
        long_ids = ByteTokenizer().encode("x = 1\n" * 41)[:250]
        expected = _script("generate").generate(model, long_ids, 12, temperature=0, eos_id=ByteTokenizer.eos_id)
        got = exported.generate(torch.tensor([long_ids]), max_new_tokens=12, do_sample=False)
        assert got[0].tolist() == expected
    finally:
        modeling.decode_step = decode_step


def test_export_import_export_is_byte_identical_and_resumes(run_dir, export_dir, tmp_path):
    imported = tmp_path / "imported"
    assert import_script.main([str(export_dir), "--run-dir", str(imported), *TRAIN_ARGS]) == 0
    again = tmp_path / "again"
    assert export_script.main([str(imported), "--out", str(again)]) == 0
    names = sorted(p.name for p in export_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (export_dir / name).read_bytes() == (again / name).read_bytes(), name
    # What `./run.sh RECIPE ... --job.run_dir imported` does first: resume the step-0 checkpoint with these weights.
    config, _ = load_config([*TRAIN_ARGS, "--job.run_dir", str(imported)])
    trainer = Trainer(config)
    try:
        assert trainer.step == 0
        weights = load_file(str(export_dir / hf_export.WEIGHTS))
        for name, tensor in trainer.model.state_dict().items():
            assert torch.equal(tensor, weights[f"model.{name}"]), name
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()


def test_bf16_export(run_dir, export_dir, tmp_path):
    assert export_script.main([str(run_dir), "--out", str(tmp_path), "--dtype", "bf16"]) == 0
    assert {t.dtype for t in load_file(str(tmp_path / hf_export.WEIGHTS)).values()} == {torch.bfloat16}
    model = _load(tmp_path)
    assert model.dtype == torch.bfloat16
    tokens = torch.randint(0, 257, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits.float(), _load(export_dir)(tokens).logits, rtol=0, atol=0.1)


def test_step_picks_the_checkpoint(run_dir, export_dir, tmp_path):
    assert export_script.main([str(run_dir), "--out", str(tmp_path), "--step", "2"]) == 0
    model, _, _, path = load_run(run_dir, torch.device("cpu"), step=2)
    assert path.name == "step-00000002"
    weights, newest = load_file(str(tmp_path / hf_export.WEIGHTS)), load_file(str(export_dir / hf_export.WEIGHTS))
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[f"model.{name}"], tensor), name
    assert not torch.equal(weights["model.output.weight"], newest["model.output.weight"])  # step 3 trained on


def test_run_dir_without_weights_is_one_error_line(tmp_path, capsys):
    (tmp_path / "config.toml").write_text((ROOT / "recipes" / "debug.toml").read_text())
    assert export_script.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in _error_line(capsys)
    assert export_script.main([str(tmp_path), "--out", str(tmp_path / "out"), "--step", "7"]) == 2
    assert "no checkpoint of that step" in _error_line(capsys)


def test_unknown_dtype_is_one_error_line(run_dir, capsys):
    assert export_script.main([str(run_dir), "--out", str(run_dir.parent / "fp16"), "--dtype", "fp16"]) == 2
    assert "--dtype 'fp16'" in _error_line(capsys)


@pytest.mark.parametrize("case", ["missing", "too_old"])
def test_without_a_usable_transformers_is_one_error_line(run_dir, tmp_path, monkeypatch, capsys, case):
    monkeypatch.delitem(sys.modules, "nsa_models.hf_modeling")  # imported again: its version check runs again
    if case == "missing":
        monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    else:
        monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    assert export_script.main([str(run_dir), "--out", str(tmp_path / "out")]) == 2
    assert "pip install -e '.[hf]'" in _error_line(capsys)
    assert import_script.main([str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "pip install -e '.[hf]'" in line and ("too old" in line) == (case == "too_old")
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_bad_import_is_one_error_line(run_dir, export_dir, tmp_path, capsys):
    assert import_script.main([str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    assert "is not an export" in _error_line(capsys)
    assert import_script.main([str(export_dir), "--run-dir", str(run_dir)]) == 2  # a run with checkpoints
    assert "already holds checkpoints" in _error_line(capsys)


@pytest.mark.parametrize("flavor, tied", [("debug", True), ("dense-debug", False)])
def test_tied_and_dense_models_export(tmp_path, flavor, tied):
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(get_flavor(flavor), tie_embeddings=tied))
    model.init_weights()
    hf_export.export_model(model.eval(), "byte", tmp_path)
    exported = _load(tmp_path)
    assert (exported.model.output.weight is exported.model.tok_embeddings.weight) == tied  # still one tensor
    tokens = torch.randint(0, 257, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), rtol=0, atol=1e-5)


def test_a_tokenizers_file_travels_with_the_model(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["def main(): return 0", "import sys\n"] * 50, trainer)
    spec = tmp_path / "bpe.json"
    bpe.save(str(spec))
    model = Transformer(dataclasses.replace(get_flavor("debug"), vocab_size=320))
    model.init_weights()
    export_dir = tmp_path / "export"
    hf_export.export_model(model, str(spec), export_dir)
    assert (export_dir / "tokenizer.json").read_bytes() == spec.read_bytes()
    tokenizer, ours = AutoTokenizer.from_pretrained(export_dir, trust_remote_code=True), build_tokenizer(str(spec))
    assert tokenizer("def sys(): é")["input_ids"] == ours.encode("def sys(): é")
    assert tokenizer.eos_token_id == ours.eos_id == 1
    # Imported, the run reads the tokenizer from its own directory; exported again, the same files.
    run_dir = tmp_path / "run"
    assert import_script.main([str(export_dir), "--run-dir", str(run_dir), *TRAIN_ARGS]) == 0
    config, _ = load_config([str(run_dir / "config.toml")])
    assert config.data.tokenizer == str((run_dir / "tokenizer.json").resolve())
    assert export_script.main([str(run_dir), "--out", str(tmp_path / "again")]) == 0
    for path in export_dir.iterdir():
        assert path.read_bytes() == (tmp_path / "again" / path.name).read_bytes(), path.name
