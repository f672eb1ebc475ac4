"""AdamW and the warmup -> stable -> decay (WSD) learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from nsa_training.config import LRSchedulerConfig, OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, fused (one kernel for all parameters, on CUDA and CPU alike): the
    trainer skips a non-finite step's update through its `found_inf`, on the device, without a host sync."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def lr_multiplier(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Share of the peak LR after `step` optimizer steps: linear warmup, flat, then the last `decay_ratio`
    of the steps decay to `min_lr_ratio` (linear or cosine)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = max(1, round(cfg.decay_ratio * (total_steps - cfg.warmup_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    shape = 1.0 - progress if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                           cfg: OptimizerConfig) -> None:
    """Give an optimizer and schedule restored from a checkpoint the current `cfg`: its hyper-parameters, and
    `cfg.lr` as the peak of the schedule, which continues from its step with the current shape (its multipliers
    are always the current config's: a checkpoint holds only the step and the peak)."""
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):
        group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=weight_decay, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, multiplier in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.lr * multiplier(scheduler.last_epoch)
