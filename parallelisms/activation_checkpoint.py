"""Activation checkpointing of transformer blocks (non-reentrant, selective-checkpoint policies).

Every mode is a policy of `torch.utils.checkpoint.create_selective_checkpoint_contexts`, because the model names
ops whose outputs must always be saved (`nsa_models.nsa.AC_ALWAYS_SAVE_OPS`: NSA's block selection, which a
recomputation could change).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from nsa_models.nsa import AC_ALWAYS_SAVE_OPS, AC_SELECTIVE_SAVE_OPS
from parallelisms.config import ActivationCheckpointConfig

# `selective_op` also keeps the expensive outputs: matmuls (linears, the reference backend's einsums, float8's
# scaled mm and the `max` behind its tensorwise scales) and fused attention (the model's NSA kernels among it);
# everything else (norms, activations, rope, softmax) is recomputed.
_SELECTIVE_SAVE = AC_ALWAYS_SAVE_OPS | AC_SELECTIVE_SAVE_OPS | {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten.max.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch._higher_order_ops.flex_attention,
}


def _policy(save: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(save: frozenset):
    return create_selective_checkpoint_contexts(functools.partial(_policy, save))


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig) -> None:
    """Wrap the blocks of `model.layers` in place according to `cfg.mode`.

    `full` recomputes everything but the block selection; `every_n` does that for every N-th block only;
    `selective_op` keeps matmul and attention outputs as well.
    """
    if cfg.mode == "none":
        return
    save = _SELECTIVE_SAVE if cfg.mode == "selective_op" else AC_ALWAYS_SAVE_OPS
    for i, (name, block) in enumerate(model.layers.named_children()):
        if cfg.mode == "every_n" and (i + 1) % cfg.every_n:
            continue
        wrapped = checkpoint_wrapper(block, context_fn=functools.partial(_context_fn, save))
        model.layers.register_module(name, wrapped)
