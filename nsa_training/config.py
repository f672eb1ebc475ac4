"""Recipe configuration: one dataclass per section, each field documented where it is declared.

A recipe is a TOML file whose tables are these sections (`[training]`, `[model.nsa]`, ...); command-line
overrides `--section.key value` / `--section.key=value` win over the TOML, which wins over the defaults.
The `[model]` section is `nsa_models.ModelArgs`: its `flavor` supplies every model value the recipe leaves out.

Each section validates itself where it is declared: a field's `metadata` bounds its value with the annotated-types
names (`gt`, `ge`, `lt`, `le`, `multiple_of`), and every field is held to what its type can carry (`_check_field`).
Rules between fields of different sections live in `_check_combinations`; rules that need the runtime (the process
count, the tokenizer, the GPU) are checked once where it is known (trainer, parallelisms, data).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
import json
import math
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from nsa_models.args import FLAVORS, TRITON_MAX_BATCH_HEADS, ModelArgs, get_flavor
from parallelisms.config import (
    ActivationCheckpointConfig,
    CompileConfig,
    Float8Config,
    ParallelismConfig,
    PlanError,
    check_context_parallel,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class ConfigError(Exception):
    """Bad user input (recipe, override, data path, impossible plan): one line naming the key and the fix.

    train.py prints `error: <message>` and exits with status 2, no traceback.
    """


MAX_SECONDS = 1e9  # ~31 years: the most that timedelta, time.sleep and thread waits all accept
FLOAT32_MAX = 3.4028234663852886e38  # float values reach fp32 tensors and kernels (the fused AdamW's lr, ...)
INT64 = (-(2**63), 2**63 - 1)  # TOML's integers; also what torch.manual_seed and tensor shapes accept


@dataclass
class JobConfig:
    run_dir: str = "runs/debug"
    """Directory of this run: checkpoints, tensorboard events, the resolved config. Reusing it resumes."""
    description: str = ""
    """Free text shown in the resolved config and in tensorboard."""


@dataclass
class DataConfig:
    source: str = "embedded"
    """`embedded` (the corpus shipped with the repo), `synthetic` (seeded random tokens, for benchmarks),
    `passkey` (embedded text, each training row hiding one key that its end asks for; evaluation reads the plain
    held-out text: nsa_training/passkey_data.py), a local file or folder of .jsonl/.json/.parquet/.txt files, or
    `hf://NAME` to stream a hub dataset."""
    hf_config: str = ""
    """Configuration name of a hub dataset (`hf://` sources only)."""
    split: str = "train"
    """Split read for training."""
    eval_split: str = ""
    """Split read for evaluation; empty holds out `eval_fraction` of the training documents instead."""
    eval_fraction: float = field(default=0.01, metadata={"gt": 0, "lt": 1})
    """Share of documents held out for evaluation when `eval_split` is empty (0 < x < 1)."""
    text_field: str = "text"
    """Column that holds the document text (json/jsonl/parquet)."""
    txt_document: Literal["line", "paragraph", "file"] = "line"
    """What one document of a .txt source is: a line (blank lines hold none), a paragraph (text between blank
    lines, its line breaks kept), or a whole file (a folder of books). Only .txt sources read it."""
    tokenizer: str = "byte"
    """`byte` (UTF-8 bytes + EOS, no download) or the path of a HuggingFace `tokenizers` JSON file."""
    seq_len: int = field(default=256, metadata={"gt": 0})
    """Tokens per training sequence; documents are packed with an EOS separator into seq_len+1 windows."""
    document_mask: bool = False
    """Treat each packed document as its own sequence: attention stops at its start, RoPE positions restart, and
    for NSA its compressed and selection blocks start with it. Under NSA each document starts at a multiple of
    model.nsa.sel_block_size (the gap is padding, which the loss skips); one longer than the rest of a row continues
    on the next. Needs a source with documents (not `synthetic`)."""


@dataclass
class TrainingConfig:
    steps: int = field(default=300, metadata={"gt": 0})
    """Optimizer steps to train for (the run's end, also when resuming)."""
    global_batch_tokens: int = field(default=8192, metadata={"gt": 0})
    """Tokens per optimizer step over all data-parallel ranks (each sequence once: the ranks of a context-parallel
    group share one); gradient accumulation makes up the rest."""
    micro_batch_size: int = field(default=8, metadata={"gt": 0})
    """Sequences per data-parallel rank per forward/backward (with context parallelism each rank of the group holds
    its part of every one)."""
    max_grad_norm: float = field(default=1.0, metadata={"ge": 0})
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    seed: int = field(default=0, metadata={"ge": 0})
    """Seed of parameter init, data order and every RNG."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available, else CPU. `cuda` on a machine without a GPU is an error."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: `auto` is bf16 autocast on GPU and fp32 on CPU. Parameters and optimizer stay fp32."""
    eval_interval: int = field(default=50, metadata={"ge": 0})
    """Evaluate the held-out loss every this many steps, and at the run's last step (0: never)."""
    eval_batches: int = field(default=4, metadata={"gt": 0})
    """Micro-batches per evaluation."""
    max_skipped_steps: int = field(default=5, metadata={"gt": 0})
    """A step whose loss or gradient norm is not finite is skipped (no update); stop after this many in a row."""


@dataclass
class PasskeyConfig:
    enable: bool = False
    """At every evaluation (`training.eval_interval`) also score passkey retrieval: a key hidden in held-out text,
    asked for at the end (nsa_training/passkey.py). Logs `passkey/accuracy/len<L>`, `passkey/log_likelihood/len<L>`
    and the image `passkey/accuracy_length_x_depth` (a labelled heat map: rows lengths, columns depths, the value in
    each cell, red 0 to green 1), drawn with matplotlib (`pip install -e '.[plot]'`)."""
    min_length: int = field(default=256, metadata={"gt": 0})
    """Shortest context scored, in tokens; lengths double from here up to `data.seq_len`."""
    depths: int = field(default=5, metadata={"gt": 0})
    """Needle positions per length, evenly spaced from the text's start (0) to just before the question (1)."""
    samples: int = field(default=4, metadata={"gt": 0})
    """Random keys per (length, depth); one forward per length scores depths x samples sequences."""
    key_digits: int = field(default=5, metadata={"gt": 0, "le": 18})
    """Digits of each key."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    """Optimizer (fused AdamW)."""
    lr: float = field(default=1e-3, metadata={"gt": 0})
    """Peak learning rate."""
    beta1: float = field(default=0.9, metadata={"ge": 0, "lt": 1})
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata={"ge": 0, "lt": 1})
    """AdamW beta2."""
    eps: float = field(default=1e-8, metadata={"gt": 0})
    """AdamW epsilon."""
    weight_decay: float = field(default=0.1, metadata={"ge": 0})
    """Decoupled weight decay, applied to matrices only (not norms, biases, gates' biases)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = field(default=20, metadata={"ge": 0})
    """Linear warmup from 0 to the peak learning rate."""
    decay_ratio: float = field(default=0.2, metadata={"ge": 0, "le": 1})
    """Share of all steps spent decaying at the end (WSD); 1.0 decays right after warmup."""
    decay_type: Literal["linear", "cosine"] = "cosine"
    """Shape of the decay."""
    min_lr_ratio: float = field(default=0.1, metadata={"ge": 0, "le": 1})
    """Final learning rate as a share of the peak."""


@dataclass
class CheckpointConfig:
    enable: bool = True
    """Write checkpoints (torch.distributed.checkpoint) into `<run_dir>/checkpoints`."""
    interval: int = field(default=100, metadata={"gt": 0})
    """Steps between checkpoints; one is also written at the end."""
    keep: int = field(default=3, metadata={"ge": 0})
    """Checkpoints kept; older ones are deleted once a newer one is complete (0 keeps all)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory if there is one."""
    load_path: str = ""
    """Resume from this checkpoint directory instead (weights, optimizer, schedule, data and RNG state)."""
    strict_resume: bool = False
    """Every checkpoint is verified (file sizes, sha256) before it is loaded. When the latest one is damaged: false
    warns in one line and resumes from the newest one that verifies; true refuses to start (exit status 2)."""
    export_weights: bool = True
    """At the end, also write the model weights alone as one file `<run_dir>/model.pt`."""


@dataclass
class MetricsConfig:
    log_freq: int = field(default=10, metadata={"gt": 0})
    """Console line and tensorboard scalars every this many steps."""
    tensorboard: bool = True
    """Write tensorboard events to `<run_dir>/tb`."""
    log_rank: int = field(default=0, metadata={"ge": 0})
    """Rank whose console lines are printed, below the process count (run.sh's LOG_RANK filters torchrun's output
    too)."""
    nsa_stats_freq: int = field(default=50, metadata={"ge": 0})
    """NSA health telemetry to tensorboard every this many steps (0: never; dense models have none): per layer,
    tags `nsa/<stat>/layer<i>` for the gate means (`gate_cmp`, `gate_slc`, `gate_win`), the share of selected
    blocks that are forced (`forced_share`), the selected blocks' mean and max distance from the query in
    selection blocks (`slc_distance_blocks`, `slc_distance_max`), the entropy of the compressed attention
    (`cmp_entropy`, nats), and the histogram `nsa/slc_distance_hist/layer<i>`. Computed only when logged (no
    sync), from the log rank's last micro-batch of the step."""


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a torch.profiler trace of steps start_step .. start_step+num_steps-1 into `<run_dir>/profile`."""
    start_step: int = field(default=5, metadata={"gt": 0})
    """First profiled step."""
    num_steps: int = field(default=3, metadata={"gt": 0})
    """Profiled steps."""


@dataclass
class DebugConfig:
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) and deterministic cuDNN/cuBLAS settings."""
    hang_timeout_s: float = field(default=1800.0, metadata={"ge": 0, "le": MAX_SECONDS})
    """Exit (status 3) with every thread's stack in `<run_dir>/hang/rank<R>.txt` when no step completes for this
    many seconds after the first one (which gets `debug.init_timeout_s`); long enough for a checkpoint save and the
    first evaluation's compilation. 0 disables the watchdog."""
    init_timeout_s: float = field(default=1800.0, metadata={"gt": 0, "le": MAX_SECONDS})
    """Timeout of process-group setup and of every collective until the first step completes, and the hang
    watchdog's allowance for that step: it includes compilation and checkpoint loading, which ranks finish at
    different times."""
    collective_timeout_s: float = field(default=600.0, metadata={"gt": 0, "le": MAX_SECONDS})
    """Timeout of every collective after the first step: when a rank dies or stalls, the others exit within this
    long (status 5, one line; on NCCL torch aborts them and dumps `<run_dir>/flight_recorder/rank<R>`)."""
    memory_snapshot: bool = False
    """Record the CUDA allocator's history (slows training) and dump it into `<run_dir>/memory` for
    https://pytorch.org/memory_viz: `rank<R>_step<N>.pickle` after step `debug.memory_snapshot_step`, and
    `rank<R>_oom.pickle` on out-of-memory. Needs CUDA."""
    memory_snapshot_step: int = field(default=3, metadata={"ge": 0})
    """Step after which the memory snapshot is dumped (0: only on out-of-memory)."""
    fault_rank: int = field(default=-1, metadata={"ge": -1})
    """Testing only: the rank that `debug.sleep_at_step` and `debug.die_at_step` hit (-1: every rank)."""
    die_at_step: int = field(default=0, metadata={"ge": 0})
    """Testing only: the process kills itself (SIGKILL) in this step (0: never), to exercise how the others end."""
    sleep_at_step: int = field(default=0, metadata={"ge": 0})
    """Testing only: sleep `debug.sleep_s` seconds in this step (0: never), to exercise the hang watchdog."""
    sleep_s: float = field(default=0.0, metadata={"ge": 0, "le": MAX_SECONDS})
    """Testing only: how long step `debug.sleep_at_step` sleeps."""
    nan_at_step: int = field(default=0, metadata={"ge": 0})
    """Testing only: make this step's loss NaN (0: never), to exercise the non-finite step guard."""
    nan_steps: int = field(default=1, metadata={"gt": 0})
    """Testing only: how many consecutive steps from `debug.nan_at_step` get a NaN loss."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    """Where the run lives: checkpoints, tensorboard events, the resolved config."""
    model: ModelArgs = field(default_factory=lambda: get_flavor("debug"))  # what load_config([]) resolves to
    """The model (`nsa_models.ModelArgs`): a named flavor, and any of its keys changed."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and evaluation text, its tokenizer and the sequence length."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Steps, batch size, seed, device and precision."""
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    """Long-context evaluation: passkey retrieval at several lengths and depths."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """Warmup, stable, decay (WSD) learning-rate schedule."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Data parallelism over several processes: DDP, FSDP2 or HSDP."""
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    """Recompute activations in backward to save memory."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile of the model and the loss."""
    float8: Float8Config = field(default_factory=Float8Config)
    """Float8 linear layers through torchao."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, resuming and exporting the weights."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Console lines, tensorboard scalars and NSA telemetry."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """A torch.profiler trace of a few steps."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Determinism, timeouts, memory snapshots and fault injection for tests."""


# ---------------------------------------------------------------------------------------------------------------
# Loading: recipe TOML + command-line overrides -> Config, validated.

def load_config(argv: list[str]) -> tuple[Config, bool]:
    """Resolve `[RECIPE.toml] [--print-config] [--section.key value | --section.key=value ...]`.

    Precedence: command line > recipe > model flavor > dataclass defaults. Returns (config, print_config).
    """
    recipe, print_config, overrides = _parse_argv(argv)
    values = _flatten(_read_recipe(recipe)) if recipe else {}
    for key, text in overrides.items():
        field_type = _field_type(key)
        if is_dataclass(field_type):
            raise ConfigError(f"--{key} is a section, not a value: set its keys, e.g. --{key}.KEY VALUE")
        values[key] = _coerce(key, _from_cli(text, field_type), field_type)

    flavor = values.pop("model.flavor", "debug")
    if flavor not in FLAVORS:
        raise ConfigError(f"model.flavor = {flavor!r}: unknown flavor; valid: {', '.join(FLAVORS)}")
    config = Config(model=get_flavor(flavor))
    for key, value in values.items():
        *sections, name = key.split(".")
        setattr(functools.reduce(getattr, sections, config), name, value)
    validate(config)
    _fit_warmup(config)
    return config, print_config


def validate(config: Config) -> None:
    """Raise ConfigError for the first value or combination that cannot run: every field against its type and
    bounds (section by section, as declared), then the rules between sections."""
    _check_section("", config)
    try:
        config.model.validate()  # the model section's rules between its own keys (the model package's ValueError)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_combinations(config)


def _check_section(prefix: str, section: Any) -> None:
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            _check_section(f"{prefix}{f.name}.", value)
        else:
            _check_field(prefix + f.name, f, value)


# Field metadata bounds, named as annotated-types / pydantic name them.
_BOUNDS = {
    "gt": (">", lambda v, b: v > b),
    "ge": (">=", lambda v, b: v >= b),
    "lt": ("<", lambda v, b: v < b),
    "le": ("<=", lambda v, b: v <= b),
    "multiple_of": ("a multiple of", lambda v, b: v % b == 0),
}


def _check_field(key: str, f: Field, value: Any) -> None:
    """One value against what its type can carry and the bounds in its field's metadata."""
    if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:  # also NaN
        raise ConfigError(f"{key} = {value!r}: must be a finite number of at most {FLOAT32_MAX:.3g} in magnitude "
                          "(float32's range)")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(f"{key} = {value}: must fit in 64 bits (-2**63 .. 2**63 - 1)")
    if isinstance(value, str):
        if "\0" in value:
            raise ConfigError(f"{key} = {value!r}: must not contain a NUL character")
        if not value.strip() and f.default != "":  # a key whose default is "" gives "" a meaning (none)
            raise ConfigError(f"{key} = {value!r}: must not be empty (default {f.default!r})")
    if any(not _BOUNDS[name][1](value, limit) for name, limit in f.metadata.items()):
        raise ConfigError(f"{key} = {_show(value)}: must be {_rule(f.metadata)}")


def _rule(bounds: Mapping[str, float]) -> str:
    return " and ".join(f"{_BOUNDS[name][0]} {limit:g}" for name, limit in bounds.items())


def _check_combinations(config: Config) -> None:
    """The rules between keys of different sections."""
    data, model = config.data, config.model
    if data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len = {data.seq_len} exceeds model.max_seq_len = {model.max_seq_len}: "
                          "lower data.seq_len or raise model.max_seq_len")
    batch_heads = config.training.micro_batch_size * model.n_kv_heads
    if model.attention == "nsa" and model.nsa.backend == "triton" and batch_heads > TRITON_MAX_BATCH_HEADS:
        raise ConfigError(f"training.micro_batch_size x model.n_kv_heads = {batch_heads} exceeds the "
                          f"{TRITON_MAX_BATCH_HEADS} (sequence, KV head) pairs a micro-batch that the triton NSA "
                          "kernels' grid holds: lower "
                          "training.micro_batch_size (training.global_batch_tokens keeps the batch)")
    if config.parallelism.dp_replicate > 1 and config.parallelism.data_parallel != "hsdp":
        raise ConfigError(f"parallelism.dp_replicate = {config.parallelism.dp_replicate} needs "
                          f"parallelism.data_parallel = 'hsdp' (it is {config.parallelism.data_parallel!r}); "
                          "set it or use dp_replicate = 1")
    if data.document_mask and data.source == "synthetic":
        raise ConfigError("data.document_mask = true needs documents, but data.source = 'synthetic' has none (random "
                          "tokens, no boundaries): set data.document_mask = false or read real text")
    if data.document_mask and data.source == "passkey":
        raise ConfigError("data.document_mask = true would cut data.source = 'passkey' rows, each one haystack whose "
                          "needle and question may lie in different documents: set data.document_mask = false")
    cp = config.parallelism.context_parallel_degree
    try:
        check_context_parallel(cp, model, data.seq_len, data.document_mask)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    if config.compile.backend != "inductor" and config.compile.mode not in ("auto", "default"):
        raise ConfigError(f"compile.mode = {config.compile.mode!r} is inductor's, but compile.backend = "
                          f"{config.compile.backend!r}: set compile.mode = 'default' or compile.backend = 'inductor'")
    passkey = config.passkey
    if cp > 1 and passkey.enable:
        raise ConfigError(f"parallelism.context_parallel_degree = {cp} with passkey.enable = true: passkey scoring "
                          "runs whole sequences of several lengths on every rank, which context parallelism does not "
                          "shard; set passkey.enable = false or context_parallel_degree = 1")
    if passkey.enable and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("passkey.enable = true draws its heat map with matplotlib, which is not installed: "
                          "pip install matplotlib (or -e '.[plot]'), or set passkey.enable = false")
    if passkey.enable and passkey.min_length > data.seq_len:
        raise ConfigError(f"passkey.min_length = {passkey.min_length} exceeds data.seq_len = {data.seq_len}: "
                          "lower passkey.min_length")
    if passkey.enable and not config.training.eval_interval:
        raise ConfigError("passkey.enable = true scores at every evaluation, but training.eval_interval = 0: "
                          "set training.eval_interval > 0")
    if config.debug.deterministic and model.attention == "nsa" and model.nsa.float_atomics:
        raise ConfigError("model.nsa.float_atomics = true contradicts debug.deterministic = true (float atomics "
                          "make the backward non-repeatable): set one of them to false")


def _fit_warmup(config: Config) -> None:
    """A warmup as long as the run (a short trial run of a long recipe) is shortened, with a one-line warning."""
    steps, schedule = config.training.steps, config.lr_scheduler
    if schedule.warmup_steps >= steps:
        sys.stderr.write(f"warning: lr_scheduler.warmup_steps = {schedule.warmup_steps} is not below training.steps "
                         f"= {steps}: shortened to {steps - 1}\n")
        schedule.warmup_steps = steps - 1


def config_to_dict(config: Any) -> dict[str, Any]:
    """Every value as a flat `{"section.key": value}` dict (tensorboard hparams)."""
    flat = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            flat.update({f"{f.name}.{key}": v for key, v in config_to_dict(value).items()})
        else:
            flat[f.name] = value
    return flat


def config_to_toml(config: Config) -> str:
    """The resolved config as a recipe: loading it back gives an equal Config."""
    lines: list[str] = []

    def write_table(name: str, section: Any) -> None:
        lines.append(f"[{name}]")
        subsections = []
        for f in fields(section):
            value = getattr(section, f.name)
            if is_dataclass(value):
                subsections.append((f"{name}.{f.name}", value))
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
        for subsection in subsections:
            write_table(*subsection)

    for f in fields(config):
        write_table(f.name, getattr(config, f.name))
    return "\n".join(lines)


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes are TOML basic-string escapes; TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)  # int, or float: repr gives 1e-05, inf, nan — all valid TOML


