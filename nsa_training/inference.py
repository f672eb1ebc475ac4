"""A trained run, loaded for inference (its model settings, tokenizer and latest checkpoint's weights) and scored
on passkey retrieval."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from nsa_models.model import Transformer, document_alignment
from nsa_training.checkpoint import CheckpointManager, ModelState
from nsa_training.config import Config, ConfigError, load_config
from nsa_training.data import build_data_loader
from nsa_training.passkey import PasskeyScore, depths, evaluate_passkey, filler_tokens, passkey_lengths
from nsa_training.tokenizer import Tokenizer, build_tokenizer


def load_run(run_dir: Path, device: torch.device,
             step: int | None = None) -> tuple[Transformer, Tokenizer, Config, Path]:
    """The run's model with the weights of checkpoint `step` (None: the newest that verifies), its tokenizer, config
    and the checkpoint's path; ConfigError for a run directory without such weights."""
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no config.toml: give the job.run_dir of a training run")
    config, _ = load_config([str(run_dir / "config.toml")])
    config.checkpoint.resume = True
    # A given step goes through the manager's load_path, which verifies the checkpoint like any resume.
    config.checkpoint.load_path = "" if step is None else str(run_dir / "checkpoints" / f"step-{step:08d}")
    if step is not None and not Path(config.checkpoint.load_path).is_dir():
        raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of that step")
    with _one_process_group():
        checkpoints = CheckpointManager(config.checkpoint, run_dir)
        path = checkpoints.resume_path()
        if path is None:
            raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no complete checkpoint yet: train it longer than "
                              "checkpoint.interval steps (or until it ends)")
        if device.type == "cpu":  # a GPU run's kernel choices do not apply to the reference: the same model without
            config.model.nsa = config.model.nsa.on_reference()
        with torch.device(device):
            model = Transformer(config.model)
        model.init_weights(buffer_device=device)  # buffers (RoPE); the weights come from the checkpoint
        checkpoints.load(path, {"model": ModelState(model)})
    return model.eval(), build_tokenizer(config.data.tokenizer), config, path


@contextmanager
def _one_process_group() -> Iterator[None]:
    """A one-process gloo group for the checkpoint manager (checkpoints are torch.distributed.checkpoint directories
    and its methods are collective), unless one exists; removed again on exit, so that a later Trainer can make its
    own."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def score_passkey(run_dir: Path, *, min_length: int, n_depths: int, samples: int, key_digits: int, seed: int,
              device: torch.device) -> tuple[list[PasskeyScore], Path]:
    """Passkey scores of the run's latest checkpoint, as the trainer's `[passkey]` evaluation scores (at lengths
    `min_length` doubling up to its data.seq_len), and the checkpoint's path; ConfigError for a run that cannot be
    scored so."""
    model, tokenizer, config, path = load_run(run_dir, device)
    seq_len = config.data.seq_len
    if not 0 < min_length <= seq_len:
        raise ConfigError(f"--min-length {min_length}: must be between 1 and the run's data.seq_len ({seq_len})")
    # The trainer's held-out loader on one rank: the same filler, so the same samples as its evaluations.
    loader = build_data_loader(config.data, split="eval", batch_size=config.training.micro_batch_size,
                               dp_rank=0, dp_world_size=1, seed=config.training.seed,
                               doc_align=document_alignment(config.model))
    filler = filler_tokens(loader, seq_len + 1)
    scores = evaluate_passkey(model, tokenizer, filler, passkey_lengths(min_length, seq_len), depths(n_depths),
                              samples=samples, key_digits=key_digits, seed=seed, device=device)
    return scores, path
