"""Recipe loading: precedence, nested keys, one-line errors for bad input, every recipe, TOML round trip."""

import dataclasses
import os
import subprocess
import sys
import threading
import typing
from datetime import timedelta
from pathlib import Path

import pytest

from nsa_models.args import get_flavor
from nsa_training.config import (
    FLOAT32_MAX,
    INT64,
    MAX_SECONDS,
    Config,
    ConfigError,
    config_to_dict,
    config_to_toml,
    help_text,
    help_topic,
    load_config,
)

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
     "compile.mode = 'fast': expected one of 'auto', 'default', 'reduce-overhead', 'max-autotune', "
     "'max-autotune-no-cudagraphs'"),
    (None, ["--training.steps", "0"], "training.steps = 0: must be > 0"),
    (None, ["--optimizer.lr", "-1e-3"], "optimizer.lr = -0.001: must be > 0"),
    (None, ["--data.eval_fraction", "1"], "data.eval_fraction = 1.0: must be > 0 and < 1"),
    (None, ["--optimizer.beta2", "1.0"], "optimizer.beta2 = 1.0: must be >= 0 and < 1"),
    (None, ["--model.n_kv_heads", "0"], "model.n_kv_heads = 0: must be > 0"),
    (None, ["--activation_checkpoint.every_n", "0"], "activation_checkpoint.every_n = 0: must be > 0"),
    (None, ["--data.seq_len", "512"], "data.seq_len = 512 exceeds model.max_seq_len = 256"),
    (None, ["--model.n_kv_heads", "3"], "model.n_kv_heads must divide model.n_heads"),
    (None, ["--model.nsa.cmp_stride", "5"], "model.nsa.cmp_stride must divide model.nsa.cmp_block_size"),
    (None, ["--model.nsa.float_atomics", "true"],
     "model.nsa.float_atomics = true needs backend = 'triton' with window_backend = 'flash_attn' or 'flash_attn_4', "
     "or cmp_backend = 'flash_attn_4'"),
    (None, ["--model.nsa.cmp_backend", "flash_attn_4"],
     "model.nsa.cmp_backend = 'flash_attn_4' needs backend = 'triton'"),
    (None, ["--model.nsa.cmp_backend", "cudnn"], "model.nsa.cmp_backend = 'cudnn'"),
    (None, ["--model.nsa.selected_kernels", "gluon_hopper"],
     "model.nsa.selected_kernels = 'gluon_hopper' needs backend = 'triton' (the reference computes every branch "
     "itself): set model.nsa.backend = 'triton' (a CUDA GPU), or set model.nsa.selected_kernels = 'triton'"),
    (None, ["--model.nsa.selected_kernels", "gluon_hopper", "--model.nsa.backend", "triton"],  # debug: l' = 16
     "model.nsa.selected_kernels = 'gluon_hopper' runs selection blocks of 64 keys, but model.nsa.sel_block_size = "
     "16: set it to 64, or set model.nsa.selected_kernels = 'triton'"),
    (None, ["--model.nsa.selected_kernels", "gluon_hopper", "--model.nsa.backend", "triton",
            "--model.nsa.sel_block_size", "64"],  # debug: head dim 32
     "model.nsa.selected_kernels = 'gluon_hopper' runs head dim 64 or 128, but model.head_dim = 32: set "
     "model.nsa.selected_kernels = 'triton'"),
    (None, ["--model.nsa.selected_kernels", "gluon_hopper", "--model.nsa.backend", "triton",
            "--model.nsa.sel_block_size", "64", "--model.head_dim", "64", "--model.n_heads", "130",
            "--model.n_kv_heads", "1"],
     "model.nsa.selected_kernels = 'gluon_hopper' runs at most 64 query heads per KV head, but model.n_heads / "
     "model.n_kv_heads = 130: set model.nsa.selected_kernels = 'triton'"),
    (None, ["--model.nsa.selected_kernels", "cuda"], "model.nsa.selected_kernels = 'cuda'"),
    (None, ["--model.nsa.window_backend", "gluon_hopper"],
     "model.nsa.window_backend = 'gluon_hopper' needs backend = 'triton'"),
    (None, ["--model.nsa.window_backend", "gluon_hopper", "--model.nsa.backend", "triton"],  # debug: head dim 32
     "model.nsa.window_backend = 'gluon_hopper' runs head dim 64 or 128, but model.head_dim = 32: set "
     "model.nsa.window_backend = 'flex'"),
    (None, ["--model.nsa.float_atomics", "true", "--model.nsa.backend", "triton", "--model.nsa.window_backend",
            "flash_attn_4", "--debug.deterministic", "true"],
     "model.nsa.float_atomics = true contradicts debug.deterministic = true"),
    (None, ["--model.nsa.backend", "triton", "--training.micro_batch_size", "32768"],  # debug: 2 KV heads
     "training.micro_batch_size x model.n_kv_heads = 65536 exceeds the 65535 (sequence, KV head) pairs"),
    (None, ["--parallelism.dp_replicate", "2"],
     "parallelism.dp_replicate = 2 needs parallelism.data_parallel = 'hsdp' (it is 'fsdp')"),
    (None, ["--model.flavor", "nsa-70b"],
     "model.flavor = 'nsa-70b': unknown flavor; valid: debug, dense-debug, nsa-125m"),
    (None, ["--training.steps"], "--training.steps needs a value: --training.steps VALUE or --training.steps=VALUE"),
    (None, ["--training.steps", "--compile.enable", "true"], "--training.steps needs a value"),
    (None, ["recipe.yaml"], "unexpected argument 'recipe.yaml': give one recipe .toml file"),
    (None, ["--compile.enable", "true", "false"], "unexpected argument 'false'"),
    (None, ["does/not/exist.toml"], "recipe 'does/not/exist.toml' not found: give an existing .toml file"),
    ("[training]\nsteps = 3\nsteps = 4\n", [], "is not valid TOML: Cannot overwrite a value (at line 3, column 10)"),
    ("[training\n", [], "(at line 1, column 10); fix that line"),
    (None, ["--model.head_dim", "33"], "model.head_dim = 33: must be > 0 and a multiple of 2"),
    ("[job]\nrun_dir = \"a\\u0000b\"\n", [], "job.run_dir = 'a\\x00b': must not contain a NUL character"),
    ("[optimizer]\nlr = 1" + "0" * 400 + "\n", [], "optimizer.lr = inf: must be a finite number"),
    (None, ["--debug.init_timeout_s", "1e12"], "debug.init_timeout_s = 1000000000000.0: must be > 0 and <= 1e+09"),
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
    ["--optimizer.lr", "inf"],
    ["--job.run_dir", ""],
    ["--training.seed", str(2**64)],
    ["--model.head_dim", "33"],
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


