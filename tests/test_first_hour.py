"""A newcomer's first hour: the corpus script writes what the trainer reads, a run ends with a summary and an eval
loss, the vocabulary follows the tokenizer, kernel keys the backend ignores are refused, a CPU run logs honest
metrics, a key given twice or a log rank no process has is one error line, and recipes, README and exit codes say
what the code does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from nsa_models.args import NSAArgs, get_flavor
from nsa_training import exit_codes
from nsa_training.config import ConfigError, TrainingConfig, load_config
from nsa_training.documents import EMBEDDED_CORPUS
from nsa_training.launch import check_world_size
from nsa_training.metrics import memory_scalars
from nsa_training.trainer import Trainer, attention_line, evaluates_at
from tests.helpers import REPO, env, event_files, scalars

RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.toml"))


# (a) ------------------------------------------------------------------------------------------------------------

def test_build_corpus_writes_the_corpus_the_trainer_reads():
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "scripts" / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUTPUT == EMBEDDED_CORPUS and EMBEDDED_CORPUS.is_file()


# (b) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps, interval, evaluated", [
    (20, 50, [20]),  # a run shorter than the interval still ends with an eval loss
    (100, 50, [50, 100]),
    (120, 50, [50, 100, 120]),
    (20, 0, []),  # 0: never
])
def test_a_run_evaluates_at_every_interval_and_at_its_last_step(steps, interval, evaluated):
    cfg = TrainingConfig(steps=steps, eval_interval=interval)
    assert [step for step in range(1, steps + 1) if evaluates_at(step, cfg)] == evaluated


def summary_of(**settings) -> list[str]:
    """Trainer._summary's lines for a finished 20-step run of 512-token steps in 4 s, with `settings` changed."""
    config = load_config(["recipes/debug.toml", "--job.run_dir", "runs/x", "--training.global_batch_tokens", "512"])[0]
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    plan = SimpleNamespace(config=config, run_dir=Path("runs/x"), step=20, first_step=11, last_train_loss=2.5,
                           last_eval=(20, 2.75),
                           _latest_checkpoint=lambda: "runs/x/checkpoints/step-00000020")
    return Trainer._summary(plan, 4.0).splitlines()


def test_the_end_of_a_run_is_a_summary():
    """Losses, the tokens this start trained (steps 11-20 of a resumed run) and how fast, and where things are."""
    assert summary_of() == ["done: 20 steps; run_dir runs/x",
                            "  final train loss 2.5000, eval loss 2.7500 (step 20)",
                            "  5,120 tokens in 4.0 s (1,280 tokens/s)",
                            "  checkpoint runs/x/checkpoints/step-00000020",
                            "  weights runs/x/model.pt",
                            "  tensorboard runs/x/tb"]
    quiet = summary_of(**{"checkpoint.enable": False, "checkpoint.export_weights": False, "metrics.tensorboard": False})
    assert quiet[3:] == ["  checkpoint off (checkpoint.enable)", "  tensorboard off (metrics.tensorboard)"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, dict[int, float]]]:
    """3 small steps of the default recipe with its own training.eval_interval (50): the output and scalars."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "recipes/debug.toml", "--job.run_dir", str(run_dir), "--training.steps", "3",
         "--data.seq_len", "128", "--training.global_batch_tokens", "512", "--training.micro_batch_size", "4",
         "--lr_scheduler.warmup_steps", "1", "--training.eval_batches", "1"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, scalars(event_files(run_dir)[-1])


def test_a_short_run_logs_an_eval_loss_and_ends_with_the_summary(short_run):
    result, logged = short_run
    assert sorted(logged["eval/loss"]) == [3]
    summary = result.stdout[result.stdout.index("done: 3 steps"):].splitlines()
    assert summary[1].startswith("  final train loss ") and ", eval loss " in summary[1] and "(step 3)" in summary[1]
    assert re.fullmatch(r"  1,536 tokens in [\d.]+ s \([\d,]+ tokens/s\)", summary[2])
    assert summary[3].endswith("checkpoints/step-00000003") and summary[-1].endswith("/tb")


# (c) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_sizes_the_vocabulary_by_its_tokenizer(recipe):
    """A tokenizer of 1000 ids gets 1024 embedding rows under every recipe, the default one included."""
    config = load_config([str(REPO / "recipes" / recipe)])[0]
    plan = SimpleNamespace(config=config)
    Trainer._resolve_vocab_size(plan, 1000)
    assert config.model.vocab_size == 1024


# (d) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, default", [("window_backend", "flash_attn", "flex"),
                                                 ("window_backend", "sdpa", "flex"),
                                                 ("cmp_backend", "flash_attn_4", "triton")])
def test_the_reference_backend_refuses_kernel_keys_it_would_ignore(key, value, default):
    with pytest.raises(ConfigError) as error:
        load_config(["recipes/debug.toml", f"--model.nsa.{key}", value])
    assert str(error.value) == (f"model.nsa.{key} = {value!r} needs backend = 'triton' (the reference computes every "
                                "branch itself): set model.nsa.backend = 'triton' (a CUDA GPU), or leave "
                                f"{key} at {default!r}")
    load_config(["recipes/debug.toml", f"--model.nsa.{key}", value, "--model.nsa.backend", "triton"])  # a GPU's


def test_a_gpu_runs_kernel_choices_are_dropped_for_the_reference():
    """What inference on a CPU builds from a GPU run's settings: the same attention, no kernel keys."""
    gpu = NSAArgs(backend="triton", window_backend="flash_attn_4", cmp_backend="flash_attn_4", float_atomics=True,
                  window_size=64)
    assert gpu.on_reference() == NSAArgs(window_size=64)


