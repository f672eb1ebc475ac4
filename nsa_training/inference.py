"""A trained run, loaded for inference: its model settings, tokenizer and latest checkpoint's weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from nsa_models.model import Transformer
from nsa_training.checkpoint import CheckpointManager, ModelState
from nsa_training.config import Config, ConfigError, load_config
from nsa_training.tokenizer import Tokenizer, build_tokenizer


def load_run(run_dir: Path, device: torch.device) -> tuple[Transformer, Tokenizer, Config, Path]:
    """The run's model with the weights of its latest complete checkpoint, its tokenizer, config and checkpoint."""
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no config.toml: give the job.run_dir of a training run")
    config, _ = load_config([str(run_dir / "config.toml")])
    config.checkpoint.resume, config.checkpoint.load_path = True, ""  # this run's own latest checkpoint
    if not dist.is_initialized():  # checkpoints are torch.distributed.checkpoint directories: one-process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    checkpoints = CheckpointManager(config.checkpoint, run_dir)
    path = checkpoints.resume_path()  # the newest one that verifies
    if path is None:
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no complete checkpoint yet: train it longer than "
                          "checkpoint.interval steps (or until it ends)")
    config.model.nsa.backend = "reference" if device.type == "cpu" else config.model.nsa.backend
    with torch.device(device):
        model = Transformer(config.model)
    model.init_weights(buffer_device=device)  # buffers (RoPE); the weights come from the checkpoint
    checkpoints.load(path, {"model": ModelState(model)})
    return model.eval(), build_tokenizer(config.data.tokenizer), config, path