@pytest.mark.parametrize("content, message", [
    (b"[training]\nsteps = 3\n\xff = 1\n", "is not UTF-8 text (byte 0xff at offset 21): save it as UTF-8"),
    (b"[training\n", "is not valid TOML"),
    (None, "cannot be read: Is a directory"),
], ids=["non-utf8", "toml-syntax", "directory"])
def test_train_py_reports_a_bad_recipe_file_in_one_line(tmp_path, content, message):
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(content) if content is not None else recipe.mkdir()
    run = subprocess.run([sys.executable, "train.py", str(recipe)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


# Every key, found from the dataclasses: a new field is covered by the class tests below without being listed.
def leaf_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, dataclasses.Field, typing.Any]]:
    """(key, field, declared type) of every value key of the recipe."""
    hints, leaves = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            leaves += leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            leaves.append((prefix + f.name, f, hints[f.name]))
    return leaves


LEAVES = leaf_fields()
FLOAT_KEYS = [key for key, _, kind in LEAVES if kind is float]
INT_KEYS = [key for key, _, kind in LEAVES if kind is int]
# A string key whose default is not empty names something (a directory, a file, a split, a column): "" is a mistake.
# One whose default is "" gives "" a meaning ("none": checkpoint.load_path, data.eval_split).
NAMING_KEYS = [key for key, f, kind in LEAVES if kind is str and f.default != ""]
OPTIONAL_KEYS = [key for key, f, kind in LEAVES if kind is str and f.default == ""]
BOUNDED = [(key, f.metadata) for key, f, _ in LEAVES if f.metadata]


def as_recipe(key: str, toml_value: str) -> str:
    section, _, name = key.rpartition(".")
    return f"[{section}]\n{name} = {toml_value}\n"


