"""torch.compile of the model (per block or whole) and of the loss, plus the counters the trainer logs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo.utils import counters

from nsa_models.nsa.flex import BlockMaskStorage
from parallelisms.config import CompileConfig

# Inductor modes that replay the compiled graphs as CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def resolve_compile_mode(cfg: CompileConfig, *, device_type: str, data_parallel: str,
                         world_size: int) -> CompileConfig:
    """`cfg` with mode `auto` made concrete: `reduce-overhead` (CUDA graphs) where the plan allows them, on CUDA
    with one process or DDP; `default` on other devices and under FSDP2 / HSDP, whose per-step all-gathers into new
    storage CUDA graphs cannot replay (`check_data_parallel`). Any other mode is returned as it is."""
    if cfg.mode != "auto":
        return cfg
    graphs = device_type == "cuda" and (world_size == 1 or data_parallel == "ddp")
    return dataclasses.replace(cfg, mode="reduce-overhead" if graphs else "default")


def _compile(fn: Callable, cfg: CompileConfig) -> Callable:
    # dynamic=False: shapes are fixed per run (static shapes give the best kernels); a new shape just recompiles.
    # An unresolved `auto` (a caller that knows no plan) compiles as `default`: CUDA graphs only where the plan
    # says they are safe (the trainer resolves `auto` first).
    if cfg.backend != "inductor":  # modes are inductor's (check_compile)
        return torch.compile(fn, fullgraph=cfg.fullgraph, backend=cfg.backend, dynamic=False)
    mode = "default" if cfg.mode == "auto" else cfg.mode
    return torch.compile(fn, fullgraph=cfg.fullgraph, mode=mode, dynamic=False)


def apply_compile(model: nn.Module, cfg: CompileConfig) -> None:
    """Compile in place: each block of `model.layers` (scope `block`) or the model's forward (scope `model`).

    Per block, every block reuses one graph (fast compile) and FSDP/DDP hooks, applied later around each block,
    stay outside the compiled code; with CUDA graphs the model's document masks, built between the graphs, keep
    their addresses (`Transformer.mask_storage`), or the graphs would record again at every batch. The
    whole-model scope compiles `forward` only, so hooks on the root module (DDP) also stay eager; per-block FSDP
    hooks would split it, which check_plan rejects.
    """
    if cfg.scope == "block":
        for name, block in model.layers.named_children():
            model.layers.register_module(name, _compile(block, cfg))
        if cfg.backend == "inductor" and cfg.mode in CUDA_GRAPH_MODES:  # masks built between the graphs
            model.mask_storage = BlockMaskStorage()
    else:
        model.forward = _compile(model.forward, cfg)


def compile_loss(loss_fn: Callable, cfg: CompileConfig) -> Callable:
    """`loss_fn` compiled when compile is enabled (fuses the logits' log-softmax), else unchanged."""
    return _compile(loss_fn, cfg) if cfg.enable else loss_fn


def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide totals so far: graph breaks, graphs compiled, graphs that a CUDA-graph mode ran
    without CUDA graphs (Inductor skips them, with a log line, for graphs it cannot capture), and the inputs of the
    CUDA graphs recorded (it rises with every recording: after warm-up, a graph recorded again because an input it
    takes as static moved, which torch does not log by default).

    torch keeps no recompile counter: once every block and the loss have compiled (step 1), any further rise of
    `graphs_compiled` is a recompile, so the trainer compares two readings.
    """
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs_compiled": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_recorded_inputs": counters["inductor"]["cudagraph_recorded_non_static_inputs"],
    }
