"""Models that leave the repo: a run's checkpoint as a transformers model directory (safetensors), and back.

An export directory holds `model.safetensors` (the weights under `model.`), `config.json` (an `NSATitanConfig`:
the run's ModelArgs, its tokenizer and the `auto_map` of the modeling file), `modeling_nsa_titan.py` (a copy of
`nsa_models/hf_modeling.py`), `tokenizer.json` and `tokenizer_config.json`. Importing one writes a run directory
whose step-0 checkpoint `train.py` resumes (fine-tunes) from, in the trainer's own checkpoint format.

transformers and safetensors are the optional extra `hf`: `require_hf()` names it when they are missing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from nsa_models.args import ModelArgs
from nsa_models.model import Transformer
from nsa_training.checkpoint import ModelState
from nsa_training.config import ConfigError, load_config, validate
from nsa_training.inference import load_run
from nsa_training.tokenizer import build_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
INSTALL_HINT = "pip install -e '.[hf]'"


def require_hf() -> None:
    """ConfigError (one line naming the `hf` extra) unless transformers and safetensors are installed and recent
    enough for `nsa_models.hf_modeling`."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"exports need transformers and safetensors ({error.name or error} is not installed): "
                          f"{INSTALL_HINT}") from None
    try:
        import nsa_models.hf_modeling  # noqa: F401  (checks the transformers version)
    except ImportError as error:
        raise ConfigError(f"{error}: {INSTALL_HINT}") from None


def portable(args: ModelArgs) -> ModelArgs:
    """`args` as an export carries them: NSA on the `reference` backend, which runs anywhere, without the triton
    backend's kernel choices (the loading machine may have none of them). The model is the same."""
    return dataclasses.replace(args, nsa=args.nsa.on_reference())


def export_model(model: Transformer, tokenizer: str, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write `model` (trained with the tokenizer spec `tokenizer`: `byte` or a tokenizers JSON file) into `out` as
    a transformers model directory."""
    from safetensors.torch import save_file

    from nsa_models import hf_modeling

    out.mkdir(parents=True, exist_ok=True)
    # copy=True: tied weights share storage, which safetensors refuses to write.
    weights = {f"model.{name}": t.detach().to(dtype=dtype, copy=True) for name, t in model.state_dict().items()}
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    eos_id = build_tokenizer(tokenizer).eos_id
    _write_tokenizer(tokenizer, eos_id, out, model.args.max_seq_len)
    config = hf_modeling.NSATitanConfig(
        model_args=dataclasses.asdict(portable(model.args)), tokenizer="byte" if tokenizer == "byte" else TOKENIZER,
        eos_token_id=eos_id, pad_token_id=eos_id, dtype=str(dtype).removeprefix("torch."),
        auto_map={"AutoConfig": f"{hf_modeling.MODULE_NAME}.NSATitanConfig",
                  "AutoModelForCausalLM": f"{hf_modeling.MODULE_NAME}.NSATitanForCausalLM"})
    config.save_pretrained(out)
    shutil.copyfile(hf_modeling.__file__, out / f"{hf_modeling.MODULE_NAME}.py")


def _write_tokenizer(spec: str, eos_id: int, out: Path, max_seq_len: int) -> None:
    """tokenizer.json (the run's file, or the byte tokenizer as a tokenizers JSON) and tokenizer_config.json, for
    transformers' AutoTokenizer."""
    from tokenizers import Tokenizer

    if spec == "byte":
        (out / TOKENIZER).write_text(_byte_tokenizer().to_str(pretty=True))
    else:
        shutil.copyfile(spec, out / TOKENIZER)
    eos_token = Tokenizer.from_file(str(out / TOKENIZER)).id_to_token(eos_id)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
                        "pad_token": eos_token, "model_max_length": max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def _byte_tokenizer():
    """`ByteTokenizer` as a tokenizers Tokenizer: byte b is id b, EOS `<|endoftext|>` is id 256. The ByteLevel
    pre-tokenizer maps each byte to a printable character (GPT-2's alphabet); with no merges, each is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = iter(range(256, 512))  # the other bytes, in order, take the characters from 256 up
    vocab = {chr(b) if b in printable else chr(next(others)): b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])  # id 256 = ByteTokenizer.eos_id: the next free id
    return tokenizer


def export_run(run_dir: Path, out: Path, dtype: torch.dtype = torch.float32, step: int | None = None) -> Path:
    """Export checkpoint `step` of the run (None: the newest that verifies) into `out`; returns the checkpoint."""
    require_hf()
    model, _, config, path = load_run(run_dir, torch.device("cpu"), step)  # on the reference backend
    export_model(model, config.data.tokenizer, out, dtype)
    return path


def import_export(export_dir: Path, run_dir: Path, train_args: list[str]) -> Path:
    """Write the export in `export_dir` into the new run directory `run_dir` as a step-0 checkpoint of the run
    `train_args` (a recipe and overrides, as train.py takes them) describes, with the export's model and tokenizer.
    Returns the checkpoint's path; `./run.sh` with the same arguments and `--job.run_dir run_dir` resumes it."""
    require_hf()
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from nsa_models.hf_modeling import NSATitanConfig
    from nsa_training.trainer import Trainer  # builds exactly the states a training run saves and resumes

    if not (export_dir / "config.json").is_file() or not (export_dir / WEIGHTS).is_file():
        raise ConfigError(f"{str(export_dir)!r} is not an export: it needs config.json and {WEIGHTS}")
    if (run_dir / "checkpoints").exists():
        raise ConfigError(f"--run-dir {str(run_dir)!r} already holds checkpoints: import into a new run directory")
    try:
        values = json.loads((export_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{export_dir / 'config.json'}: unreadable ({error})") from None
    if values.get("model_type") != NSATitanConfig.model_type:
        raise ConfigError(f"{export_dir / 'config.json'} describes a {values.get('model_type')!r} model, not an "
                          f"{NSATitanConfig.model_type!r} export of this repo")
    hf_config = NSATitanConfig.from_dict(values)
    config, _ = load_config([*train_args, "--job.run_dir", str(run_dir)])
    config.model = hf_config.nsa_model_args()
    config.data.tokenizer = hf_config.tokenizer
    if hf_config.tokenizer != "byte":  # the run reads its tokenizer from its own directory from now on
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(export_dir / hf_config.tokenizer, run_dir / TOKENIZER)
        config.data.tokenizer = str((run_dir / TOKENIZER).resolve())
    validate(config)
    try:
        weights = load_file(str(export_dir / WEIGHTS))
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{export_dir / WEIGHTS}: unreadable ({error})") from None
    trainer = Trainer(config)  # makes its own process group
    try:
        try:
            ModelState(trainer.model).load_state_dict({name.removeprefix("model."): t for name, t in weights.items()})
        except (RuntimeError, KeyError) as error:
            raise ConfigError(f"{export_dir / WEIGHTS} does not fit its config.json "
                              f"({' '.join(str(error).split())})") from None
        trainer.checkpointer.save(0, trainer.states, final=True)
        return trainer.checkpointer.complete_checkpoints()[-1]
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()
