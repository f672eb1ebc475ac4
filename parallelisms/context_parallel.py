"""Context parallelism (CP) for NSA: the ranks of a CP group share each sequence, for sequences whose activations
one device cannot hold.

The sequence is cut into 2 x cp equal chunks and rank i holds chunks i and 2 x cp - 1 - i (causal load balancing,
as TorchTitan: every rank gets one early and one late chunk, so the same share of the causal work); the trainer
shards inputs and labels that way (`shard_sequence`). In every layer the ranks all-gather the keys and values
(few heads: far less than the hidden states) into the whole sequence, which compression needs whole (its blocks
straddle the chunks). Each rank then computes the compressed keys of the whole sequence and attends with its own
queries at their global positions: the compressed branch, the top-n selection (local: a query's selection depends
only on its own compressed scores) and the window, whose keys in earlier chunks are in the gathered sequence.
The all-gather's backward reduce-scatters the key/value gradients back to the ranks that own them. The NSA core
runs the configured backend once for both chunks, as the rows of one batch with the pair of their first positions
(`nsa_attention(..., q_start=(first, second))`): the reference, or the triton kernels with the FlexAttention (or
SDPA) window, whose mask the model's pre-hook builds.

Gradients: each rank's loss is the mean over its tokens, and every shard holds as many labelled tokens (no
padding: `data.document_mask` is refused), so the mean of the CP ranks' gradients is the one-process gradient;
FSDP / DDP reduce over the data-parallel and CP ranks together (`ParallelDims`' "dp_shard_cp" / "dp_cp").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from nsa_models.model import NSACore, SequenceKV
from nsa_models.nsa import nsa_attention, window_mask
from nsa_models.telemetry import TelemetryInputs


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that `rank` holds: one early, one late."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """This rank's part of `x` [B, T, ...]: its two chunks along dim 1, in order (T a multiple of 2 x cp)."""
    chunks = x.chunk(2 * mesh.size(), dim=1)
    return torch.cat([chunks[i] for i in _chunks(mesh.size(), mesh.get_local_rank())], dim=1)


