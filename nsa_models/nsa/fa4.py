"""FlashAttention-4 (package flash-attn-4, module `flash_attn.cute`: Hopper/Blackwell kernels written in the
CUTLASS CuTe DSL) for two NSA branches, as torch custom ops: the sliding window (branch 5) and, with its queries
packed as heads, the compressed attention (branch 1).

`flash_attn.cute.flash_attn_func` is an autograd.Function that compiles its kernels on first use, which Dynamo
cannot trace; FA4's causal forward and backward are wrapped here as ops with fake implementations, so a compiled
NSA block keeps 0 graph breaks. The backward runs FA4's deterministic mode (its dQ/dK/dV accumulation serialised in
a fixed order), as every other NSA kernel here: bitwise repeatable, measured up to 17% slower than its atomic mode
(docs/KERNELS.md); `model.nsa.float_atomics` opts in to the atomic mode. Written against
flash-attn-4 4.0.0b36, whose `_flash_attn_fwd` / `_flash_attn_bwd` are the functions its autograd.Function calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _kernels():
    from flash_attn.cute import interface

    return interface


def _window_left(window: int) -> int | None:
    return window - 1 if window > 0 else None  # 0: no window, plain causal


@torch.library.custom_op("nsa::fa4_causal_fwd", mutates_args=())
def fa4_causal_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
                   deterministic: bool) -> tuple[Tensor, Tensor]:
    """Causal attention o [B, Tq, HQ, D], query i over keys j <= i + Tk - Tq (FA's bottom-right alignment) and, with
    window > 0, j > i + Tk - Tq - window; and the natural-log lse [B, HQ, Tq] (fp32). deterministic: the mode of
    the backward. q, k, v need a contiguous last dim only (packed query views pass as they are)."""
    out, lse, *_ = _kernels()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True,
                                              window_size_left=_window_left(window), window_size_right=0,
                                              return_lse=True)
    return out, lse


@fa4_causal_fwd.register_fake
def _(q, k, v, window, scale, deterministic):
    B, T, HQ, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, HQ, T, dtype=torch.float32)


@torch.library.custom_op("nsa::fa4_causal_bwd", mutates_args=())
def fa4_causal_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
                   window: int, scale: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (dlse: the lse's cotangent, or None); bitwise repeatable when deterministic, else accumulated
    with float atomics (faster)."""
    return tuple(_kernels()._flash_attn_bwd(
        q, k, v, o, do, lse, scale, True, 0.0, window_size_left=_window_left(window), window_size_right=0,
        deterministic=deterministic, dlse=dlse))


@fa4_causal_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, window, scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.window, ctx.scale, ctx.deterministic = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*fa4_causal_bwd(do, q, k, v, o, lse, dlse, ctx.window, ctx.scale, ctx.deterministic), None, None,
            None)


fa4_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, deterministic: bool = True) -> Tensor:
    """Attention of q [B, T, HQ, D] over keys t-window+1 .. t of k, v [B, T, H, D] (H dividing HQ); [B, T, HQ, D].
    deterministic=False: a backward with float atomics (faster, not bitwise repeatable)."""
    # Contiguous once here: the op saves its inputs for the backward, which then needs no copies of its own.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return fa4_causal_fwd(q, k, v, window, q.shape[-1] ** -0.5, deterministic)[0]


def fa4_compressed_attention(q: Tensor, k: Tensor, v: Tensor, block: int, stride: int, scale: float,
                             deterministic: bool = True) -> tuple[Tensor, Tensor]:
    """NSA compressed attention through FA4's causal kernel: o [B, T, HQ, D] and the natural-log lse [B, T, HQ]
    (fp32; -inf where no block is visible), as `triton_compressed.compressed_attention_fwd`. k, v: [B, Nc, H, D]
    compressed keys/values; block l must be a multiple of stride d.

    Query t = d tau + r sees compressed block i iff i d + l - 1 <= t, that is i <= tau - l/d for r < d - 1 and
    i <= tau - l/d + 1 for r = d - 1. Viewing q as [B, T/d, d * HQ, D] (the d queries of a run as heads, a view)
    makes each of those two groups of rows a plain causal attention over positions tau: the group with offset c
    takes positions tau >= c against Nk = (its positions) keys, so that FA's bottom-right causal mask is j <=
    tau - c. Each key/value head is repeated once per packed query row r, so that FA's grouping of query heads
    (head r HQ + h G + g reads key head (r H + h)) stays the model's. Positions past T (T padded to a multiple of
    d) and the zero keys padded past Nc are never visible to real queries."""
    B, T, HQ, D = q.shape
    n_cmp, H = k.shape[1], k.shape[2]
    n_pos = -(-T // stride)
    if n_pos * stride != T:
        q = F.pad(q, (0, 0, 0, 0, 0, n_pos * stride - T))
    q_runs = q.view(B, n_pos, stride, HQ, D)
    bulk_offset = block // stride  # positions; the last row of a run sees one more block
    outs, lses = [], []
    for r0, r1, offset in ((0, stride - 1, bulk_offset), (stride - 1, stride, bulk_offset - 1)):
        R, n = r1 - r0, n_pos - offset
        if R == 0:  # stride 1: every query is the last of its run
            continue
        if n <= 0:  # T too short: these rows see no block
            outs.append(q.new_zeros(B, n_pos, R, HQ, D))
            lses.append(q.new_full((B, n_pos, R, HQ), float("-inf"), dtype=torch.float32))
            continue
        kv = [(x[:, :n] if n <= n_cmp else F.pad(x, (0, 0, 0, 0, 0, n - n_cmp))).unsqueeze(2)
              .expand(B, n, R, H, D).reshape(B, n, R * H, D) for x in (k, v)]
        o, lse = fa4_causal_fwd(q_runs[:, offset:, r0:r1].reshape(B, n, R * HQ, D), *kv, 0, scale, deterministic)
        outs.append(F.pad(o.view(B, n, R, HQ, D), (0, 0, 0, 0, 0, 0, offset, 0)))
        lses.append(F.pad(lse.view(B, R, HQ, n).permute(0, 3, 1, 2), (0, 0, 0, 0, offset, 0), value=float("-inf")))
    o = torch.cat(outs, 2).view(B, n_pos * stride, HQ, D)[:, :T]
    if n_pos < bulk_offset:
        # No group ran (T <= l - d): k and v are empty. Keep them in the graph, as the Triton op does, since DDP
        # expects every parameter of phi to receive a gradient.
        o = o + 0 * (k.sum() + v.sum()).to(o.dtype)
    # reshape, not view: cat may give its result the permuted strides of the groups' lse
    return o, torch.cat(lses, 2).reshape(B, n_pos * stride, HQ)[:, :T]
