"""Data parallelism: FSDP2 / HSDP (`fully_shard`), DDP (composable `replicate`), and what each does between the
micro-batches of one optimizer step (`prepare_micro_batch`). `parallelize` picks their meshes (`ParallelDims`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from parallelisms.config import ParallelismConfig


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool) -> None:
    """FSDP2 in place: each block is one all-gather / reduce-scatter unit, the root holds the rest.

    A 2-D mesh gives HSDP: parameters are sharded over its second dimension ("dp_shard_cp") and replicated over
    its first ("dp_replicate").
    Apply it to the meta-device model: `Transformer.init_weights()` then fills each rank's shards with its part of
    the weights one process would draw, whatever the mesh.
    """
    # cast_forward_inputs off: by default every FSDP module casts its floating inputs to param_dtype, which would
    # round the fp32 rope table each block takes to bf16; the activations are already param_dtype (the embedding's
    # output), the token ids are integers.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root (embeddings, final norm, output head) is used last in forward and first in backward: keeping it
    # gathered after forward saves an all-gather that backward would do at once.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: int) -> None:
    """DDP in place through the composable `replicate`.

    `replicate` rather than wrapping in DistributedDataParallel: parameter names stay those of the plain model
    (no `module.` prefix), so DCP state dicts match FSDP's and the single-process run's, and DDP is built at
    the first forward, after the meta-device model has been materialised and initialised. No
    find_unused_parameters: every parameter is used each step. Mixed precision is the trainer's bf16 autocast.
    """
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)


def prepare_micro_batch(model: nn.Module, cfg: ParallelismConfig, index: int, count: int) -> None:
    """Set what the data-parallel wrapper communicates for micro-batch `index` of the `count` that make one
    optimizer step; call it before that micro-batch's forward. A no-op for one micro-batch or one process.

    Gradients are reduced once per step, in the last micro-batch's backward, as if the step were one big
    micro-batch: the earlier backwards only accumulate into local gradients (DDP: `no_sync`; FSDP2: unsharded
    fp32 gradients, no reduce-scatter). FSDP2 also keeps every block's parameters gathered from the first
    micro-batch's forward to the last one's backward, so a step all-gathers each block once instead of twice per
    micro-batch. Both cost the whole model's unsharded bf16 parameters and fp32 gradients on every GPU;
    `parallelism.fsdp_accumulate_unsharded = false` gives that memory back and reduce-scatters every micro-batch
    (HSDP's all-reduce across replicas still waits for the last).
    """
    if count == 1:
        return
    is_last = index == count - 1
    if isinstance(model, FSDPModule):
        if not cfg.fsdp_accumulate_unsharded:
            model.set_requires_all_reduce(is_last)  # only HSDP all-reduces; plain FSDP ignores it
            return
        model.set_requires_gradient_sync(is_last)
        # Resharding after forward would only make backward gather again what the next micro-batch keeps anyway.
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(is_last)
    elif isinstance(model, DDP):
        model.set_requires_gradient_sync(is_last)