def _show(value: Any) -> str:
    """A value as the user wrote it, for error messages."""
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _parse_argv(argv: list[str]) -> tuple[str | None, bool, dict[str, str]]:
    recipe, print_config, overrides = None, False, {}
    args = iter(argv)
    for arg in args:
        if arg == "--print-config":
            print_config = True
        elif arg.startswith("--"):
            key, has_value, value = arg[2:].partition("=")
            if not has_value:
                value = next(args, None)
                if value is None or value.startswith("--"):
                    raise ConfigError(f"--{key} needs a value: --{key} VALUE or --{key}=VALUE")
            if key in overrides:  # which one was meant? The last would win silently, the first never be checked
                raise ConfigError(f"--{key} is given twice ({overrides[key]!r}, then {value!r}): give it once")
            overrides[key] = value
        elif recipe is None and arg.endswith(".toml"):
            recipe = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give one recipe .toml file and --section.key VALUE "
                              "overrides")
    return recipe, print_config, overrides


def _read_recipe(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"recipe {path!r} not found: give an existing .toml file, e.g. recipes/debug.toml") from None
    except OSError as e:
        raise ConfigError(f"recipe {path!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {path!r} is not valid TOML: {e}; fix that line") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 by definition
        raise ConfigError(f"recipe {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
                          "save it as UTF-8") from None


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A recipe's nested tables as `{"section.key": typed value}`, every key checked against the dataclasses."""
    values = {}
    for name, value in table.items():
        key = prefix + name
        field_type = _field_type(key)
        if is_dataclass(field_type) and not isinstance(value, dict):
            raise ConfigError(f"{key} is a section, not a value: set its keys under a [{key}] table")
        if isinstance(value, dict) and not is_dataclass(field_type):
            raise ConfigError(f"{key} is a value, not a section: write {key} = VALUE")
        if isinstance(value, dict):
            values.update(_flatten(value, key + "."))
        else:
            values[key] = _coerce(key, value, field_type)
    return values


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)  # resolves the `from __future__ import annotations` strings
    return {f.name: hints[f.name] for f in fields(cls)}


