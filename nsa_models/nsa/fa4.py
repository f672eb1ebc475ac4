"""FlashAttention-4 (package flash-attn-4, module `flash_attn.cute`: Hopper/Blackwell kernels written in the
CUTLASS CuTe DSL) for two NSA branches, as torch custom ops: the sliding window (branch 5) and, with its queries
packed as heads, the compressed attention (branch 1).

`flash_attn.cute.flash_attn_func` is an autograd.Function that compiles its kernels on first use, which Dynamo
cannot trace; FA4's causal forward and backward are wrapped here as ops with fake implementations, so a compiled
NSA block keeps 0 graph breaks. The backward runs FA4's deterministic mode (its dQ/dK/dV accumulation serialised in
a fixed order), as every other NSA kernel here: bitwise repeatable, measured up to 17% slower than its atomic mode
(docs/KERNELS.md); `model.nsa.float_atomics` opts in to the atomic mode. Written against
flash-attn-4 4.0.0b36, whose `_flash_attn_fwd` / `_flash_attn_bwd` are the functions its autograd.Function calls.

Packed documents reach FA4 as its variable-length sequences (`varlen`): the window one sequence per document, the
compressed branch one per document of its packed runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_models.nsa.varlen import document_cu_seqlens


def _kernels():
    from flash_attn.cute import interface

    return interface


def _window_left(window: int) -> int | None:
    return window - 1 if window > 0 else None  # 0: no window, plain causal


@torch.library.custom_op("nsa::fa4_causal_fwd", mutates_args=())
def fa4_causal_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float, deterministic: bool,
                   cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                   seqused: Tensor | None = None, max_seqlen_q: int = 0,
                   max_seqlen_k: int = 0) -> tuple[Tensor, Tensor]:
    """Causal attention o [B, Tq, HQ, D], query i over keys j <= i + Tk - Tq (FA's bottom-right alignment) and, with
    window > 0, j > i + Tk - Tq - window; and the natural-log lse [B, HQ, Tq] (fp32). deterministic: the mode of
    the backward. q, k, v need a contiguous last dim only (packed query views pass as they are).

    Variable length: q [total_q, HQ, D], k, v [total_k, H, D] hold sequences b at rows cu_seqlens_q[b] ..
    (cu_seqlens_k[b] ..) of length cu_seqlens_*[b + 1] - cu_seqlens_*[b], or seqused[b] (queries and keys alike)
    when given; o [total_q, HQ, D], lse [HQ, total_q]; rows outside every sequence (seqused shorter than the
    cu_seqlens span) are left unwritten."""
    out, lse, *_ = _kernels()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused, seqused_k=seqused,
        max_seqlen_q=max_seqlen_q or None, max_seqlen_k=max_seqlen_k or None, softmax_scale=scale, causal=True,
        window_size_left=_window_left(window), window_size_right=0, return_lse=True)
    return out, lse


@fa4_causal_fwd.register_fake
def _(q, k, v, window, scale, deterministic, cu_seqlens_q=None, cu_seqlens_k=None, seqused=None, max_seqlen_q=0,
      max_seqlen_k=0):
    if cu_seqlens_q is not None:
        return q.new_empty(q.shape), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, T, HQ, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, HQ, T, dtype=torch.float32)


@torch.library.custom_op("nsa::fa4_causal_bwd", mutates_args=())
def fa4_causal_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
                   window: int, scale: float, deterministic: bool, cu_seqlens_q: Tensor | None = None,
                   cu_seqlens_k: Tensor | None = None, seqused: Tensor | None = None, max_seqlen_q: int = 0,
                   max_seqlen_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (dlse: the lse's cotangent, or None); bitwise repeatable when deterministic, else accumulated
    with float atomics (faster). The varlen arguments as `fa4_causal_fwd`'s; rows outside every sequence get zero
    gradients (FA4 writes only the sequences' rows: they start as zeros here, not as whatever memory was free)."""
    grads = [torch.zeros_like(x) for x in (q, k, v)] if seqused is not None else [None] * 3
    return tuple(_kernels()._flash_attn_bwd(
        q, k, v, o, do, lse, scale, True, 0.0, window_size_left=_window_left(window), window_size_right=0,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused, seqused_k=seqused,
        max_seqlen_q=max_seqlen_q or None, max_seqlen_k=max_seqlen_k or None, deterministic=deterministic,
        dq=grads[0], dk=grads[1], dv=grads[2], dlse=dlse))


@fa4_causal_bwd.register_fake
def _(do, q, k, v, o, lse, dlse, window, scale, deterministic, cu_seqlens_q=None, cu_seqlens_k=None, seqused=None,
      max_seqlen_q=0, max_seqlen_k=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.window, ctx.scale, ctx.deterministic, *varlen = inputs
    ctx.varlen = varlen  # cu_seqlens_q, cu_seqlens_k, seqused (tensors or None), max_seqlen_q, max_seqlen_k
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    grads = fa4_causal_bwd(do, q, k, v, o, lse, dlse, ctx.window, ctx.scale, ctx.deterministic, *ctx.varlen)
    return *grads, None, None, None, None, None, None, None, None


fa4_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, deterministic: bool = True,
                         doc_start: Tensor | None = None, align: int = 1) -> Tensor:
    """Attention of q [B, T, HQ, D] over keys t-window+1 .. t of k, v [B, T, H, D] (H dividing HQ); [B, T, HQ, D].
    deterministic=False: a backward with float atomics (faster, not bitwise repeatable). doc_start [B, T] (packed
    documents starting at multiples of `align`): the window stops at each query's document start."""
    # Contiguous once here: the op saves its inputs for the backward, which then needs no copies of its own.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = q.shape[-1] ** -0.5
    if doc_start is None:
        return fa4_causal_fwd(q, k, v, window, scale, deterministic)[0]
    T = doc_start.shape[1]
    cu_seqlens = document_cu_seqlens(doc_start, align)
    out = fa4_causal_fwd(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), window, scale, deterministic,
                         cu_seqlens, cu_seqlens, None, T, T)[0]
    return out.view(q.shape)