def test_key_classes_found():
    assert {"optimizer.lr", "optimizer.weight_decay", "model.init_std", "model.rope_theta"} <= set(FLOAT_KEYS)
    assert {"training.seed", "model.head_dim", "data.seq_len"} <= set(INT_KEYS)
    assert {"job.run_dir", "data.source", "data.tokenizer"} <= set(NAMING_KEYS)
    assert {"checkpoint.load_path", "data.eval_split", "job.description"} <= set(OPTIONAL_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("text, shown", [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("1e39", "1e+39"),
                                         ("-1e39", "-1e+39")])
def test_every_float_key_rejects_non_finite_and_beyond_float32(tmp_path, key, text, shown):
    for argv in (["--" + key, text], [write_recipe(tmp_path, as_recipe(key, text))]):
        with pytest.raises(ConfigError) as error:
            load_config(argv)
        assert str(error.value) == f"{key} = {shown}: must be a finite number of at most 3.4e+38 in magnitude " \
                                   "(float32's range)"


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_every_int_key_rejects_beyond_64_bits(tmp_path, key, value):
    for argv in (["--" + key, str(value)], [write_recipe(tmp_path, as_recipe(key, str(value)))]):
        with pytest.raises(ConfigError, match=rf"^{key} = {value}: must fit in 64 bits"):
            load_config(argv)


def test_the_largest_values_accepted_are_ones_their_consumers_take():
    import torch

    config, _ = load_config(["--training.seed", str(INT64[1]), "--debug.collective_timeout_s", str(MAX_SECONDS),
                             "--optimizer.lr", str(FLOAT32_MAX)])
    torch.manual_seed(config.training.seed)
    assert torch.tensor(config.optimizer.lr, dtype=torch.float32).isfinite()
    timedelta(seconds=config.debug.collective_timeout_s)  # process-group timeouts
    threading.Lock().acquire(timeout=config.debug.collective_timeout_s)  # the watchdog's waits, time.sleep's range


@pytest.mark.parametrize("key", NAMING_KEYS)
@pytest.mark.parametrize("text", ["", "  "])
def test_every_naming_key_rejects_an_empty_string(tmp_path, key, text):
    for argv in (["--" + key, text], [write_recipe(tmp_path, as_recipe(key, f'"{text}"'))]):
        with pytest.raises(ConfigError, match=rf"^{key} = '{text}': "):
            load_config(argv)


@pytest.mark.parametrize("key", OPTIONAL_KEYS)
def test_a_key_whose_default_is_empty_accepts_empty(key):
    load_config(["--" + key, ""])


def violations(bounds: dict) -> list[float]:
    """Values just outside each bound."""
    outside = {"gt": lambda b: b, "ge": lambda b: b - 1, "lt": lambda b: b, "le": lambda b: b * 2,
               "multiple_of": lambda b: b + 1}
    return [outside[name](limit) for name, limit in bounds.items()]


@pytest.mark.parametrize("key, bounds", BOUNDED, ids=[key for key, _ in BOUNDED])
def test_every_bound_declared_on_a_field_is_enforced(key, bounds):
    for value in violations(bounds):
        with pytest.raises(ConfigError, match=rf"^{key} = .*: must be "):
            load_config(["--" + key, str(value)])


def help_lines(topic: str) -> list[str]:
    return help_text(topic).splitlines()


def test_help_lists_every_section_with_its_doc():
    text = help_text()
    sections = sorted({key.rpartition(".")[0] for key, _, _ in LEAVES})
    assert sections[0] == "activation_checkpoint" and "model.nsa" in sections
    for section in sections:
        line = next(line for line in text.splitlines() if line.split()[:1] == [section])
        assert len(line.split(maxsplit=1)) == 2, f"section {section} has no description"
    assert text.startswith("usage: train.py")


def default_texts() -> dict[str, str]:
    """Every key's default as the resolved config writes it (`key = value` lines under `[section]` tables)."""
    texts, section = {}, ""
    for line in config_to_toml(Config()).splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif line:
            name, value = line.split(" = ", 1)
            texts[f"{section}.{name}"] = value
    return texts


@pytest.mark.parametrize("section", sorted({key.rpartition(".")[0] for key, _, _ in LEAVES}))
def test_help_section_lists_each_key_with_type_default_and_doc(section):
    defaults, lines = default_texts(), help_lines(section)
    assert lines[0].startswith(f"[{section}]")
    for key, f, kind in LEAVES:
        if key.rpartition(".")[0] != section:
            continue
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"  {f.name}: ")]
        choices = " | ".join(f'"{choice}"' for choice in typing.get_args(kind))
        assert lines[index].startswith(f"  {f.name}: {choices or kind.__name__} = {defaults[key]}"), lines[index]
        assert lines[index + 1].startswith(" " * 6) and len(lines[index + 1].split()) > 1, f"{key} has no doc"


