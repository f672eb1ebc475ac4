"""Triton helpers shared by the compressed (`triton_compressed`), selection (`triton_selection`) and selected
(`triton_selected`) NSA kernels: key/value row loads (pointer or TMA), the streaming softmax and its backward's
per-row inputs (delta, the gated lse).

Layouts as the kernels': q, o [B, T, HQ, D]; k, v [B, N, H, D] (N: tokens or compressed blocks).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from nsa_models.args import TRITON_MAX_BATCH_HEADS

LOG2E = 1.4426950408889634  # host code scales by it; kernels read only constexpr globals, so they spell it out

# The Triton interpreter (CPU runs and tests) runs kernels as Python functions, which make_fx cannot trace.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_op(name: str, fake: Callable) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Register `fn` (torch ops and `op_launch(kernel)[grid](...)` launches only) as the operator
    `name`. Compiled, a `torch.library.triton_op`: inductor traces the body and launches the kernels itself, so a
    call costs no custom-op dispatch, no Python and no Triton JIT launch at run time (what bounds a step without CUDA
    graphs: FSDP2, `compile.mode = "default"`). Under the interpreter a plain custom op with `fake` (the interpreter's
    kernels cannot be traced). Kernels take Python floats as fp32 from Triton's launcher but as fp64 from
    inductor's: they cast their float arguments to fp32 first."""
    def register(fn: Callable) -> torch.library.CustomOpDef:
        if not INTERPRETED:
            return torch.library.triton_op(name, fn, mutates_args=())
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fake)
        return op
    return register


def _scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def direct_launch(kernel: triton.JITFunction) -> triton.JITFunction:
    """`kernel`, for a launch from eager code (tests, benchmarks), with Triton's global-scratch allocator set: the
    device-side TMA descriptors (`head_rows_descriptor`) live there. The allocator is per thread (a ContextVar),
    and autograd runs the backward on a thread of its own, so every launch sets it."""
    triton.set_allocator(_scratch)
    return kernel


def op_launch(kernel: triton.JITFunction) -> Callable:
    """`kernel`, for a launch from a `kernel_op`'s body: through `torch.library.wrap_triton`, so that inductor
    launches it (and allocates its scratch) once compiled; eager, as `direct_launch`."""
    return torch.library.wrap_triton(direct_launch(kernel))