@functools.cache
def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every section and key path, for 'did you mean' suggestions."""
    keys = []
    for name, field_type in _hints(cls).items():
        keys.append(prefix + name)
        if is_dataclass(field_type):
            keys += _all_keys(field_type, f"{prefix}{name}.")
    return keys


def _field_type(key: str) -> Any:
    """The declared type of a section or key path (a dataclass for a section); ConfigError if there is none."""
    field_type: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not is_dataclass(field_type):
            parent = ".".join(parts[:i])
            raise ConfigError(f"{parent} is a value, not a section: write {parent} = VALUE")
        hints = _hints(field_type)
        if part not in hints:
            close = difflib.get_close_matches(part, hints, n=1)
            # A misspelling within the section, else the same key name in another section (training.lr).
            guesses = [".".join([*parts[:i], close[0], *parts[i + 1:]])] if close else [
                k for k in _all_keys() if k.rsplit(".", 1)[-1] == part]
            if guesses:
                raise ConfigError(f"unknown key {key!r} (did you mean {guesses[0]!r}?)")
            where = f"[{'.'.join(parts[:i])}]" if i else "sections"
            raise ConfigError(f"unknown key {key!r}; valid {where}: {', '.join(hints)}")
        field_type = hints[part]
    return field_type


def _from_cli(text: str, field_type: Any) -> Any:
    """The command-line text as the TOML value it stands for; text that is none is returned for _coerce to report."""
    if field_type is bool:
        return {"true": True, "1": True, "false": False, "0": False}.get(text.lower(), text)
    if field_type in (int, float):
        try:
            return field_type(text)
        except ValueError:
            pass
    return text


def _coerce(key: str, value: Any, field_type: Any) -> Any:
    """`value` checked against the field's declared type (an int is accepted for a float)."""
    if get_origin(field_type) is Literal:
        choices = get_args(field_type)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ConfigError(f"{key} = {_show(value)}: expected one of {', '.join(map(repr, choices))}")
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[field_type]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: is_number and isinstance(value, int), float: is_number,
          str: isinstance(value, str)}[field_type]
    if not ok:
        raise ConfigError(f"{key} = {_show(value)}: expected {expected}")
    if field_type is float and isinstance(value, int):  # an int beyond every float is infinite: _check_field says so
        return float(value) if abs(value) <= sys.float_info.max else math.inf if value > 0 else -math.inf
    return value


