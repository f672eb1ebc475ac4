"""Gradient accumulation on 2 gloo ranks, for tests/test_grad_accum.py.

Launched as `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/accum_worker.py OUT.json
PLAN...`: each PLAN trains the debug model STEPS steps of SGD twice from the same initialisation, once with each
rank's share of the global batch as one micro-batch and once as ACCUM micro-batches (the loss divided by ACCUM, as
the trainer does, with `prepare_micro_batch` before each), and rank 0 writes, per plan, the largest difference
between the two runs' final parameters, how far the parameters moved, and the collectives each micro-batch
issued (counted by CommDebugMode, which sees every c10d op, DDP's C++ reducer included).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig  # noqa: E402
from parallelisms import build_mesh, parallelize, prepare_micro_batch  # noqa: E402
from tests.dist.train_worker import build_model, global_batches  # noqa: E402

STEPS, ACCUM, LR = 3, 2, 0.5

PLANS = {
    "ddp": ParallelismConfig(data_parallel="ddp"),
    "fsdp": ParallelismConfig(data_parallel="fsdp"),
    "fsdp_sharded_accumulation": ParallelismConfig(data_parallel="fsdp", fsdp_accumulate_unsharded=False),
    # Two replicas of one shard each: the cross-replica all-reduce is the only gradient collective of HSDP here.
    "hsdp_2x1_sharded_accumulation": ParallelismConfig(data_parallel="hsdp", dp_replicate=2,
                                                       fsdp_accumulate_unsharded=False),
}
REDUCTIONS = ("allreduce", "reduce_scatter")  # op names that reduce gradients (all_reduce, _reduce_scatter_base_, ...)


def count(comm: CommDebugMode, names: tuple[str, ...]) -> int:
    """Collectives of `comm` whose op name contains one of `names` (underscores ignored)."""
    return sum(n for op, n in comm.get_comm_counts().items()
               if any(name.replace("_", "") in str(op).replace("_", "") for name in names))


def train(cfg: ParallelismConfig, accum: int, rank: int, world_size: int) -> tuple[list[torch.Tensor], list]:
    """Final full parameters and, per step, per micro-batch, (gradient reductions, all-gathers)."""
    mesh = build_mesh(cfg, world_size, "cpu")
    model = build_model(apply_plan=lambda m: parallelize(m, cfg, ActivationCheckpointConfig(), CompileConfig(),
                                                         Float8Config(), mesh, torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # plain SGD: the update is the gradient, scale and all
    collectives = []
    for window in global_batches(STEPS, model.args.vocab_size):
        per_micro_batch = []
        for index, micro in enumerate(window.chunk(world_size)[rank].chunk(accum)):
            prepare_micro_batch(model, cfg, index, accum)
            with CommDebugMode() as comm:
                loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten()) / accum
                loss.backward()
            per_micro_batch.append((count(comm, REDUCTIONS), count(comm, ("allgather",))))
        optimizer.step()
        optimizer.zero_grad()
        collectives.append(per_micro_batch)
    params = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
    return params, collectives


def main(out: str, plans: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    initial = [p.detach() for p in build_model().parameters()]
    results = {}
    for name in plans:
        whole, _ = train(PLANS[name], 1, rank, world_size)
        accumulated, collectives = train(PLANS[name], ACCUM, rank, world_size)
        results[name] = {
            "max_diff": max((a - w).abs().max().item() for a, w in zip(accumulated, whole)),
            "moved": max((w - i).abs().max().item() for w, i in zip(whole, initial)),
            "collectives": collectives}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)  # as train.exit_now: gloo can abort a finished process at interpreter teardown
