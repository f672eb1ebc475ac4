"""Recipe configuration: one dataclass per section, each field documented where it is declared.

A recipe is a TOML file whose tables are these sections (`[training]`, `[model.nsa]`, ...); command-line
overrides `--section.key value` / `--section.key=value` win over the TOML, which wins over the defaults.
The `[model]` section is `nsa_models.ModelArgs`: its `flavor` supplies every model value the recipe leaves out.
"""

from __future__ import annotations

import difflib
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from nsa_models.args import FLAVORS, ModelArgs, get_flavor

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class ConfigError(Exception):
    """Bad user input (recipe, override, data path, impossible plan): one line naming the key and the fix.

    train.py prints `error: <message>` and exits with status 2, no traceback.
    """


@dataclass
class JobConfig:
    run_dir: str = "runs/debug"
    """Directory of this run: checkpoints, tensorboard events, the resolved config. Reusing it resumes."""
    description: str = ""
    """Free text shown in the resolved config and in tensorboard."""


@dataclass
class DataConfig:
    source: str = "embedded"
    """`embedded` (the corpus shipped with the repo), `synthetic` (seeded random tokens, for benchmarks), a
    local file or folder of .jsonl/.json/.parquet/.txt files, or `hf://NAME` to stream a hub dataset."""
    hf_config: str = ""
    """Configuration name of a hub dataset (`hf://` sources only)."""
    split: str = "train"
    """Split read for training."""
    eval_split: str = ""
    """Split read for evaluation; empty holds out `eval_fraction` of the training documents instead."""
    eval_fraction: float = 0.01
    """Share of documents held out for evaluation when `eval_split` is empty (0 < x < 1)."""
    text_field: str = "text"
    """Column that holds the document text (json/jsonl/parquet)."""
    tokenizer: str = "byte"
    """`byte` (UTF-8 bytes + EOS, no download) or the path of a HuggingFace `tokenizers` JSON file."""
    seq_len: int = 256
    """Tokens per training sequence; documents are packed with an EOS separator into seq_len+1 windows."""


@dataclass
class TrainingConfig:
    steps: int = 300
    """Optimizer steps to train for (the run's end, also when resuming)."""
    global_batch_tokens: int = 8192
    """Tokens per optimizer step over all data-parallel ranks; gradient accumulation makes up the rest."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    seed: int = 0
    """Seed of parameter init, data order and every RNG."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available, else CPU. `cuda` on a machine without a GPU is an error."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: `auto` is bf16 autocast on GPU and fp32 on CPU. Parameters and optimizer stay fp32."""
    eval_interval: int = 50
    """Evaluate the held-out loss every this many steps (0: never)."""
    eval_batches: int = 4
    """Micro-batches per evaluation."""
    max_skipped_steps: int = 5
    """A step whose loss or gradient norm is not finite is skipped (no update); stop after this many in a row."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    """Optimizer (AdamW, fused on CUDA)."""
    lr: float = 1e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms, biases, gates' biases)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak learning rate."""
    decay_ratio: float = 0.2
    """Share of all steps spent decaying at the end (WSD); 1.0 decays right after warmup."""
    decay_type: Literal["linear", "cosine"] = "cosine"
    """Shape of the decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a share of the peak."""


@dataclass
class ParallelismConfig:
    data_parallel: Literal["ddp", "fsdp", "hsdp"] = "fsdp"
    """How data-parallel ranks hold the model: replicated (DDP), sharded per block (FSDP2), or sharded within
    `dp_replicate` replica groups (HSDP). Ignored with one process."""
    dp_replicate: int = 1
    """Replica groups for HSDP (usually the node count); the shard degree is world_size / dp_replicate."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (less memory, one more all-gather in backward)."""
    ddp_bucket_cap_mb: int = 25
    """DDP gradient bucket size."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: `auto` is NCCL on CUDA and gloo on CPU."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "every_n", "selective_op"] = "none"
    """`full`: recompute every block; `every_n`: every N-th block; `selective_op`: keep matmul and attention
    outputs, recompute the cheap ops. Always non-reentrant; NSA's selected block indices are always saved."""
    every_n: int = 2
    """N for `every_n`."""


