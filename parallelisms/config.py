"""The recipe sections that the parallelisms own (`[parallelism]`, `[activation_checkpoint]`, `[compile]`,
`[float8]`), each field documented where it is declared. `nsa_training.config` composes them into a recipe's
`Config`, as it does `nsa_models.args.ModelArgs` for `[model]`; each `apply_*` receives only its own section.

A plan that cannot run here raises `PlanError`, one line naming the key and the fix; the trainer reports it as bad
input (`nsa_training.config.ConfigError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nsa_models.args import ModelArgs


class PlanError(ValueError):
    """A plan that cannot run here (`check_plan`, `apply_float8`): one line naming the key and the fix."""


@dataclass
class ParallelismConfig:
    data_parallel: Literal["ddp", "fsdp", "hsdp"] = "fsdp"
    """How data-parallel ranks hold the model: replicated (DDP), sharded per block (FSDP2), or sharded within
    `dp_replicate` replica groups (HSDP). Ignored with one process."""
    dp_replicate: int = field(default=1, metadata={"gt": 0})
    """Replica groups for HSDP (usually the node count); the shard degree is the data-parallel ranks /
    dp_replicate."""
    context_parallel_degree: int = field(default=1, metadata={"gt": 0})
    """Context parallelism (CP): the ranks of a group of this size share each sequence, every rank holding 2 of its
    2 x degree equal chunks (rank i chunks i and 2 x degree - 1 - i: each does the same causal work) and
    all-gathering every layer's keys and values. Must divide the world size; the data-parallel ranks are
    world_size / degree (the ranks of one CP group read the same batch, so training.global_batch_tokens counts
    each sequence once), and FSDP / DDP reduce gradients over data-parallel and CP ranks together. NSA with
    model.nsa.backend = 'reference' only (the triton kernels take no query offset yet), without
    data.document_mask or passkey; data.seq_len must split into 2 x degree chunks of whole selection blocks."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (less memory, one more all-gather per block in backward).
    `false` keeps every block's bf16 parameters gathered from forward to backward: for small models, whose steps
    are short, it halves the per-block collectives that both ranks wait on (nsa-125m on 2 x H100: weak-scaling
    efficiency 0.675 -> 0.931 with one micro-batch, 0.813 -> 0.968 with two; docs/PERFORMANCE.md)."""
    fsdp_accumulate_unsharded: bool = True
    """FSDP2/HSDP with several micro-batches per step: keep parameters gathered and gradients unsharded (fp32)
    across them, so one step all-gathers and reduce-scatters each block once; costs the whole model's bf16
    parameters plus fp32 gradients per GPU (set false for models where that does not fit: then every micro-batch
    gathers and reduce-scatters, and HSDP still all-reduces once per step). DDP always syncs once per step."""
    ddp_bucket_cap_mb: int = field(default=25, metadata={"gt": 0})
    """DDP gradient bucket size."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: `auto` is NCCL on CUDA and gloo on CPU."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "every_n", "selective_op"] = "none"
    """`full`: recompute every block; `every_n`: every N-th block; `selective_op`: keep matmul and attention
    outputs, recompute the cheap ops. Always non-reentrant; NSA's selected block indices are always saved."""
    every_n: int = field(default=2, metadata={"gt": 0})
    """N for `every_n`."""


@dataclass
class CompileConfig:
    enable: bool = False
    """torch.compile the model (and the loss)."""
    scope: Literal["block", "model"] = "block"
    """Compile each transformer block separately (fast compile, reused graph) or the whole model."""
    fullgraph: bool = True
    """Fail on any graph break instead of silently splitting the graph."""
    mode: Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "auto"
    """Inductor mode. `reduce-overhead` replays each compiled graph as a CUDA graph (one launch instead of one per
    kernel: an NSA block launches ~2.6x the kernels of a dense one, and at 2k a host enqueues them more slowly
    than an H100 runs them); `max-autotune` also benchmarks GEMM candidates (minutes of compile), with CUDA graphs;
    `max-autotune-no-cudagraphs` without them. `auto`: `reduce-overhead` where the plan allows CUDA graphs (a CUDA
    device, one process or DDP), else `default` (CPU, FSDP2 / HSDP); set `default` to turn CUDA graphs off."""
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """`inductor` generates the kernels; `aot_eager` stops after Dynamo and AOTAutograd (the same graphs, graph
    breaks and recompiles, run by eager ops): seconds instead of minutes of compile, for debugging graph breaks and
    recompiles and for the CPU tests that check them. `mode` is inductor's: aot_eager takes `auto` or `default`."""


@dataclass
class Float8Config:
    enable: bool = False
    """Train linear layers in float8 through torchao (needs a GPU of SM89 or newer)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe."""
    min_features: int = field(default=1024, metadata={"ge": 0})
    """Linears whose in or out features are below this stay in high precision (too small to gain)."""


def _check_query_offset(key: str, model: ModelArgs) -> None:
    """Raise PlanError unless the triton backend's chosen kernels take queries at an offset (a shard's queries start
    mid-sequence). Imported here, not at the top: only CP recipes on the triton backend need triton loaded."""
    try:
        from nsa_models.nsa.triton_backend import check_query_offset
    except ImportError:  # no triton here: `check_backend` names the fix when the model is built
        return
    try:
        check_query_offset(model.nsa)
    except ValueError as error:
        raise PlanError(f"{key}: {error}, or context_parallel_degree = 1") from None


def check_context_parallel(degree: int, model: ModelArgs, seq_len: int, document_mask: bool) -> None:
    """Raise PlanError (one line naming the key and the fix) for a CP degree this model or length cannot run."""
    if degree == 1:
        return
    key = f"parallelism.context_parallel_degree = {degree}"
    if model.attention != "nsa":
        raise PlanError(f"{key} needs NSA attention: dense attention (model.flavor = {model.flavor!r}) has no "
                        "context-parallel implementation here; use an NSA flavor or context_parallel_degree = 1")
    if model.nsa.backend == "triton":
        _check_query_offset(key, model)
    if document_mask:
        raise PlanError(f"{key} with data.document_mask = true is not implemented (document starts are not sharded): "
                        "set data.document_mask = false or context_parallel_degree = 1")
    # Whole selection blocks (multiples of the compression stride) per chunk: no block straddles two ranks' queries.
    chunk = 2 * degree * model.nsa.sel_block_size
    if seq_len % chunk:
        raise PlanError(f"data.seq_len = {seq_len} does not split into 2 x parallelism.context_parallel_degree = "
                        f"{2 * degree} chunks of whole selection blocks (model.nsa.sel_block_size = "
                        f"{model.nsa.sel_block_size}): make it a multiple of {chunk}")