def test_the_start_names_the_attention_kernels():
    model = get_flavor("nsa-125m")
    assert attention_line(model) == "attention: nsa, backend reference"
    model.nsa.backend, model.nsa.window_backend, model.nsa.float_atomics = "triton", "flash_attn_4", True
    assert attention_line(model) == "attention: nsa, backend triton (window flash_attn_4, compressed triton, " \
                                    "float atomics)"
    model.nsa.selected_kernels = "gluon_hopper"
    assert attention_line(model) == "attention: nsa, backend triton (window flash_attn_4, compressed triton, " \
                                    "selected gluon_hopper, float atomics)"
    assert attention_line(get_flavor("dense-125m")) == "attention: dense"


def test_a_run_prints_its_attention_kernels(short_run):
    result, _ = short_run
    lines = result.stdout.splitlines()
    assert lines[lines.index("attention: nsa, backend reference") - 1].startswith("model debug: ")


# (e) ------------------------------------------------------------------------------------------------------------

def test_a_cpu_run_logs_its_peak_rss_under_its_own_name_and_no_mfu(short_run):
    result, logged = short_run
    assert "warning:" not in result.stderr, result.stderr[-2000:]
    assert "memory/peak_rss_gib" in logged and logged["memory/peak_rss_gib"][3] > 0
    assert not {"memory/max_allocated_gib", "memory/max_reserved_gib", "perf/mfu"} & set(logged)
    assert set(memory_scalars(torch.device("cpu"))) == {"memory/peak_rss_gib"}


# (f) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--training.steps", "abc", "--training.steps", "2"],
                                  ["--training.steps=abc", "--training.steps", "2"]])
def test_a_key_given_twice_on_the_command_line_is_one_error(argv):
    with pytest.raises(ConfigError) as error:
        load_config(["recipes/debug.toml", *argv])
    assert str(error.value) == "--training.steps is given twice ('abc', then '2'): give it once"


# (g) ------------------------------------------------------------------------------------------------------------

