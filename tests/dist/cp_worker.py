"""Context-parallel training of the debug model at T = 1024, shared by tests/test_context_parallel.py and its
2-process runs.

Imported by the test for the single-process reference (`train`); launched as
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/cp_worker.py OUT STEPS PLAN...` it trains
every named PLAN in turn (same seed, same batches; both ranks are one CP group, so both read the whole batch and
keep their part of the sequence) and rank 0 writes OUT.json {plan: per-step [loss, grad norm]} and OUT.pt
{plan: {parameter: full gradient of step 1}}.
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
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_models import Transformer, get_flavor  # noqa: E402
from nsa_training.trainer import build_model as build_planned_model  # noqa: E402
from parallelisms import build_mesh, parallelize, shard_sequence  # noqa: E402
from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig  # noqa: E402
from parallelisms.context_parallel import ShardNSACore, _pass_positions  # noqa: E402

SEQ_LEN, BATCH = 1024, 2



def drop_rope_positions(model: nn.Module) -> None:
    """Control: the shard's tokens get RoPE positions 0 .. T/cp - 1 instead of their global ones."""
    for key, hook in list(model._forward_pre_hooks.items()):
        if getattr(hook, "func", None) is _pass_positions:
            del model._forward_pre_hooks[key]


def drop_query_offset(model: nn.Module) -> None:
    """Control: both chunks of a shard's queries attend as if they were the sequence's first."""
    for module in model.modules():
        if isinstance(module, ShardNSACore):
            module.chunks = (0, 0)


# Each control breaks one part of the algorithm after the plan is applied: its losses must differ.
CONTROLS = {"no_rope_positions": drop_rope_positions, "no_query_offset": drop_query_offset}
# plan -> (data_parallel, activation checkpointing, compile, control)
PLANS = {
    "fsdp": ("fsdp", ActivationCheckpointConfig(), CompileConfig(), None),
    "ddp": ("ddp", ActivationCheckpointConfig(), CompileConfig(), None),
    "fsdp_full_ac": ("fsdp", ActivationCheckpointConfig(mode="full"), CompileConfig(), None),
    "fsdp_compile": ("fsdp", ActivationCheckpointConfig(), CompileConfig(enable=True, fullgraph=True), None),
    **{f"fsdp_{name}": ("fsdp", ActivationCheckpointConfig(), CompileConfig(), name) for name in CONTROLS},
}


def build_model(apply_plan: Callable[[Transformer], object] | None = None) -> Transformer:
    """The debug flavor with max_seq_len = SEQ_LEN on CPU, planned by `apply_plan` (default: none), seed 0."""
    args = get_flavor("debug")
    args.max_seq_len = SEQ_LEN
    torch.manual_seed(0)
    return build_planned_model(args, torch.device("cpu"), apply_plan or (lambda model: None))


def batches(steps: int, vocab_size: int) -> list[Tensor]:
    """[BATCH, SEQ_LEN + 1] token windows per step."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(vocab_size, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(steps)]


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's whole gradient (FSDP's DTensor shards gathered)."""
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in model.named_parameters()}


def train(model: nn.Module, steps: int, shard: Callable[[Tensor], Tensor] = lambda x: x
          ) -> tuple[list[list[float]], dict[str, Tensor]]:
    """Per-step [loss over the whole batch, gradient norm] of AdamW training with clipping, and step 1's gradients.
    `shard` keeps this rank's part of the sequence of inputs and labels."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    history, grads = [], {}
    for window in batches(steps, model.args.vocab_size):
        logits = model(shard(window[:, :-1]))
        loss = F.cross_entropy(logits.flatten(0, 1), shard(window[:, 1:]).flatten())
        loss.backward()
        grads = grads or full_grads(model)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every shard holds as many tokens: the mean of means
        history.append([loss.item(), grad_norm.item()])
    return history, grads


def main(out: str, plans: list[str], steps: int) -> None:
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    losses, grads = {}, {}
    for name in plans:
        data_parallel, ac, compile, control = PLANS[name]
        parallelism = ParallelismConfig(data_parallel=data_parallel, context_parallel_degree=world_size)
        mesh = build_mesh(parallelism, world_size, "cpu")
        model = build_model(partial(parallelize, parallelism=parallelism, ac=ac, compile=compile,
                                    float8=Float8Config(), mesh=mesh, mixed_precision_dtype=torch.float32))
        if control is not None:
            CONTROLS[control](model)
        losses[name], grads[name] = train(model, steps, partial(shard_sequence, mesh=mesh.mesh("cp")))
    if dist.get_rank() == 0:
        Path(out + ".json").write_text(json.dumps(losses))
        torch.save(grads, out + ".pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:], steps=int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # as train.exit_now: gloo can abort a finished process at interpreter teardown