@triton.jit
def load_head_rows(X, b, h, start, N, d, d_ok, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + ROWS) of head h of batch b of a [B, N, H, D] tensor, as [ROWS, BD]; rows outside
    [0, N) read as zeros. TMA: X is the tensor's descriptor (`head_rows_operand` or `head_rows_descriptor`) and
    the copy engine loads the box (head-dim lanes past D may hold the next head's values: callers meet them with
    zero q / dO lanes and never store them); else pointer loads."""
    if TMA:
        x = X.load([tl.cast(b, tl.int32), tl.cast(start, tl.int32), tl.cast(h * D, tl.int32)]).reshape(ROWS, BD)
    else:
        r = start + tl.arange(0, ROWS)
        ptr = (b * N * H + h) * D + r[:, None] * (H * D) + d[None, :]  # the scalar part first: fewer registers
        x = tl.load(X + ptr, mask=((r >= 0) & (r < N))[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def head_rows_descriptor(X, B, N, H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr,
                         TMA: tl.constexpr):
    """X [B, N, H, D] (`tma_source`'s) as `load_head_rows` reads it: with TMA, a descriptor made on the device, one
    box = ROWS rows of one head; else the pointer. Made here rather than on the host because inductor launches
    these kernels (`kernel_op`) and cannot pass host descriptors; each program writes its own into global scratch
    (`direct_launch`). N = 0 is read from `tma_source`'s one zero row."""
    if TMA:
        rows = tl.maximum(N, 1)
        X = tl.make_tensor_descriptor(X, shape=[B, rows, H * D], strides=[rows.to(tl.int64) * (H * D), H * D, 1],
                                      block_shape=[1, ROWS, BD])
    return X


@triton.jit
def head_rows_descriptors(K, V, B, N, H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr,
                          TMA: tl.constexpr):
    """`head_rows_descriptor` of the keys and of the values."""
    return (head_rows_descriptor(K, B, N, H, D, ROWS, BD, TMA), head_rows_descriptor(V, B, N, H, D, ROWS, BD, TMA))


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


# Rows of at least this many bytes come through TMA (`kv_tma`). A device-side descriptor costs each program a write
# to global scratch and a fence: measured on the sweep (H200, Triton forward / dQ ms, host descriptors -> device
# ones -> pointer loads), nsa-125m 16 x 2k (bf16, D = 64: 128-byte rows) 0.573 / 0.501 -> 0.617 / 0.546 -> 0.560 /
# 0.499, nsa-1b 8 x 2k (D = 128: 256-byte rows) 0.466 / 0.729 -> 0.494 / 0.745 -> 0.610 / 0.820.
TMA_MIN_ROW_BYTES = 256


def kv_tma(x: Tensor) -> bool:
    """Whether kernels read x [B, N, H, D]'s rows through TMA (`TMA_MIN_ROW_BYTES`)."""
    return x.shape[-1] * x.element_size() >= TMA_MIN_ROW_BYTES


def tma_source(x: Tensor) -> Tensor:
    """x [B, N, H, D] contiguous, as a TMA descriptor can read it: one zero row for N = 0 (a descriptor needs a
    non-empty tensor), a copy when its base is not 16-byte aligned (the allocator's bases are; a view's offset may
    not be); ValueError when its rows cannot be. Traceable (no data pointer): `kernel_op` bodies call it."""
    B, N, H, D = x.shape
    if D > 256 or H * D * x.element_size() % 16:
        raise ValueError(f"NSA Triton kernels: head dim {D} must be at most 256, with H * D * element size = "
                         f"{H * D * x.element_size()} bytes a multiple of 16 (a TMA descriptor's rows)")
    x = x.contiguous()
    if N == 0:
        return x.new_zeros(B, 1, H, D)
    return x.clone() if x.storage_offset() * x.element_size() % 16 else x


def kv_sources(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values [B, N, H, D] as kernels that make their descriptors on the device (`head_rows_descriptor`)
    read them: `tma_source`s where `kv_tma`, else as they are. Host TMA descriptors against pointer loads on the
    compressed branch (H200, op ms, forward / backward / selection): 64k, G = 16, D = 128: 10.87 / 29.12 / 13.57 ->
    9.93 / 28.17 / 11.66; 32k, G = 1: 2.90 / 9.62 / 4.70 -> 2.67 / 9.29 / 4.77; nsa-125m (G = 3, D = 64) at 1 x
    32k: 0.410 / 1.289 / 1.005 -> 0.392 / 1.262 / 1.004, at 16 x 2k: 0.102 / 0.226 / 0.131 -> 0.099 / 0.226 / 0.134."""
    if not kv_tma(k):
        return k, v
    return tma_source(k), tma_source(v)


def head_rows_operand(x: Tensor, rows: int, tma: bool) -> Tensor | TensorDescriptor:
    """What `load_head_rows` reads x [B, N, H, D] through from a kernel launched directly: with tma, its host
    descriptor, one box = `rows` rows of one head; else x itself. Before Hopper (no TMA) Triton compiles
    descriptor loads to pointer loads."""
    if not tma:
        return x
    x = tma_source(x)
    B, N, H, D = x.shape
    return TensorDescriptor(x.view(B, -1, H * D), [B, N, H * D], [N * H * D, H * D, 1],
                            [1, rows, triton.next_power_of_2(D)])


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 for fp32 inputs, tf32 otherwise (bf16 products are exact in either)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def softmax_delta(o: Tensor, do: Tensor, dlse: Tensor | None) -> Tensor:
    """delta = rowsum(o * do) - dlse [B, T, HQ] fp32, the backward's per-row term (d lse / d scores = p, so an lse
    cotangent shifts it)."""
    delta = (o.float() * do.float()).sum(-1)
    return delta if dlse is None else delta - dlse


def gated_lse(lse: Tensor, gate: Tensor) -> Tensor:
    """A branch's lse less ln(gate) [B, T, HQ] (fp32; +inf where the gate is 0): exp(s - it) is the gated
    probability g P, so the backward kernels take the gates through it and read the gated output's dO as it is
    (the compressed op and the selected + window sweep). Gates are >= 0 (sigmoids)."""
    g = gate.float()
    return torch.where(g > 0, lse - g.log(), float("inf"))


def document_query_ends(doc_start: Tensor, step: int) -> Tensor:
    """[B, ceil(T / step)] int32: for each step of `step` keys, how many queries see any of them at most, the queries
    whose document starts at or before the step's last key (doc_start [B, T] int32, nondecreasing along T). Every
    later query belongs to a later document: a key-major backward stops its walk there."""
    B, T = doc_start.shape
    last_keys = (torch.arange(step - 1, T + step - 1, step, device=doc_start.device, dtype=torch.int32)
                 .clamp_(max=T - 1).expand(B, -1).contiguous())
    return torch.searchsorted(doc_start, last_keys, right=True, out_int32=True)
