"""Recipe loading: precedence, nested keys, one-line errors for bad input, every recipe, TOML round trip."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_models.args import get_flavor
from nsa_training.config import Config, ConfigError, config_to_dict, config_to_toml, load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.toml"))


def write_recipe(tmp_path: Path, text: str, name: str = "r.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_recipe():
    config, print_config = load_config([])
    assert config == Config() and not print_config


@pytest.mark.parametrize("style", ["space", "equals"])
def test_precedence_cli_over_toml_over_flavor_over_defaults(tmp_path, style):
    recipe = write_recipe(tmp_path, """
[model]
flavor = "nsa-125m"
n_layers = 3
[training]
steps = 40
micro_batch_size = 2
[optimizer]
lr = 1
""")
    overrides = {"training.steps": "70", "model.dim": "256", "compile.enable": "true"}
    argv = [recipe, "--print-config"]
    for key, value in overrides.items():
        argv += [f"--{key}", value] if style == "space" else [f"--{key}={value}"]
    config, print_config = load_config(argv)
    assert print_config
    assert config.training.steps == 70                      # CLI beats TOML
    assert config.model.dim == 256                          # CLI beats flavor
    assert config.compile.enable is True                    # CLI beats default
    assert config.training.micro_batch_size == 2            # TOML beats default
    assert config.model.n_layers == 3                       # TOML beats flavor
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)  # int accepted for a float
    assert config.model.n_heads == get_flavor("nsa-125m").n_heads == 12  # flavor beats ModelArgs default
    assert config.model.flavor == "nsa-125m"
    assert config.training.seed == 0 and config.job == Config().job  # untouched: defaults


def test_cli_flavor_beats_toml_flavor_but_toml_model_keys_still_apply(tmp_path):
    recipe = write_recipe(tmp_path, '[model]\nflavor = "nsa-125m"\nn_layers = 3\n[data]\nseq_len = 128\n')
    config, _ = load_config([recipe, "--model.flavor", "dense-debug"])
    expected = dataclasses.replace(get_flavor("dense-debug"), n_layers=3)
    assert config.model == expected


def test_nested_model_nsa_keys(tmp_path):
    recipe = write_recipe(tmp_path, '[model.nsa]\nwindow_size = 64\ncompress = "mean"\n')
    config, _ = load_config([recipe, "--model.nsa.backend", "triton", "--model.nsa.separate_kv=1"])
    nsa = config.model.nsa
    assert (nsa.window_size, nsa.compress, nsa.backend, nsa.separate_kv) == (64, "mean", "triton", True)
    assert nsa.cmp_block_size == get_flavor("debug").nsa.cmp_block_size == 16  # the rest from the flavor
    # The same keys written as a dotted key inside [model] and as an inline table.
    for text in ('[model]\nnsa.window_size = 64\n', '[model]\nnsa = { window_size = 64 }\n'):
        assert load_config([write_recipe(tmp_path, text)])[0].model.nsa.window_size == 64


# (recipe text or None, extra argv, the part of the message that tells the user what to fix)
BAD_INPUT = [
    ("[training]\nstep = 3\n", [], "unknown key 'training.step' (did you mean 'training.steps'?)"),
    ("[trainig]\nsteps = 3\n", [], "unknown key 'trainig' (did you mean 'training'?)"),
    (None, ["--optimizer.learning_rate", "1e-3"], "unknown key 'optimizer.learning_rate'; valid [optimizer]: name, lr"),
    (None, ["--zzz.qqq", "1"], "unknown key 'zzz.qqq'; valid sections: job, model, data, training"),
    (None, ["--training.lr", "1"], "unknown key 'training.lr' (did you mean 'optimizer.lr'?)"),
    (None, ["--model.nsa.window", "8"], "unknown key 'model.nsa.window' (did you mean 'model.nsa.window_size'?)"),
    (None, ["--training.steps", "abc"], "training.steps = 'abc': expected an integer"),
    ("[training]\nsteps = \"10\"\n", [], "training.steps = '10': expected an integer"),
    ("[training]\nsteps = 2.5\n", [], "training.steps = 2.5: expected an integer"),
    (None, ["--optimizer.lr=fast"], "optimizer.lr = 'fast': expected a number"),
    (None, ["--compile.enable", "yes"], "compile.enable = 'yes': expected true or false"),
    ("[compile]\nenable = 1\n", [], "compile.enable = 1: expected true or false"),
    ("[job]\nrun_dir = 5\n", [], "job.run_dir = 5: expected a string"),
    (None, ["--compile.mode", "fast"],
     "compile.mode = 'fast': expected one of 'default', 'reduce-overhead', 'max-autotune', "
     "'max-autotune-no-cudagraphs'"),
    (None, ["--training.steps", "0"], "training.steps = 0: must be > 0"),
    (None, ["--optimizer.lr", "-1e-3"], "optimizer.lr = -0.001: must be > 0"),
    (None, ["--data.eval_fraction", "1"], "data.eval_fraction = 1.0: must be between 0 and 1, exclusive"),
    (None, ["--optimizer.beta2", "1.0"], "optimizer.beta2 = 1.0: must be in [0, 1)"),
    (None, ["--model.n_kv_heads", "0"], "model.n_kv_heads = 0: must be > 0"),
    (None, ["--activation_checkpoint.every_n", "0"], "activation_checkpoint.every_n = 0: must be > 0"),
    (None, ["--lr_scheduler.warmup_steps", "300"],
     "lr_scheduler.warmup_steps = 300: must be < training.steps (300)"),
    (None, ["--data.seq_len", "512"], "data.seq_len = 512 exceeds model.max_seq_len = 256"),
    (None, ["--training.global_batch_tokens", "1000"],
     "training.global_batch_tokens = 1000: must be a multiple of training.micro_batch_size * data.seq_len = 2048"),
    (None, ["--model.n_kv_heads", "3"], "model.n_kv_heads must divide model.n_heads"),
    (None, ["--model.nsa.cmp_stride", "5"], "model.nsa.cmp_stride must divide model.nsa.cmp_block_size"),
    (None, ["--model.nsa.float_atomics", "true"],
     "model.nsa.float_atomics = true needs backend = 'triton' with window_backend = 'flash_attn' or 'flash_attn_4', "
     "or cmp_backend = 'flash_attn_4'"),
    (None, ["--model.nsa.cmp_backend", "flash_attn_4"],
     "model.nsa.cmp_backend = 'flash_attn_4' needs backend = 'triton'"),
    (None, ["--model.nsa.cmp_backend", "cudnn"], "model.nsa.cmp_backend = 'cudnn'"),
    (None, ["--model.nsa.float_atomics", "true", "--model.nsa.backend", "triton", "--model.nsa.window_backend",
            "flash_attn_4", "--debug.deterministic", "true"],
     "model.nsa.float_atomics = true contradicts debug.deterministic = true"),
    (None, ["--parallelism.dp_replicate", "2"],
     "parallelism.dp_replicate = 2 needs parallelism.data_parallel = 'hsdp' (it is 'fsdp')"),
    (None, ["--float8.enable", "true", "--training.device", "cpu"],
     "float8.enable = true needs a GPU of SM89 or newer: set training.device = 'cuda' or float8.enable = false"),
    (None, ["--model.flavor", "nsa-7b"],
     "model.flavor = 'nsa-7b': unknown flavor; valid: debug, dense-debug, nsa-125m"),
    (None, ["--training.steps"], "--training.steps needs a value: --training.steps VALUE or --training.steps=VALUE"),
    (None, ["--training.steps", "--compile.enable", "true"], "--training.steps needs a value"),
    (None, ["recipe.yaml"], "unexpected argument 'recipe.yaml': give one recipe .toml file"),
    (None, ["--compile.enable", "true", "false"], "unexpected argument 'false'"),
    (None, ["does/not/exist.toml"], "recipe 'does/not/exist.toml' not found: give an existing .toml file"),
    ("[training]\nsteps = 3\nsteps = 4\n", [], "is not valid TOML: Cannot overwrite a value (at line 3, column 10)"),
    ("[training\n", [], "(at line 1, column 10); fix that line"),
    ("training = 5\n", [], "training is a section, not a value: set its keys under a [training] table"),
    ("[model]\nnsa = \"triton\"\n", [], "model.nsa is a section, not a value"),
    (None, ["--model.nsa", "triton"],
     "--model.nsa is a section, not a value: set its keys, e.g. --model.nsa.KEY VALUE"),
    ("[training.steps]\nvalue = 3\n", [], "training.steps is a value, not a section: write training.steps = VALUE"),
    (None, ["--training.steps.max", "3"], "training.steps is a value, not a section"),
]


@pytest.mark.parametrize("recipe_text, argv, message", BAD_INPUT, ids=[m[:48] for *_, m in BAD_INPUT])
def test_bad_input_raises_one_line_config_error(tmp_path, recipe_text, argv, message):
    recipe = [write_recipe(tmp_path, recipe_text)] if recipe_text is not None else []
    with pytest.raises(ConfigError) as error:
        load_config(recipe + argv)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_file_name_in_toml_error(tmp_path):
    recipe = write_recipe(tmp_path, "[training\n", name="broken.toml")
    with pytest.raises(ConfigError, match=r"recipe '.*broken\.toml' is not valid TOML"):
        load_config([recipe])


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads(recipe):
    config, _ = load_config([str(recipe)])
    assert config.model.flavor in recipe.read_text()  # each recipe names its flavor explicitly


def test_recipes_present():
    names = {r.name for r in RECIPES}
    assert {"debug.toml", "nsa_125m.toml", "nsa_125m_ddp.toml", "nsa_125m_fsdp2.toml", "dense_125m.toml",
            "nsa_1b_fsdp2.toml", "nsa_125m_32k.toml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_config_to_toml_round_trip(tmp_path, recipe):
    config, _ = load_config([str(recipe), "--job.description", 'quotes " \\ tab\t newline\n unicode é ∑ \x7f'])
    again, _ = load_config([write_recipe(tmp_path, config_to_toml(config))])
    assert again == config
    # Every key is written, so the round trip does not lean on defaults or the flavor.
    assert len(config_to_dict(config)) == config_to_toml(config).count(" = ")


# train.py's contract: bad input -> exactly one stderr line `error: ...`, exit status 2, no traceback, checked
# before the torch-heavy modules are imported.
CLI_ERRORS = [
    ["--training.step", "3"],
    ["--training.steps", "abc"],
    ["--compile.mode", "fast"],
    ["recipes/missing.toml"],
    ["--data.seq_len", "512"],
]


@pytest.mark.parametrize("argv", CLI_ERRORS, ids=[" ".join(a) for a in CLI_ERRORS])
def test_train_py_reports_config_errors_in_one_line(argv):
    run = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in run.stderr, run.stderr
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert lines[0] == f"error: {error.value}"
