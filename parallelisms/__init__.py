"""Composable parallelisms applied to a plain `nsa_models.Transformer` from outside (the model never imports this)."""

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import CUDA_GRAPH_MODES, apply_compile, compile_counters, compile_loss, resolve_compile_mode
from parallelisms.config import PlanError, check_context_parallel
from parallelisms.context_parallel import apply_cp, shard_sequence
from parallelisms.data_parallel import apply_ddp, apply_fsdp, prepare_micro_batch
from parallelisms.float8 import apply_float8
from parallelisms.parallel_dims import ParallelDims, build_mesh
from parallelisms.parallelize import check_data_parallel, check_plan, parallelize

__all__ = ["CUDA_GRAPH_MODES", "ParallelDims", "PlanError", "apply_ac", "apply_compile", "apply_cp", "apply_ddp",
           "apply_float8", "apply_fsdp", "build_mesh", "check_context_parallel", "check_data_parallel", "check_plan",
           "compile_counters", "compile_loss", "parallelize", "prepare_micro_batch", "resolve_compile_mode",
           "shard_sequence"]