def test_help_shows_bounds_and_the_whole_doc():
    lines = help_lines("model.nsa")
    assert "  n_selected: int = 4  (>= 3)" in lines
    text = help_text("optimizer.lr")
    assert text == "[optimizer]  AdamW.\n  lr: float = 0.001  (> 0)\n      Peak learning rate.\n"
    assert "      [l] tokens per compressed block." in lines
    # A docstring of several lines, whole: from its first word to its last.
    source = " ".join(help_text("data.source").split())
    assert "source: str = \"embedded\" `embedded` (the corpus shipped" in source
    assert source.endswith("or `hf://NAME` to stream a hub dataset.")


def test_help_unknown_topic_suggests_the_key():
    with pytest.raises(ConfigError, match=r"^unknown key 'optimzer' \(did you mean 'optimizer'\?\)$"):
        help_text("optimzer")
    run = subprocess.run([sys.executable, "train.py", "--help", "optimzer"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, "error: unknown key 'optimzer' (did you mean 'optimizer'?)\n")


@pytest.mark.parametrize("argv, topic", [
    ([], None), (["--training.steps", "3"], None), (["--help"], ""), (["-h"], ""),
    (["recipes/debug.toml", "--help"], ""), (["--help", "optimizer"], "optimizer"), (["-h", "model.nsa"], "model.nsa"),
    (["--help=training"], "training"), (["--help", "--training.steps", "3"], ""),
    (["--help", "recipes/debug.toml"], ""),
])
def test_help_topic(argv, topic):
    assert help_topic(argv) == topic


@pytest.mark.parametrize("command", [
    [sys.executable, "train.py", "--help"], [sys.executable, "train.py", "-h"],
    [sys.executable, "train.py", "recipes/debug.toml", "--help", "model.nsa"], ["./run.sh", "--help"],
    ["./run.sh", "-h", "optimizer"],
], ids=" ".join)
def test_help_exits_0_with_the_text(command):
    # NSA_PYTHON / NGPU: run.sh as on a machine whose environment is ready, with one process (no venv, no torch).
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NSA_PYTHON": sys.executable, "NGPU": "1"})
    assert run.returncode == 0 and run.stderr == "", run.stderr
    topic = help_topic(command[1:]) or ""
    assert run.stdout == help_text(topic)


def test_warmup_as_long_as_the_run_is_shortened_with_a_warning(capsys):
    config, _ = load_config(["recipes/debug.toml", "--training.steps", "20"])  # the recipe's warmup is 20
    assert config.lr_scheduler.warmup_steps == 19
    err = capsys.readouterr().err
    assert err == ("warning: lr_scheduler.warmup_steps = 20 is not below training.steps = 20: shortened to 19\n")
    config, _ = load_config(["--training.steps", "1", "--lr_scheduler.warmup_steps", "50"])
    assert config.lr_scheduler.warmup_steps == 0
    config, _ = load_config(["recipes/debug.toml", "--training.steps", "21"])
    assert config.lr_scheduler.warmup_steps == 20 and capsys.readouterr().err.count("warning") == 1


def test_shortened_warmup_is_what_print_config_and_the_run_record(tmp_path):
    printed = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "5",
                              "--print-config"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and printed.stderr.startswith("warning: lr_scheduler.warmup_steps = 20")
    assert "\nwarmup_steps = 4\n" in printed.stdout
    run_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "1",
                          "--job.run_dir", str(run_dir), "--training.eval_interval", "0", "--checkpoint.enable",
                          "false", "--checkpoint.export_weights", "false"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\nwarmup_steps = 0\n" in (run_dir / "config.toml").read_text()
