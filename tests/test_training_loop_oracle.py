"""The trainer against a minimal plain-PyTorch training loop written here: same model, AdamW, warmup -> flat ->
linear decay to the floor, gradient clipping, two micro-batches of gradient accumulation, same data batches.

The trainer runs through its public entry (`train.main`, CPU, fp32, the reference NSA backend); its losses,
gradient norms and evaluation losses come from its tensorboard events, its final parameters from `model.pt`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import train
from nsa_models import Transformer
from nsa_training.config import Config, load_config
from nsa_training.data import build_data_loader
from tests.helpers import REPO, event_files, scalars

STEPS, WARMUP, DECAY_RATIO, MIN_LR_RATIO = 6, 1, 0.6, 0.5
MAX_GRAD_NORM = 0.05  # below every step's gradient norm here: clipping acts on each step
EVAL_INTERVAL = 2
ARGS = ["--training.device", "cpu", "--training.mixed_precision", "fp32", "--model.nsa.backend", "reference",
        "--data.seq_len", "64", "--training.micro_batch_size", "2", "--training.global_batch_tokens", "256",
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", str(WARMUP),
        "--lr_scheduler.decay_ratio", str(DECAY_RATIO), "--lr_scheduler.decay_type", "linear",
        "--lr_scheduler.min_lr_ratio", str(MIN_LR_RATIO), "--training.max_grad_norm", str(MAX_GRAD_NORM),
        "--optimizer.lr", "3e-3", "--training.eval_interval", str(EVAL_INTERVAL), "--training.eval_batches", "2",
        "--metrics.log_freq", "1", "--checkpoint.interval", "100"]


def lr_factor(k: int) -> float:
    """Share of the peak LR of update k (0-based) of this recipe, spelled out: update 0 warms up at 1/2, updates
    1-2 are flat, the last round(0.6 * 5) = 3 (updates 3-5) fall linearly from 1 towards the 0.5 floor."""
    return {0: 0.5, 1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5 + 0.5 * 2 / 3, 5: 0.5 + 0.5 * 1 / 3}[k]


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())


def plain_loop(config: Config) -> dict:
    """Per-step losses and pre-clip gradient norms, evaluation losses and final parameters of the textbook loop."""
    cfg = config.training
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):  # allocated, not filled: init_weights() alone draws the weights, as in the trainer
        model = Transformer(config.model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    loader_args = dict(batch_size=cfg.micro_batch_size, dp_rank=0, dp_world_size=1, seed=cfg.seed)
    train_batches = build_data_loader(config.data, split="train", **loader_args)
    eval_loader = build_data_loader(config.data, split="eval", **loader_args)
    eval_batches = [next(eval_loader) for _ in range(cfg.eval_batches)]  # every evaluation reads these
    params = list(model.parameters())
    opt = config.optimizer
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  fused=True)  # PyTorch's kernel as the trainer's: foreach rounds apart (4e-7)
    accum = cfg.global_batch_tokens // (cfg.micro_batch_size * config.data.seq_len)
    assert accum == 2
    out = {"loss": {}, "grad_norm": {}, "eval": {}}
    for step in range(1, STEPS + 1):
        total = 0.0
        for _ in range(accum):
            loss = loss_of(model, next(train_batches)) / accum
            loss.backward()
            total += loss.item()
        out["loss"][step] = total
        out["grad_norm"][step] = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        for group in optimizer.param_groups:
            group["lr"] = opt.lr * lr_factor(step - 1)
        optimizer.step()
        optimizer.zero_grad()
        if step % EVAL_INTERVAL == 0:
            with torch.no_grad():
                out["eval"][step] = sum(loss_of(model, b).item() for b in eval_batches) / len(eval_batches)
    out["params"] = {name: p.detach().clone() for name, p in model.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """(the trainer's run, the plain loop's) for the same recipe."""
    run_dir = tmp_path_factory.mktemp("oracle") / "run"
    argv = [str(REPO / "recipes/debug.toml"), "--job.run_dir", str(run_dir), *ARGS]
    assert train.main(argv) == 0
    (events,) = event_files(run_dir)
    logged = scalars(events)
    trainer = {"loss": logged["train/loss"], "grad_norm": logged["train/grad_norm"], "eval": logged["eval/loss"],
               "params": torch.load(run_dir / "model.pt", map_location="cpu")}
    config, _ = load_config([str(run_dir / "config.toml")])  # as the run resolved it (the tokenizer's vocabulary)
    return trainer, plain_loop(config)


def assert_steps_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: logged at steps {sorted(got)}, expected {sorted(want)}"
    for step in want:  # tensorboard keeps fp32
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"{what} at step {step}: {got[step]} != {want[step]}"


def test_losses_and_gradient_norms_match_the_plain_loop(runs):
    trainer, oracle = runs
    assert min(oracle["grad_norm"].values()) > MAX_GRAD_NORM, "clipping must act for this test to guard it"
    assert_steps_close(trainer["loss"], oracle["loss"], "train/loss")
    assert_steps_close(trainer["grad_norm"], oracle["grad_norm"], "train/grad_norm")


def test_parameters_after_training_match_the_plain_loop(runs):
    trainer, oracle = runs
    assert trainer["params"].keys() == oracle["params"].keys()
    for name, want in oracle["params"].items():
        torch.testing.assert_close(trainer["params"][name], want, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_every_evaluation_reads_the_same_held_out_batches(runs):
    trainer, oracle = runs
    assert_steps_close(trainer["eval"], oracle["eval"], "eval/loss")