def _gather_sequence(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """The whole sequence [B, T, ...] from every rank's shard [B, T / cp, ...] (`shard_sequence`), differentiable:
    the backward reduce-scatters the gradient (each rank gets the sum of every rank's gradient for its shard)."""
    cp = mesh.size()
    # Sequence first: the autograd all-gather concatenates along dim 0 only. Rank order: rank r's two chunks.
    gathered = funcol.all_gather_tensor_autograd(x.movedim(1, 0).contiguous(), gather_dim=0, group=mesh)
    pieces = gathered.unflatten(0, (2 * cp, -1))
    where = {chunk: 2 * rank + i for rank in range(cp) for i, chunk in enumerate(_chunks(cp, rank))}
    return torch.cat([pieces[where[chunk]] for chunk in range(2 * cp)]).movedim(0, 1)


class GatheredKV(SequenceKV):
    """SequenceKV that all-gathers the CP group's keys and values into the whole sequence (one collective)."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return _gather_sequence(torch.cat([k, v], dim=2), self.mesh).chunk(2, dim=2)


def _chunk_rows(x: Tensor, chunks: int) -> Tensor:
    """[B, chunks * C, ...] -> [B * chunks, C, ...]: row b * chunks + i holds chunk i of sequence b."""
    return x.unflatten(1, (chunks, -1)).flatten(0, 1)


def _sequence_rows(tensors: list[Tensor], chunks: int) -> list[Tensor]:
    """Each [B, ...] tensor with every row repeated for its sequence's chunks (the same tensor given twice, e.g. the
    shared keys of two branches, is copied once)."""
    copies: list[tuple[Tensor, Tensor]] = []
    for x in tensors:
        if not any(x is seen for seen, _ in copies):
            copies.append((x, x.repeat_interleave(chunks, dim=0)))
    return [next(copy for seen, copy in copies if x is seen) for x in tensors]


class ShardNSACore(NSACore):
    """NSACore for a shard's queries (its two chunks) against the gathered sequence: one call of the configured NSA
    backend whose batch rows are the chunks (row 2b + i: chunk i of sequence b, with sequence b's keys and values
    repeated for both) and whose q_start is the pair of the chunks' first positions (even rows, odd rows), so that
    each chunk's causal masks, window and top-n candidates are those of its global positions. One call instead of
    one per chunk halves the layer's NSA kernel launches."""

    def __init__(self, core: NSACore, mesh: DeviceMesh):
        super().__init__(core.nsa)
        self.cp = mesh.size()
        self.chunks = _chunks(self.cp, mesh.get_local_rank())
        self.window_mask: BlockMask | None = None

    def _offsets(self, seq_len: int) -> tuple[int, int]:
        C = seq_len // (2 * self.cp)
        first, second = self.chunks
        return first * C, second * C

    def build_window_mask(self, seq_len: int, batch: int, device: torch.device) -> None:
        """The chunks' FlexAttention window mask for `batch` sequences of seq_len tokens (None where the backend
        needs none). The model's pre-hook calls it, outside compiled and checkpointed code: built inside a
        checkpointed compiled block a mask fails in Dynamo, and the model builds none for a part of a sequence.
        Eager masks are cached: the same object every step, so compiled blocks that read it do not recompile."""
        self.window_mask = window_mask(seq_len // (2 * self.cp), self.nsa, device, q_start=self._offsets(seq_len),
                                       kv_len=seq_len, batch=2 * batch)

    def forward(self, q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
                v_cmp: Tensor, gates: Tensor, window_mask: BlockMask | None = None,
                doc_start: Tensor | None = None) -> tuple[Tensor, TelemetryInputs]:
        """NSACore's outputs for the shard's queries, the telemetry inputs at their global positions. The model
        passes no window_mask for a part of a sequence: the chunks take theirs (`build_window_mask`). doc_start is
        None: `parallelisms.config.check_context_parallel` refuses data.document_mask."""
        B, C, seq_len = q.shape[0], q.shape[1] // 2, k_slc.shape[1]
        kv = _sequence_rows([k_slc, v_slc, k_win, v_win, k_cmp, v_cmp], 2)
        out, idx, entropy = nsa_attention(_chunk_rows(q, 2), *kv, _chunk_rows(gates, 2), self.nsa,
                                          window_mask=self.window_mask, q_start=self._offsets(seq_len))
        # back to the shard's order: out [B, 2C, HQ, D], block indices [B, H, 2C, n], entropy [B, 2C, HQ]
        out, entropy = (x.unflatten(0, (B, 2)).flatten(1, 2) for x in (out, entropy))
        idx = idx.unflatten(0, (B, 2)).transpose(1, 2).flatten(2, 3)
        positions = torch.cat([torch.arange(chunk * C, (chunk + 1) * C, device=q.device) for chunk in self.chunks])
        return out, TelemetryInputs(gates.detach(), idx, entropy, positions=positions, seq_len=seq_len)


def _pass_positions(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the model: the global positions of the shard's tokens (its RoPE rows), and the NSA
    cores' window mask for the whole sequence's length."""
    tokens = args[0]
    seq_len = tokens.shape[1] * mesh.size()
    positions = torch.arange(seq_len, device=tokens.device)
    kwargs["positions"] = shard_sequence(positions[None], mesh)[0]
    for core in module.modules():
        if isinstance(core, ShardNSACore):
            core.build_window_mask(seq_len, tokens.shape[0], tokens.device)
    return args, kwargs


def apply_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Context parallelism over `mesh` (the "cp" dimension) in place: every NSA layer all-gathers its keys and
    values and attends with its shard's queries at their global positions; the model's forward gets the shard's
    token positions. The model then takes `shard_sequence(tokens)` and returns the shard's logits. Apply it to the
    plain model, before AC, compile and FSDP / DDP (`parallelize`); `parallelisms.config.check_context_parallel`
    says what it runs."""
    for block in model.layers.values():
        attention = block.attention
        attention.kv = GatheredKV(mesh)
        attention.core = ShardNSACore(attention.core, mesh)
    model.register_forward_pre_hook(functools.partial(_pass_positions, mesh), with_kwargs=True)