# ---------------------------------------------------------------------------------------------------------------
# --help: generated from the dataclasses, their field metadata and their attribute docstrings.

USAGE = """usage: train.py [RECIPE.toml] [--SECTION.KEY VALUE ...] [--print-config] [--help [SECTION]]

Trains a language model from a TOML recipe (run.sh: recipes/debug.toml unless one is named). Each value comes from
the command line (--SECTION.KEY VALUE or --SECTION.KEY=VALUE), else the recipe, else model.flavor (for model keys),
else its default. --print-config prints the resolved config and exits."""


def help_topic(argv: list[str]) -> str | None:
    """What `--help [TOPIC]`, `-h [TOPIC]` or `--help=TOPIC` in `argv` asks for: '' the overview, else a section or
    key; None when help is not asked for."""
    for i, arg in enumerate(argv):
        flag, has_topic, topic = arg.partition("=")
        if flag in ("--help", "-h"):
            following = argv[i + 1] if i + 1 < len(argv) else "-"
            if not has_topic and not following.startswith("-") and not following.endswith(".toml"):
                topic = following
            return topic
    return None


def help_text(topic: str = "") -> str:
    """The overview (every section, one line each) or, for a section or key, its keys: type, default, bounds, doc."""
    if not topic:
        sections = [key for key in _all_keys() if is_dataclass(_field_type(key))]
        width = max(map(len, sections)) + 2
        lines = [f"  {key:<{width}}{_field_doc(key).split('. ')[0].rstrip('.')}" for key in sections]
        return "\n".join([USAGE, "", "sections (--help SECTION lists its keys, types, defaults and docs):", *lines, ""])
    field_type = _field_type(topic)  # ConfigError names an unknown topic and the closest key
    section, names = (topic, list(_hints(field_type))) if is_dataclass(field_type) else topic.rpartition(".")[::2]
    names = [names] if isinstance(names, str) else names
    defaults = functools.reduce(getattr, section.split("."), Config())
    lines = [f"[{section}]  {_field_doc(section)}"]
    if section.split(".")[0] == "model":
        lines += textwrap.wrap(f"(defaults of flavor 'debug'; model.flavor, one of {', '.join(FLAVORS)}, fills every "
                               "key the recipe leaves out)", 116, initial_indent="  ", subsequent_indent="  ")
    for name in names:
        value, key = getattr(defaults, name), f"{section}.{name}"
        if is_dataclass(value):
            lines.append(f"  {name}: section [{key}], see --help {key}")
            continue
        bounds = next(f for f in fields(defaults) if f.name == name).metadata
        lines.append(f"  {name}: {_type_name(_hints(type(defaults))[name])} = {_toml_value(value)}"
                     + (f"  ({_rule(bounds)})" if bounds else ""))
        lines += textwrap.wrap(_field_doc(key), 116, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _type_name(field_type: Any) -> str:
    if get_origin(field_type) is Literal:
        return " | ".join(map(_toml_value, get_args(field_type)))
    return field_type.__name__


def _field_doc(key: str) -> str:
    """The docstring of the field at a section or key path."""
    *parents, name = key.split(".")
    parent = _field_type(".".join(parents)) if parents else Config
    return _attribute_docs(parent).get(name, "")


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its documentation), read once from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