def _document_runs(doc_start: Tensor, align: int, stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed documents in runs of `stride` positions (P = ceil(T / stride) runs per row): each document's row,
    first run and past-the-end run ([B * ceil(T / align)] each; unused slots last, as empty documents of row B),
    and each run's document's first run [B, P]."""
    T = doc_start.shape[1]
    cu_seqlens = document_cu_seqlens(doc_start, align).long()
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]  # a document ends where the next starts (each row starts one)
    row = starts // T
    return (row, (starts - row * T) // stride, -(-(ends - row * T) // stride),
            doc_start[:, ::stride].long() // stride)


def _compressed_group(q_runs: Tensor, kv: list[Tensor], offset: int, scale: float, deterministic: bool,
                      documents: tuple[Tensor, Tensor, Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """One group of `fa4_compressed_attention`'s query rows: q_runs [B, P, R, HQ, D] at runs tau >= offset (from
    their document's first run, given `_document_runs`) over keys kv [B, P - offset, R * H, D] as a causal
    attention; o [B, P, R, HQ, D] and lse [B, P, R, HQ], zero and -inf at the runs before `offset`."""
    B, P, R, HQ, D = q_runs.shape
    n = P - offset
    if documents is None:
        o, lse = fa4_causal_fwd(q_runs[:, offset:].reshape(B, n, R * HQ, D), *kv, 0, scale, deterministic)
        o = F.pad(o.view(B, n, R, HQ, D), (0, 0, 0, 0, 0, 0, offset, 0))
        return o, F.pad(lse.view(B, R, HQ, n).permute(0, 3, 1, 2), (0, 0, 0, 0, offset, 0), value=float("-inf"))
    # One sequence per document: its runs from first + offset against as many keys from its first run on.
    row, first, last, run_first = documents
    q_first = torch.minimum(first + offset, last)
    cu_q = F.pad(row * P + q_first, (0, 1), value=B * P).to(torch.int32)
    cu_k = F.pad(row * n + first.clamp(max=n), (0, 1), value=B * n).to(torch.int32)
    o, lse = fa4_causal_fwd(q_runs.reshape(B * P, R * HQ, D), *(x.flatten(0, 1) for x in kv), 0, scale,
                            deterministic, cu_q, cu_k, (last - q_first).to(torch.int32), P, n)
    # The first `offset` runs of each document are in no sequence: FA4 left them unwritten.
    seen = (torch.arange(P, device=q_runs.device) - run_first >= offset)[:, :, None, None]
    o = torch.where(seen[..., None], o.view(B, P, R, HQ, D), 0)
    return o, torch.where(seen, lse.view(R, HQ, B, P).permute(2, 3, 0, 1), float("-inf"))


def fa4_compressed_attention(q: Tensor, k: Tensor, v: Tensor, block: int, stride: int, scale: float,
                             deterministic: bool = True, doc_start: Tensor | None = None,
                             align: int = 1) -> tuple[Tensor, Tensor]:
    """NSA compressed attention through FA4's causal kernel: o [B, T, HQ, D] and the natural-log lse [B, T, HQ]
    (fp32; -inf where no block is visible), as `triton_compressed.compressed_attention_fwd`. k, v: [B, Nc, H, D]
    compressed keys/values; block l must be a multiple of stride d. doc_start [B, T] (packed documents starting at
    multiples of `align`, itself a multiple of d): a query sees only the blocks of its own document.

    Query t = d tau + r sees compressed block i iff i d + l - 1 <= t, that is i <= tau - l/d for r < d - 1 and
    i <= tau - l/d + 1 for r = d - 1. Viewing q as [B, T/d, d * HQ, D] (the d queries of a run as heads, a view)
    makes each of those two groups of rows a plain causal attention over positions tau: the group with offset c
    takes positions tau >= c against Nk = (its positions) keys, so that FA's bottom-right causal mask is j <=
    tau - c. Each key/value head is repeated once per packed query row r, so that FA's grouping of query heads
    (head r HQ + h G + g reads key head (r H + h)) stays the model's. Positions past T (T padded to a multiple of
    d) and the zero keys padded past Nc are never visible to real queries. With documents, each document is that
    problem on its own: positions and keys counted from its first run."""
    B, T, HQ, D = q.shape
    n_cmp, H = k.shape[1], k.shape[2]
    n_pos = -(-T // stride)
    if n_pos * stride != T:
        q = F.pad(q, (0, 0, 0, 0, 0, n_pos * stride - T))
    q_runs = q.view(B, n_pos, stride, HQ, D)
    documents = None if doc_start is None else _document_runs(doc_start, align, stride)
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
        o, lse = _compressed_group(q_runs[:, :, r0:r1], kv, offset, scale, deterministic, documents)
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs, 2).view(B, n_pos * stride, HQ, D)[:, :T]
    if n_pos < bulk_offset:
        # No group ran (T <= l - d): k and v are empty. Keep them in the graph, as the Triton op does, since DDP
        # expects every parameter of phi to receive a gradient.
        o = o + 0 * (k.sum() + v.sum()).to(o.dtype)
    # reshape, not view: cat may give its result the permuted strides of the groups' lse
    return o, torch.cat(lses, 2).reshape(B, n_pos * stride, HQ)[:, :T]
