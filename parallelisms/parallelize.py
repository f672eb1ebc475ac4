"""The whole plan: validate it (`check_plan`), then apply float8 -> CP -> AC -> compile -> FSDP2/DDP
(`parallelize`)."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import CUDA_GRAPH_MODES, apply_compile
from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig, PlanError
from parallelisms.context_parallel import apply_cp
from parallelisms.data_parallel import apply_ddp, apply_fsdp
from parallelisms.float8 import apply_float8
from parallelisms.parallel_dims import ParallelDims


def check_plan(parallelism: ParallelismConfig, ac: ActivationCheckpointConfig, compile: CompileConfig,
               float8: Float8Config, *, world_size: int, device_type: str,
               gpu_capability: tuple[int, int] | None) -> None:
    """Raise PlanError for a plan that cannot run here; call it before creating any process group.

    `ac` is part of the plan for completeness: every activation-checkpoint setting combines with the rest.
    """
    if parallelism.dist_backend == "nccl" and device_type != "cuda":
        raise PlanError(f"parallelism.dist_backend = 'nccl' needs CUDA (device is {device_type}): "
                        "set it to 'gloo' or 'auto'")
    check_data_parallel(parallelism, compile, world_size)
    if compile.enable and compile.mode in CUDA_GRAPH_MODES and device_type != "cuda":
        # Inductor would quietly skip the CUDA graphs on another device: say so instead.
        raise PlanError(f"compile.mode = '{compile.mode}' replays CUDA graphs, which need CUDA (device is "
                        f"{device_type}): use 'default' or 'max-autotune-no-cudagraphs'")
    if float8.enable:
        if device_type != "cuda":
            raise PlanError(f"float8.enable = true needs a CUDA GPU of SM89 or newer (device is {device_type}): "
                            "set float8.enable = false")
        if gpu_capability is None or gpu_capability < (8, 9):
            raise PlanError(f"float8.enable = true needs SM89 or newer (this GPU is SM{_sm(gpu_capability)}): "
                            "set float8.enable = false")


def _sm(capability: tuple[int, int] | None) -> str:
    return "?" if capability is None else f"{capability[0]}{capability[1]}"


def check_data_parallel(parallelism: ParallelismConfig, compile: CompileConfig, world_size: int) -> None:
    """The plan rules that depend on the process count: the launcher checks them before start. The degrees must
    fit `world_size` (`ParallelDims.from_config`); the data-parallel keys count only with several processes."""
    ParallelDims.from_config(parallelism, world_size)
    if world_size == 1:
        return
    if parallelism.data_parallel == "hsdp" and parallelism.dp_replicate == 1:
        raise PlanError("parallelism.dp_replicate = 1 makes parallelism.data_parallel = 'hsdp' plain FSDP: "
                        "set dp_replicate to the node count or data_parallel = 'fsdp'")
    if parallelism.data_parallel in ("fsdp", "hsdp") and compile.enable:
        # FSDP2 all-gathers into new storage every step and frees it after use: CUDA graphs replay fixed
        # addresses, so they would read freed memory.
        if compile.mode in CUDA_GRAPH_MODES:
            raise PlanError(f"compile.mode = '{compile.mode}' uses CUDA graphs, which cannot capture "
                            f"parallelism.data_parallel = '{parallelism.data_parallel}': "
                            "use 'default' or 'max-autotune-no-cudagraphs'")
        if compile.scope == "model":
            raise PlanError(f"compile.scope = 'model' with parallelism.data_parallel = "
                            f"'{parallelism.data_parallel}': the per-block FSDP hooks would split the graph; "
                            "use compile.scope = 'block'")


def parallelize(model: nn.Module, parallelism: ParallelismConfig, ac: ActivationCheckpointConfig,
                compile: CompileConfig, float8: Float8Config, mesh: ParallelDims | None,
                mixed_precision_dtype: torch.dtype) -> nn.Module:
    """Apply the plan in place (the model may be on the meta device) and return the model. `mesh`: the run's
    layout with its mesh built (`build_mesh`); None or one process: no CP, FSDP or DDP.

    The order matters:
    1. float8 first: it swaps nn.Linear modules, and the later steps must wrap, trace and shard the final ones.
    2. CP before AC and compile: it swaps each attention's parameter-free key/value and core modules inside the
       blocks, and the checkpoint wrapper and compile must wrap (and trace) the blocks that contain the final ones.
       It also adds a forward pre-hook to the root module, which FSDP's root hooks then run after.
    3. AC before compile: compile then traces the checkpointed block, and the partitioner applies the
       save/recompute policy inside the graph; the other way round the policy would only see opaque compiled code.
    4. compile before FSDP/DDP: they wrap the compiled blocks, so their collectives run eagerly between the
       compiled graphs instead of being traced (or breaking the graph).
    5. FSDP2 (`mixed_precision_dtype` is the parameter dtype of compute; gradients are reduced in fp32), or
       DDP (parameters stay fp32: the trainer's autocast does mixed precision), over the data-parallel and CP
       ranks together: CP ranks hold the same parameters and each computes part of the gradient.
    """
    if float8.enable:
        apply_float8(model, float8)
    distributed = mesh is not None and mesh.world_mesh is not None
    if distributed and mesh.cp > 1:
        apply_cp(model, mesh.mesh("cp"))
    apply_ac(model, ac)
    if compile.enable:
        apply_compile(model, compile)
    if distributed:
        if parallelism.data_parallel == "ddp":
            apply_ddp(model, mesh.mesh("dp_cp"), parallelism.ddp_bucket_cap_mb)
        else:
            dims = ("dp_replicate", "dp_shard_cp") if parallelism.data_parallel == "hsdp" else ("dp_shard_cp",)
            apply_fsdp(model, mesh.mesh(*dims), param_dtype=mixed_precision_dtype, reduce_dtype=torch.float32,
                       reshard_after_forward=parallelism.reshard_after_forward)
    return model