def test_a_log_rank_beyond_the_world_is_refused(tmp_path, capsys):
    config = load_config(["--metrics.log_rank", "3"])[0]
    with pytest.raises(ConfigError, match=r"^metrics.log_rank = 3 names no rank of this run's 2 \(0 to 1\): set "
                                          r"metrics.log_rank below 2$"):
        check_world_size(config, 2)  # the launcher's check
    check_world_size(config, 4)
    # A plain `python train.py` (one process, no launcher): refused by the trainer, nothing written.
    code = train.main(["recipes/debug.toml", "--metrics.log_rank", "3", "--job.run_dir", str(tmp_path / "run")])
    assert code == exit_codes.BAD_INPUT_EXIT_CODE
    assert capsys.readouterr().err == ("error: metrics.log_rank = 3 names no rank of this run's 1 (0 to 0): set "
                                       "metrics.log_rank below 1\n")
    assert not (tmp_path / "run").exists()


# (h) ------------------------------------------------------------------------------------------------------------

AC_WORDS = {"full": "full activation checkpointing", "selective_op": "selective activation checkpointing",
            "none": "no activation checkpointing"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipes_header_says_its_activation_checkpointing(recipe):
    """The comment a recipe opens with names no other activation checkpointing than the one it sets."""
    text = (REPO / "recipes" / recipe).read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines()[:text.splitlines().index("")]).lower()
    mode = load_config([str(REPO / "recipes" / recipe)])[0].activation_checkpoint.mode
    assert not [words for m, words in AC_WORDS.items() if m != mode and words in header]


@pytest.mark.parametrize("path", ["nsa_models/nsa/flex.py", "nsa_models/nsa/varlen.py", "scripts/compare_runs.py"])
def test_the_readme_layout_names_the_modules_it_left_out(path):
    readme = (REPO / "README.md").read_text()
    assert (REPO / path).is_file() and Path(path).name in readme[readme.index("## Layout"):]


def test_exit_codes_are_declared_in_one_module():
    """Every `*_EXIT_CODE = N` lives in nsa_training/exit_codes.py, each status once; train.py uses no literal."""
    declared = {}
    for path in [REPO / "train.py", *(REPO / "nsa_training").glob("*.py")]:
        for name in re.findall(r"^(\w+_EXIT_CODE) = \d+", path.read_text(), re.MULTILINE):
            declared[name] = path.name
    assert set(declared.values()) == {"exit_codes.py"}, declared
    values = [value for name, value in vars(exit_codes).items() if name.endswith("_EXIT_CODE")]
    assert sorted(values) == [2, 3, 4, 5, 6, 7]
    assert not re.search(r"\b2 if\b|return 2\b", (REPO / "train.py").read_text())


# Measured peaks (docs/PERFORMANCE.md, "Compile, activation checkpointing and window"): nsa-125m, 16 x 2048 tokens a
# micro-batch, bf16, compiled, triton backend, FlexAttention window, one H200.
MEASURED_PEAK_GIB = {"none": 21.04, "full": 10.23, "selective_op": 16.61}


@pytest.mark.parametrize("mode", ["none", "full", "every_n", "selective_op"])
def test_the_memory_estimate_of_every_ac_mode_stays_below_the_measured_peaks(mode):
    """The pre-start estimate only refuses runs that cannot fit: at or below each measured peak, within 30% of it;
    `every_n` (every 2nd block) between `full` and none."""
    import dataclasses

    from nsa_models.model import Transformer
    from nsa_training.metrics import estimate_memory
    from parallelisms.config import ActivationCheckpointConfig

    flavor = get_flavor("nsa-125m")
    args = dataclasses.replace(flavor, vocab_size=50304, nsa=dataclasses.replace(flavor.nsa, backend="triton"))
    with torch.device("meta"):
        model = Transformer(args)
    n_params = sum(p.numel() for p in model.parameters())

    def estimate(mode: str) -> float:
        return estimate_memory(args, n_params, 16 * 2048, shards=1, compute_bytes=2,
                               ac=ActivationCheckpointConfig(mode=mode, every_n=2)).total / 2**30

    if mode == "every_n":
        assert estimate("full") < estimate("every_n") < estimate("none")
    else:
        assert 0.7 * MEASURED_PEAK_GIB[mode] <= estimate(mode) <= MEASURED_PEAK_GIB[mode]
