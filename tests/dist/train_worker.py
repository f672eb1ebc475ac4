"""Tiny-model training loop shared by tests/test_parallelisms.py and its 2-process runs.

Imported by the test for the single-process reference; launched as
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/train_worker.py OUT.json STEPS PLAN...`
it trains every named PLAN in turn (same seed, same global batch) and rank 0 writes {plan: per-step [loss, grad norm]}.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_models import Transformer, get_flavor  # noqa: E402
from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig  # noqa: E402
from nsa_training.trainer import build_model as build_planned_model  # noqa: E402
from parallelisms import build_mesh, parallelize  # noqa: E402

SEQ_LEN, GLOBAL_BATCH = 64, 4

PLANS = {
    "ddp": (ParallelismConfig(data_parallel="ddp"), ActivationCheckpointConfig(), CompileConfig()),
    "fsdp": (ParallelismConfig(data_parallel="fsdp"), ActivationCheckpointConfig(), CompileConfig()),
    "hsdp_2x1": (ParallelismConfig(data_parallel="hsdp", dp_replicate=2), ActivationCheckpointConfig(),
                 CompileConfig()),
    "hsdp_1x2": (ParallelismConfig(data_parallel="hsdp", dp_replicate=1), ActivationCheckpointConfig(),
                 CompileConfig()),
    "ddp_full_ac_compile": (ParallelismConfig(data_parallel="ddp"), ActivationCheckpointConfig(mode="full"),
                            CompileConfig(enable=True, scope="block", fullgraph=True)),
    "ddp_compile_model": (ParallelismConfig(data_parallel="ddp"), ActivationCheckpointConfig(),
                          CompileConfig(enable=True, scope="model", fullgraph=True)),
}


def build_model(flavor: str = "debug", seed: int = 0, apply_plan: Callable[[Transformer], object] | None = None
                ) -> Transformer:
    """The flavor with max_seq_len = SEQ_LEN on CPU, planned by `apply_plan` (default: none, one process) and
    initialised from `seed` as the trainer does it (nsa_training.trainer.build_model)."""
    args = get_flavor(flavor)
    args.max_seq_len = SEQ_LEN
    torch.manual_seed(seed)
    return build_planned_model(args, torch.device("cpu"), apply_plan or (lambda model: None))


def global_batches(steps: int, vocab_size: int, seed: int = 1) -> list[torch.Tensor]:
    """[GLOBAL_BATCH, SEQ_LEN + 1] token windows per step."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator) for _ in range(steps)]


def train_losses(model: torch.nn.Module, steps: int, rank: int = 0, world_size: int = 1) -> list[list[float]]:
    """Per-step [global-batch loss, global gradient norm] of AdamW training with clipping.

    Each rank takes its slice of every global batch. The gradient norm is compared too because AdamW's update
    barely depends on the gradients' scale: losses alone would miss a sum-instead-of-mean reduction.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    history = []
    for window in global_batches(steps, model.args.vocab_size):
        window = window.chunk(world_size)[rank]
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        history.append([loss.item(), grad_norm.item()])
    return history


def main(out: str, plans: list[str], steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in plans:
        parallelism, ac, compile = PLANS[name]
        mesh = build_mesh(parallelism, world_size, "cpu")
        model = build_model(apply_plan=partial(parallelize, parallelism=parallelism, ac=ac, compile=compile,
                                               float8=Float8Config(), mesh=mesh, mixed_precision_dtype=torch.float32))
        results[name] = train_losses(model, steps, rank, world_size)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:], steps=int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # as train.exit_now: gloo can abort a finished process at interpreter teardown