@dataclass
class CompileConfig:
    enable: bool = False
    """torch.compile the model (and the loss)."""
    scope: Literal["block", "model"] = "block"
    """Compile each transformer block separately (fast compile, reused graph) or the whole model."""
    fullgraph: bool = True
    """Fail on any graph break instead of silently splitting the graph."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """Inductor mode. `reduce-overhead` replays each compiled graph as a CUDA graph (one launch instead of one per
    kernel: for steps where the host's launch work, not the GPU, is the limit); `max-autotune` also benchmarks
    GEMM candidates (minutes of compile), with CUDA graphs; `max-autotune-no-cudagraphs` without them."""


@dataclass
class Float8Config:
    enable: bool = False
    """Train linear layers in float8 through torchao (needs a GPU of SM89 or newer)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe."""
    min_features: int = 1024
    """Linears whose in or out features are below this stay in high precision (too small to gain)."""


@dataclass
class CheckpointConfig:
    enable: bool = True
    """Write checkpoints (torch.distributed.checkpoint) into `<run_dir>/checkpoints`."""
    interval: int = 100
    """Steps between checkpoints; one is also written at the end."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted once a newer one is complete (0 keeps all)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory if there is one."""
    load_path: str = ""
    """Resume from this checkpoint directory instead (weights, optimizer, schedule, data and RNG state)."""
    export_weights: bool = True
    """At the end, also write the model weights alone as one file `<run_dir>/model.pt`."""


@dataclass
class MetricsConfig:
    log_freq: int = 10
    """Console line and tensorboard scalars every this many steps."""
    tensorboard: bool = True
    """Write tensorboard events to `<run_dir>/tb`."""
    log_rank: int = 0
    """Rank whose console lines are printed (run.sh's LOG_RANK filters torchrun's output too)."""
    nsa_stats_freq: int = 50
    """NSA health telemetry to tensorboard every this many steps (0: never; dense models have none): per layer,
    tags `nsa/<stat>/layer<i>` for the gate means (`gate_cmp`, `gate_slc`, `gate_win`), the share of selected
    blocks that are forced (`forced_share`), the selected blocks' mean and max distance from the query in
    selection blocks (`slc_distance_blocks`, `slc_distance_max`), the entropy of the compressed attention
    (`cmp_entropy`, nats), and the histogram `nsa/slc_distance_hist/layer<i>`. Computed inside every forward (cheap,
    no sync); read from the log rank's last micro-batch of the step."""


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a torch.profiler trace of steps start_step .. start_step+num_steps-1 into `<run_dir>/profile`."""
    start_step: int = 5
    """First profiled step."""
    num_steps: int = 3
    """Profiled steps."""


@dataclass
class DebugConfig:
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) and deterministic cuDNN/cuBLAS settings."""
    hang_timeout_s: float = 1800.0
    """Exit (status 3) with every thread's stack in `<run_dir>/hang/rank<R>.txt` when no step completes for this
    many seconds; long enough for compilation and a checkpoint save. 0 disables the watchdog."""
    init_timeout_s: float = 1800.0
    """Timeout of process-group setup and of every collective until the first step completes: that step includes
    compilation and checkpoint loading, which ranks finish at different times."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective after the first step: when a rank dies or stalls, the others exit within this
    long (status 5, one line; on NCCL torch aborts them and dumps `<run_dir>/flight_recorder/rank<R>`)."""
    memory_snapshot: bool = False
    """Record the CUDA allocator's history (slows training) and dump it into `<run_dir>/memory` for
    https://pytorch.org/memory_viz: `rank<R>_step<N>.pickle` after step `debug.memory_snapshot_step`, and
    `rank<R>_oom.pickle` on out-of-memory. Needs CUDA."""
    memory_snapshot_step: int = 3
    """Step after which the memory snapshot is dumped (0: only on out-of-memory)."""
    fault_rank: int = -1
    """Testing only: the rank that `debug.sleep_at_step` and `debug.die_at_step` hit (-1: every rank)."""
    die_at_step: int = 0
    """Testing only: the process kills itself (SIGKILL) in this step (0: never), to exercise how the others end."""
    sleep_at_step: int = 0
    """Testing only: sleep `debug.sleep_s` seconds in this step (0: never), to exercise the hang watchdog."""
    sleep_s: float = 0.0
    """Testing only: how long step `debug.sleep_at_step` sleeps."""
    nan_at_step: int = 0
    """Testing only: make this step's loss NaN (0: never), to exercise the non-finite step guard."""
    nan_steps: int = 1
    """Testing only: how many consecutive steps from `debug.nan_at_step` get a NaN loss."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=lambda: get_flavor("debug"))  # what load_config([]) resolves to
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


# ---------------------------------------------------------------------------------------------------------------
# Loading: recipe TOML + command-line overrides -> Config, validated.

# One rule per key: (what must hold, test). Checked before the cross-field rules and ModelArgs.validate().
_POSITIVE = ("must be > 0", lambda v: v > 0)
_NON_NEGATIVE = ("must be >= 0", lambda v: v >= 0)
_OPEN_FRACTION = ("must be between 0 and 1, exclusive", lambda v: 0 < v < 1)
_FRACTION = ("must be between 0 and 1", lambda v: 0 <= v <= 1)
_BETA = ("must be in [0, 1)", lambda v: 0 <= v < 1)
_RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "data.eval_fraction": _OPEN_FRACTION,
    "data.seq_len": _POSITIVE,
    "training.steps": _POSITIVE,
    "training.global_batch_tokens": _POSITIVE,
    "training.micro_batch_size": _POSITIVE,
    "training.max_grad_norm": _NON_NEGATIVE,
    "training.seed": _NON_NEGATIVE,
    "training.eval_interval": _NON_NEGATIVE,
    "training.eval_batches": _POSITIVE,
    "training.max_skipped_steps": _POSITIVE,
    "optimizer.lr": _POSITIVE,
    "optimizer.beta1": _BETA,
    "optimizer.beta2": _BETA,
    "optimizer.eps": _POSITIVE,
    "optimizer.weight_decay": _NON_NEGATIVE,
    "lr_scheduler.warmup_steps": _NON_NEGATIVE,
    "lr_scheduler.decay_ratio": _FRACTION,
    "lr_scheduler.min_lr_ratio": _FRACTION,
    "parallelism.dp_replicate": _POSITIVE,
    "parallelism.ddp_bucket_cap_mb": _POSITIVE,
    "activation_checkpoint.every_n": _POSITIVE,
    "float8.min_features": _NON_NEGATIVE,
    "checkpoint.interval": _POSITIVE,
    "checkpoint.keep": _NON_NEGATIVE,
    "metrics.log_freq": _POSITIVE,
    "metrics.log_rank": _NON_NEGATIVE,
    "metrics.nsa_stats_freq": _NON_NEGATIVE,
    "profiling.start_step": _POSITIVE,
    "profiling.num_steps": _POSITIVE,
    "debug.hang_timeout_s": _NON_NEGATIVE,
    "debug.init_timeout_s": _POSITIVE,
    "debug.collective_timeout_s": _POSITIVE,
    "debug.memory_snapshot_step": _NON_NEGATIVE,
    "debug.fault_rank": ("must be >= -1", lambda v: v >= -1),
    "debug.die_at_step": _NON_NEGATIVE,
    "debug.sleep_at_step": _NON_NEGATIVE,
    "debug.sleep_s": _NON_NEGATIVE,
    "debug.nan_at_step": _NON_NEGATIVE,
    "debug.nan_steps": _POSITIVE,
    "model.dim": _POSITIVE,
    "model.n_layers": _POSITIVE,
    "model.n_heads": _POSITIVE,
    "model.n_kv_heads": _POSITIVE,
    "model.head_dim": _POSITIVE,
    "model.vocab_size": _POSITIVE,
    "model.ffn_hidden": _NON_NEGATIVE,
    "model.norm_eps": _POSITIVE,
    "model.rope_theta": _POSITIVE,
    "model.max_seq_len": _POSITIVE,
    "model.init_std": _POSITIVE,
    "model.nsa.cmp_block_size": _POSITIVE,
    "model.nsa.cmp_stride": _POSITIVE,
    "model.nsa.sel_block_size": _POSITIVE,
    "model.nsa.cmp_mlp_hidden": _NON_NEGATIVE,
}


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
    return config, print_config


def validate(config: Config) -> None:
    """Raise ConfigError for the first value or combination that cannot run."""
    flat = config_to_dict(config)
    for key, (rule, holds) in _RANGES.items():
        if not holds(flat[key]):
            raise ConfigError(f"{key} = {_show(flat[key])}: {rule}")

    t, data = config.training, config.data
    if config.lr_scheduler.warmup_steps >= t.steps:
        raise ConfigError(f"lr_scheduler.warmup_steps = {config.lr_scheduler.warmup_steps}: must be < "
                          f"training.steps ({t.steps}); lower it or train longer")
    if data.seq_len > config.model.max_seq_len:
        raise ConfigError(f"data.seq_len = {data.seq_len} exceeds model.max_seq_len = {config.model.max_seq_len}: "
                          "lower data.seq_len or raise model.max_seq_len")
    micro_batch_tokens = t.micro_batch_size * data.seq_len
    if t.global_batch_tokens % micro_batch_tokens:
        raise ConfigError(f"training.global_batch_tokens = {t.global_batch_tokens}: must be a multiple of "
                          f"training.micro_batch_size * data.seq_len = {micro_batch_tokens} (times the "
                          "data-parallel size)")
    if config.parallelism.dp_replicate > 1 and config.parallelism.data_parallel != "hsdp":
        raise ConfigError(f"parallelism.dp_replicate = {config.parallelism.dp_replicate} needs "
                          f"parallelism.data_parallel = 'hsdp' (it is {config.parallelism.data_parallel!r}); "
                          "set it or use dp_replicate = 1")
    if config.float8.enable and t.device == "cpu":
        raise ConfigError("float8.enable = true needs a GPU of SM89 or newer: set training.device = 'cuda' "
                          "or float8.enable = false")
    if config.debug.deterministic and config.model.attention == "nsa" and config.model.nsa.float_atomics:
        raise ConfigError("model.nsa.float_atomics = true contradicts debug.deterministic = true (float atomics "
                          "make the backward non-repeatable): set one of them to false")
    try:
        config.model.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """Every value as a flat `{"section.key": value}` dict (tensorboard hparams, validation)."""
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
    return float(value) if field_type is float else value
