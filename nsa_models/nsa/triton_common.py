"""Triton helpers shared by the compressed (`triton_compressed`), selection (`triton_selection`) and selected
(`triton_selected`) NSA kernels: key/value row loads (pointer or TMA), the streaming softmax and its backward's
per-row inputs.

Layouts as the kernels': q, o [B, T, HQ, D]; k, v [B, N, H, D] (N: tokens or compressed blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from nsa_models.args import TRITON_MAX_BATCH_HEADS

LOG2E = 1.4426950408889634  # host code scales by it; kernels read only constexpr globals, so they spell it out


@triton.jit
def load_head_rows(X, b, h, start, N, d, d_ok, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + ROWS) of head h of batch b of a [B, N, H, D] tensor, as [ROWS, BD]; rows outside
    [0, N) read as zeros. TMA: X is the tensor's descriptor (`head_rows_operand`) and the copy engine loads the
    box (head-dim lanes past D may hold the next head's values: callers meet them with zero q / dO lanes and
    never store them); else pointer loads."""
    if TMA:
        x = X.load([tl.cast(b, tl.int32), tl.cast(start, tl.int32), tl.cast(h * D, tl.int32)]).reshape(ROWS, BD)
    else:
        r = start + tl.arange(0, ROWS)
        ptr = (b * N * H + h) * D + r[:, None] * (H * D) + d[None, :]  # the scalar part first: fewer registers
        x = tl.load(X + ptr, mask=((r >= 0) & (r < N))[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def row_offset(Q0, Q0_ODD, b):
    """The first query's position in batch row b: Q0 in even rows, Q0_ODD in odd ones (a context-parallel shard's
    two chunks as the rows of one call; Q0_ODD = Q0 otherwise)."""
    return Q0 + (b % 2) * (Q0_ODD - Q0)


def query_offsets(q_start: int | tuple[int, int], q_start_odd: int | None = None) -> tuple[int, int]:
    """(even rows', odd rows') first query positions: q_start for every batch row, or a pair that alternates
    between rows (a context-parallel shard's chunks, `row_offset`), given as a tuple or as the kernels' ops take
    it (q_start, q_start_odd; None: the same as q_start)."""
    if not isinstance(q_start, int):
        return int(q_start[0]), int(q_start[1])
    return q_start, q_start if q_start_odd is None else q_start_odd


@triton.jit
def online_softmax_update(m, l, acc, s, v, PRECISION: tl.constexpr):
    """Fold one key tile into a streaming softmax: scores s [rows, keys] in log2 units (-inf: not visible),
    values v [keys, BD]; running row max m, row sum l and output acc [rows, BD]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def softmax_output(m, l, acc):
    """Normalised output [rows, BD] and natural-log lse [rows]; a row that saw no key gives 0 and -inf."""
    l_safe = tl.where(l > 0, l, 1.0)
    return acc / l_safe[:, None], tl.where(l > 0, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))


@triton.jit
def load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D: tl.constexpr):
    """Backward inputs of query rows: q and dO [rows, BD], log-sum-exp (in log2 units) and delta [rows]."""
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta


def check_batch_heads(B: int, H: int, op: str) -> None:
    """Raise ValueError unless B x H (sequence, KV head) pairs fit the grid dimension the kernels give them."""
    if B * H > TRITON_MAX_BATCH_HEADS:
        raise ValueError(f"{op}: batch {B} x {H} KV heads = {B * H} exceeds the {TRITON_MAX_BATCH_HEADS} (sequence, "
                         "KV head) pairs of one call: split the batch")


def head_rows_operand(x: Tensor, rows: int, tma: bool) -> Tensor | TensorDescriptor:
    """What `load_head_rows` reads x [B, N, H, D] through: with tma, its descriptor, one box = `rows` rows of one
    head (N = 0 gets one zero row: a descriptor needs a non-empty tensor); else x itself. Before Hopper (no TMA)
    Triton compiles descriptor loads to pointer loads."""
    if not tma:
        return x
    B, N, H, D = x.shape
    if D > 256 or H * D * x.element_size() % 16:
        raise ValueError(f"NSA Triton kernels: head dim {D} must be at most 256, with H * D * element size = "
                         f"{H * D * x.element_size()} bytes a multiple of 16 (a TMA descriptor's rows)")
    if N == 0 or x.data_ptr() % 16:  # TMA needs a 16-byte aligned base
        x = x.new_zeros(B, 1, H, D) if N == 0 else x.clone()
    return TensorDescriptor(x.view(B, -1, H * D), [B, x.shape[1], H * D], [x.shape[1] * H * D, H * D, 1],
                            [1, rows, triton.next_power_of_2(D)])


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 for fp32 inputs, tf32 otherwise (bf16 products are exact in either)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def softmax_delta(o: Tensor, do: Tensor, dlse: Tensor | None) -> Tensor:
    """delta = rowsum(o * do) - dlse [B, T, HQ] fp32, the backward's per-row term (d lse / d scores = p, so an lse
    cotangent shifts it)."""
    delta = (o.float() * do.float()).sum(-1)
    return delta if dlse is None else delta - dlse


def document_query_ends(doc_start: Tensor, step: int) -> Tensor:
    """[B, ceil(T / step)] int32: for each step of `step` keys, how many queries see any of them at most, the queries
    whose document starts at or before the step's last key (doc_start [B, T] int32, nondecreasing along T). Every
    later query belongs to a later document: a key-major backward stops its walk there."""
    B, T = doc_start.shape
    last_keys = (torch.arange(step - 1, T + step - 1, step, device=doc_start.device, dtype=torch.int32)
                 .clamp_(max=T - 1).expand(B, -1).contiguous())
    return torch.searchsorted(doc_start, last_keys, right=True, out_int32=True)
