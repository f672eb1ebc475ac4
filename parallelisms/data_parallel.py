"""Data parallelism: the device mesh, FSDP2 / HSDP (`fully_shard`) and DDP (composable `replicate`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nsa_training.config import ParallelismConfig


def build_mesh(cfg: ParallelismConfig, world_size: int, device_type: str) -> DeviceMesh | None:
    """1-D "dp" mesh for ddp/fsdp, 2-D ("dp_replicate", "dp_shard") for hsdp; None for one process.

    Needs an initialised default process group of `world_size` ranks; check_plan has validated the degrees.
    """
    if world_size == 1:
        return None
    if cfg.data_parallel == "hsdp":
        shape = (cfg.dp_replicate, world_size // cfg.dp_replicate)
        return init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool) -> None:
    """FSDP2 in place: each block is one all-gather / reduce-scatter unit, the root holds the rest.

    A 2-D mesh gives HSDP: parameters are sharded over "dp_shard" and replicated over "dp_replicate".
    On CPU, initialise the model before sharding: DTensor has no CPU RNG tracker, so init_weights() on a
    sharded meta-device model would fill every rank's shard with the same numbers.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
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
