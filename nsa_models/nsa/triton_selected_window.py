"""The selected and sliding-window branches (NSA branches 4 and 5) in one Triton sweep per direction, for K/V shared by
the two (`separate_kv = False`): `model.nsa.window_backend = "fused_with_selected"`.

Layout as the reference: q, o [B, T, HQ, D]; k, v [B, T, H, D]. What each query chose comes as one int64 bitmask
[B, H, T] (bit j: selection block j; `chosen_bits`), shared by the G query heads of a KV group. Query t attends, in the
selected branch, the tokens u <= t of its chosen blocks, and in the window the tokens t - w < u <= t (and u >=
doc_start[t] with packed documents).

A query tile (QT consecutive queries x their G heads as the rows of one matrix-unit tile) walks its causal prefix once,
`keys` keys (one or more selection blocks) a step. One Q Kᵀ per step serves both branches: the steps before the tile's
window feed the selected branch's online softmax alone (rows mask the blocks they did not choose); the steps of the
window feed two softmax states. With packed documents a tile starts at its first query's document (no row sees an
earlier key: the window stops at the document, and the selection chooses blocks inside it). Where a query's causal
prefix has at most n selection blocks it chose all of them, and the selected branch is causal attention over the prefix:
at T = 2 n l' (nsa-125m's 2048 tokens) that is half of the rows, and the other half chose half of its blocks, so walking
the whole prefix wastes little there. The work grows with T²: `MAX_FUSED_BLOCKS` (nsa_models.args) bounds where it is
offered.

The op applies the two branches' gates (o = g_slc o_slc + g_win o_win, in torch after the forward kernel), so that its
backward takes one dO for both: dP = dO Vᵀ once a step, dV += (g_slc P_slc + g_win P_win)ᵀ dO once, and dS = the sum
over the branches of g P (dP - delta). The kernels read the gates through each branch's lse less ln(g) (`gated_lse`:
exp of the score less it is g P). No float atomics, bitwise repeatable: dK/dV by one program per
(`keys` keys, batch, KV head) that walks the query tiles that can see them (the window's with both branches, the later
ones with the selected branch alone, up to the end of the keys' documents: `triton_common.document_query_ends`) and
writes its block's gradients once; dQ by the forward's tiles. No per-slot partials, no work lists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_models.args import MAX_FUSED_BLOCKS
from nsa_models.nsa import triton_common
from nsa_models.nsa.triton_common import (
    LOG2E,
    gated_lse,
    head_rows_descriptors,
    load_head_rows,
    online_softmax_update,
    softmax_output,
)

# Launch of each kernel: rows (queries x heads) per query tile, keys per step (a multiple of l'), warps, pipeline
# stages.
FWD_LAUNCH = dict(rows=64, keys=64, num_warps=4, num_stages=3)
DQ_LAUNCH = dict(rows=64, keys=64, num_warps=4, num_stages=3)
DKDV_LAUNCH = dict(rows=16, keys=64, num_warps=4, num_stages=3)


@triton.jit
def _rows(tile, b, h, T, H: tl.constexpr, G: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr):
    """Query tile `tile`: row r is head r % G of query tile * QT + r // G. Returns the rows' query positions (int32:
    the masks compare them per (row, key), where 64-bit integer ops cost twice), their offsets in [B * T * HQ]
    (int64) and which exist."""
    r = tl.arange(0, BM)
    t = tile * QT + r // G
    return t.to(tl.int32), (b * T + t) * (H * G) + h * G + r % G, (r < QT * G) & (t < T)


@triton.jit
def _keep_chosen(x, other, word, step, pos, BS: tl.constexpr, BN: tl.constexpr):
    """x [rows, keys] where the row chose the key's block, else `other`: the rows' bitmasks `word` [rows], the keys
    `pos` [keys] of key step `step`. With one block a step (BN = BS) that is one bit per row, broadcast, instead of
    a 64-bit shift per (row, key). Keys past the last block shift past bit 63 (0, or -1 for a word with bit 63
    set); callers mask them out as not causal."""
    if BN == BS:
        return tl.where((((word >> step) & 1) != 0)[:, None], x, other)
    return tl.where(((word[:, None] >> (pos[None, :] // BS)) & 1) != 0, x, other)


@triton.jit
def _keep_chosen_t(x, other, word, step, pos, BS: tl.constexpr, BN: tl.constexpr):
    """`_keep_chosen` of x transposed ([keys, rows])."""
    if BN == BS:
        return tl.where((((word >> step) & 1) != 0)[None, :], x, other)
    return tl.where(((word[None, :] >> (pos[:, None] // BS)) & 1) != 0, x, other)


@triton.jit
def _doc_starts(DOC, b, t, row_ok, T, DOC_MASK: tl.constexpr):
    """[rows] the first position of each row's document (with DOC_MASK; else the rows' positions, unused)."""
    if DOC_MASK:  # the same type on both paths: the compiler checks every return, taken or not
        return tl.load(DOC + b * T + t, mask=row_ok, other=0).to(t.dtype)
    return t


@triton.jit
def _window(t, pos, doc, W, DOC_MASK: tl.constexpr):
    """Key pos lies in query t's window (causal, within w, not before its document's start doc); the arguments
    broadcast ([rows, 1] against [1, keys], or transposed)."""
    inside = (pos <= t) & (t - pos < W)
    if DOC_MASK:
        inside &= pos >= doc
    return inside


@triton.jit
def _scores(q, K, V, b, h, step, u, T, d, d_ok, qk_scale, H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
            BD: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Key step `step` of a query tile: the keys' positions [BN], keys and values [BN, BD], and the rows' scores
    [rows, BN] in log2 units."""
    pos = tl.cast(step * BN, tl.int32) + u
    k = load_head_rows(K, b, h, step * BN, T, d, d_ok, BN, H, D, BD, TMA)
    v = load_head_rows(V, b, h, step * BN, T, d, d_ok, BN, H, D, BD, TMA)
    return pos, k, v, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale


@triton.jit
def _window_step_masks(t, pos, doc, W, DOC_MASK: tl.constexpr):
    """[rows, keys] masks of a key step that reaches into the rows' windows: causal (the selected branch's, with
    `_keep_chosen`) and the window's."""
    return pos[None, :] <= t[:, None], _window(t[:, None], pos[None, :], doc[:, None], W, DOC_MASK)


@triton.jit
def _query_tile(T, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr,
                BD: tl.constexpr):
    """This program's query tile (grid: query tiles x batch * KV heads): the tile, batch * KV head, batch, KV head,
    the rows' positions, offsets and which exist, head-dim lanes, their validity and the q / row mask. It reads no
    tensor: inductor's analysis of which tensors a kernel writes (`triton_common.kernel_op`) counts every tensor
    that reaches a call whose results address a store, and would copy those before each launch."""
    # Last tiles first: they walk the longest prefixes, and launched last they would run alone at the end.
    tile = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    t, rows, row_ok = _rows(tile, b, h, T, H, G, QT, BM)
    d = tl.arange(0, BD)
    d_ok = d < D
    return tile, bh, b, h, t, rows, row_ok, d, d_ok, row_ok[:, None] & d_ok[None, :]


@triton.jit
def _tile_inputs(Q, BITS, DOC, tile, bh, b, t, rows, row_ok, qd_mask, d, T, W, D: tl.constexpr, QT: tl.constexpr,
                 BN: tl.constexpr, DOC_MASK: tl.constexpr):
    """What a query tile (`_query_tile`) reads: q, each row's bitmask and document start, the first key step any
    row sees (its document's), the first of any row's window and the last."""
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    word = tl.load(BITS + bh * T + t, mask=row_ok, other=0)
    first = tile * QT
    last = tl.minimum(first + QT, T) - 1
    # No row sees a key before its document's start, and the tile's first query has the earliest one.
    doc_first = tl.load(DOC + b * T + first).to(tl.int64) if DOC_MASK else first * 0
    return (q, word, _doc_starts(DOC, b, t, row_ok, T, DOC_MASK), doc_first // BN,
            tl.maximum(first - W + 1, doc_first) // BN, last // BN)


@triton.jit(do_not_specialize=["T", "W"])
def _fwd_kernel(Q, K, V, BITS, DOC, O_SLC, O_WIN, LSE_SLC, LSE_WIN, T, W, qk_scale, H: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr,
                BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                DOC_MASK: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 when inductor launches it (`triton_common.kernel_op`)
    tile, bh, b, h, t, rows, row_ok, d, d_ok, qd_mask = _query_tile(T, H, G, D, QT, BM, BD)
    q, word, doc, doc_step, win_step, last_step = _tile_inputs(Q, BITS, DOC, tile, bh, b, t, rows, row_ok, qd_mask,
                                                               d, T, W, D, QT, BN, DOC_MASK)
    K, V = head_rows_descriptors(K, V, tl.num_programs(1) // H, T, H, D, BN, BD, TMA)
    u = tl.arange(0, BN)
    m_s = tl.full([BM], float("-inf"), tl.float32)
    l_s = tl.zeros([BM], tl.float32)
    acc_s = tl.zeros([BM, BD], tl.float32)
    m_w, l_w, acc_w = m_s, l_s, acc_s
    # Before the window: every key precedes every row's query by w or more, so only the choice masks.
    for step in range(doc_step, win_step):
        pos, k, v, s = _scores(q, K, V, b, h, step, u, T, d, d_ok, qk_scale, H, D, BN, BD, PRECISION, TMA)
        s = _keep_chosen(s, float("-inf"), word, step, pos, BS, BN)
        m_s, l_s, acc_s = online_softmax_update(m_s, l_s, acc_s, s, v, PRECISION)
    for step in range(win_step, last_step + 1):
        pos, k, v, s = _scores(q, K, V, b, h, step, u, T, d, d_ok, qk_scale, H, D, BN, BD, PRECISION, TMA)
        causal, inside = _window_step_masks(t, pos, doc, W, DOC_MASK)
        s_slc = _keep_chosen(tl.where(causal, s, float("-inf")), float("-inf"), word, step, pos, BS, BN)
        m_s, l_s, acc_s = online_softmax_update(m_s, l_s, acc_s, s_slc, v, PRECISION)
        m_w, l_w, acc_w = online_softmax_update(m_w, l_w, acc_w, tl.where(inside, s, float("-inf")), v, PRECISION)
    o_s, lse_s = softmax_output(m_s, l_s, acc_s)
    o_w, lse_w = softmax_output(m_w, l_w, acc_w)
    tl.store(O_SLC + rows[:, None] * D + d[None, :], o_s.to(O_SLC.dtype.element_ty), mask=qd_mask)
    tl.store(O_WIN + rows[:, None] * D + d[None, :], o_w.to(O_WIN.dtype.element_ty), mask=qd_mask)
    tl.store(LSE_SLC + rows, lse_s, mask=row_ok)
    tl.store(LSE_WIN + rows, lse_w, mask=row_ok)


@triton.jit
def _row_stats(LSE, DELTA, rows, row_ok):
    """One branch's backward terms of query rows [rows]: its gated lse (log2 units) and delta."""
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    return lse, tl.load(DELTA + rows, mask=row_ok, other=0.0)


@triton.jit(do_not_specialize=["T", "W"])
def _bwd_dq_kernel(Q, K, V, BITS, DOC, DO, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, DQ, T, W, qk_scale, scale,
                   H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                   QT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                   TMA: tl.constexpr, DOC_MASK: tl.constexpr):
    """dQ of a query tile. The gated output's dO serves both branches: one dP = dO Vᵀ a step, and dS = sum over
    the branches of g P (dP - delta), g P from the gated lse (`gated_lse`)."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    tile, bh, b, h, t, rows, row_ok, d, d_ok, qd_mask = _query_tile(T, H, G, D, QT, BM, BD)
    q, word, doc, doc_step, win_step, last_step = _tile_inputs(Q, BITS, DOC, tile, bh, b, t, rows, row_ok, qd_mask,
                                                               d, T, W, D, QT, BN, DOC_MASK)
    K, V = head_rows_descriptors(K, V, tl.num_programs(1) // H, T, H, D, BN, BD, TMA)
    u = tl.arange(0, BN)
    do = tl.load(DO + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    lse_s, delta_s = _row_stats(LSE_SLC, DELTA_SLC, rows, row_ok)
    lse_w, delta_w = _row_stats(LSE_WIN, DELTA_WIN, rows, row_ok)
    dq = tl.zeros([BM, BD], tl.float32)
    for step in range(doc_step, win_step):
        pos, k, v, s = _scores(q, K, V, b, h, step, u, T, d, d_ok, qk_scale, H, D, BN, BD, PRECISION, TMA)
        p = _keep_chosen(tl.exp2(s - lse_s[:, None]), 0.0, word, step, pos, BS, BN)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        dq += tl.dot((p * (dp - delta_s[:, None])).to(k.dtype), k, input_precision=PRECISION)
    for step in range(win_step, last_step + 1):
        pos, k, v, s = _scores(q, K, V, b, h, step, u, T, d, d_ok, qk_scale, H, D, BN, BD, PRECISION, TMA)
        causal, inside = _window_step_masks(t, pos, doc, W, DOC_MASK)
        p_s = _keep_chosen(tl.where(causal, tl.exp2(s - lse_s[:, None]), 0.0), 0.0, word, step, pos, BS, BN)
        p_w = tl.where(inside, tl.exp2(s - lse_w[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p_s * (dp - delta_s[:, None]) + p_w * (dp - delta_w[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + rows[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _dkdv_tile(Q, BITS, DO, LSE_SLC, DELTA_SLC, k, v, b, h, bh, tile, step, pos, d, d_ok, T, qk_scale,
               H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
               QT: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """A query tile's rows as seen from the keys `pos` (transposed: [keys, rows]): their positions, offsets,
    validity and q / dO masks, q, dO, dP = v dOᵀ, the scores, and the selected branch's gated probabilities
    g P and its part of dS. CAUSAL: some of the keys may follow some rows' queries (else all precede them)."""
    t, rows, row_ok = _rows(tile, b, h, T, H, G, QT, BM)
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    lse_s, delta_s = _row_stats(LSE_SLC, DELTA_SLC, rows, row_ok)
    s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [keys, rows], log2 units
    word = tl.load(BITS + bh * T + t, mask=row_ok, other=0)
    p_s = tl.exp2(s - lse_s[None, :])
    if CAUSAL:
        p_s = tl.where(pos[:, None] <= t[None, :], p_s, 0.0)
    p_s = _keep_chosen_t(p_s, 0.0, word, step, pos, BS, BN)
    dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    return t, rows, row_ok, qd_mask, q, do, dp, s, p_s, p_s * (dp - delta_s[None, :])


@triton.jit(do_not_specialize=["T", "W"])
def _bwd_dkdv_kernel(Q, K, V, BITS, DOC, QEND, DO, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, DK, DV, T, W, qk_scale,
                     scale, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                     QT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                     TMA: tl.constexpr, DOC_MASK: tl.constexpr):
    """One program per (BN keys, batch * KV head): their dK and dV, from the query tiles that see them. Scores are
    computed transposed (keys x query rows), so that dV += Pᵀ dO and dK += dSᵀ Q take their left operand straight
    from the accumulator's layout. The gated output's dO serves both branches: in the window's tiles one dP = v dOᵀ
    and one dV += (g_s P_s + g_w P_w)ᵀ dO, where separate branch gradients took two of each."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    step = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    K, V = head_rows_descriptors(K, V, tl.num_programs(1) // H, T, H, D, BN, BD, TMA)
    d = tl.arange(0, BD)
    d_ok = d < D
    pos = tl.cast(step * BN, tl.int32) + tl.arange(0, BN)
    k = load_head_rows(K, b, h, step * BN, T, d, d_ok, BN, H, D, BD, TMA)
    v = load_head_rows(V, b, h, step * BN, T, d, d_ok, BN, H, D, BD, TMA)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    first = step * BN // QT
    # The tiles up to the last query whose window holds one of the keys see them through both branches; the later
    # ones (all of the keys causally visible, none in their window) through the selected one alone, up to the end
    # of the keys' documents (QEND: `document_query_ends`).
    n_tiles = tl.cdiv(tl.load(QEND + b * tl.cdiv(T, BN) + step) if DOC_MASK else T, QT)
    win_last = tl.minimum(tl.minimum(step * BN + BN + W - 2, T - 1) // QT, n_tiles - 1)
    for tile in range(first, win_last + 1):
        t, rows, row_ok, qd_mask, q, do, dp, s, p, ds = _dkdv_tile(
            Q, BITS, DO, LSE_SLC, DELTA_SLC, k, v, b, h, bh, tile, step, pos, d, d_ok, T, qk_scale, H, G, D, BS,
            BN, QT, BM, PRECISION, True)
        lse_w, delta_w = _row_stats(LSE_WIN, DELTA_WIN, rows, row_ok)
        doc = _doc_starts(DOC, b, t, row_ok, T, DOC_MASK)
        inside = _window(t[None, :], pos[:, None], doc[None, :], W, DOC_MASK) & row_ok[None, :]
        p_w = tl.where(inside, tl.exp2(s - lse_w[None, :]), 0.0)
        dv += tl.dot((p + p_w).to(do.dtype), do, input_precision=PRECISION)
        ds += p_w * (dp - delta_w[None, :])
        dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
    for tile in range(win_last + 1, n_tiles):
        t, rows, row_ok, qd_mask, q, do, dp, s, p, ds = _dkdv_tile(
            Q, BITS, DO, LSE_SLC, DELTA_SLC, k, v, b, h, bh, tile, step, pos, d, d_ok, T, qk_scale, H, G, D, BS,
            BN, QT, BM, PRECISION, False)
        dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
    out = (b * T + pos)[:, None] * (H * D) + h * D + d[None, :]
    kd_mask = (pos < T)[:, None] & d_ok[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kd_mask)


def chosen_bits(block_indices: Tensor) -> Tensor:
    """[B, H, T] int64 bitmask of each query's chosen blocks (bit j: block j < 64) from block_indices [B, H, T, n]
    (-1: none). Torch ops, which fuse into the caller's graph; a sum of distinct bits, exact in any order."""
    return torch.where(block_indices >= 0, torch.ones_like(block_indices) << (block_indices & 63), 0).sum(-1)


def _launch(q: Tensor, k: Tensor, bits: Tensor, doc_start: Tensor | None, block_size: int, window: int,
            scale: float, launch: dict) -> tuple[dict, int]:
    """A kernel's keyword arguments under `launch` (one of the *_LAUNCH), and its number of query tiles."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    QT = max(1, launch["rows"] // G)
    doc = doc_start if doc_start is not None else bits  # a placeholder pointer, never read
    # fp32 rows of 128 lanes: 32 KiB a key or value tile, so pipelined K/V stages would pass the shared memory of an
    # SM (H100: 227 KiB). fp32 is the correctness path; it runs unpipelined.
    stages = launch["num_stages"] if q.element_size() * D <= 256 else 1
    return dict(BITS=bits, DOC=doc, T=T, W=window, qk_scale=scale * LOG2E, H=H, G=G, D=D, BS=block_size,
                BN=max(block_size, launch["keys"]), QT=QT, BM=triton.next_power_of_2(QT * G),
                BD=triton.next_power_of_2(D), PRECISION=triton_common.dot_precision(q.dtype),
                TMA=triton_common.kv_tma(k),
                DOC_MASK=doc_start is not None, num_warps=launch["num_warps"], num_stages=stages), triton.cdiv(T, QT)


def _branch_outputs(q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty o_slc, o_win [B, T, HQ, D] (dtype of q) and lse_slc, lse_win [B, T, HQ] (fp32) for a forward kernel."""
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(q), lse, torch.empty_like(lse)


def _fwd_fake(q, k, v, gates, bits, doc_start, block_size, window, scale, kernels="triton"):
    return torch.empty_like(q), *_branch_outputs(q)


@triton_common.kernel_op("nsa::selected_window_fwd", _fwd_fake)
def selected_window_fwd(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, bits: Tensor, doc_start: Tensor | None,
                        block_size: int, window: int, scale: float,
                        kernels: str = "triton") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """o = g_slc o_slc + g_win o_win [B, T, HQ, D] (dtype of q; gates [B, T, HQ, 2]: g_slc, g_win >= 0), and, for
    the backward (not differentiable), o_slc, o_win and their natural-log lse [B, T, HQ] (fp32). bits:
    `chosen_bits`. kernels (`model.nsa.selected_kernels`): "gluon_hopper" runs `gluon_selected_window`'s forward
    (`gluon_selected_window_fwd`: Hopper, bf16, head dim 64 or 128, blocks of 64 keys), "triton" this module's; the
    backward (`selected_window_bwd`) takes the same choice."""
    q, k, v, bits = q.contiguous(), k.contiguous(), v.contiguous(), bits.contiguous()
    if kernels == "gluon_hopper":
        o_slc, o_win, lse_slc, lse_win = gluon_selected_window_fwd(q, k, v, bits, doc_start, window, scale)
    else:
        o_slc, o_win, lse_slc, lse_win = _branch_outputs(q)
        triton_fwd(q, k, v, bits, doc_start, block_size, window, scale, o_slc=o_slc, o_win=o_win, lse_slc=lse_slc,
                   lse_win=lse_win, launch=triton_common.op_launch)
    # The gated sum in torch: compiled, inductor fuses it with the caller's compressed term (in the kernel's
    # epilogue it made the forward 3% slower: a third [rows, D] store and 24 more registers).
    g = gates.to(q.dtype)
    return g[..., 0, None] * o_slc + g[..., 1, None] * o_win, o_slc, o_win, lse_slc, lse_win


@torch.library.custom_op("nsa::gluon_selected_window_fwd", mutates_args=())
def gluon_selected_window_fwd(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, doc_start: Tensor | None, window: int,
                              scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """o_slc, o_win and their lse through the Gluon forward, for `selected_window_fwd`: an opaque custom op (inductor
    cannot launch Gluon kernels)."""
    from nsa_models.nsa import gluon_selected_window as gluon  # only here: CPU runs never load Gluon

    o_slc, o_win, lse_slc, lse_win = outputs = _branch_outputs(q)
    gluon.gluon_fwd(q, k, v, bits, doc_start, window, scale, o_slc, o_win, lse_slc, lse_win)
    return outputs


@gluon_selected_window_fwd.register_fake
def _(q, k, v, bits, doc_start, window, scale):
    return _branch_outputs(q)


def triton_fwd(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, doc_start: Tensor | None, block_size: int,
               window: int, scale: float, o_slc: Tensor, o_win: Tensor, lse_slc: Tensor, lse_win: Tensor,
               launch: Callable = triton_common.direct_launch) -> None:
    """Launch the Triton forward into the branches' outputs (as `gluon_selected_window.gluon_fwd`, with the block
    size)."""
    args, tiles = _launch(q, k, bits, doc_start, block_size, window, scale, FWD_LAUNCH)
    k, v = triton_common.kv_sources(k, v)
    launch(_fwd_kernel)[(tiles, q.shape[0] * args["H"])](q, k, v, O_SLC=o_slc, O_WIN=o_win, LSE_SLC=lse_slc,
                                                      LSE_WIN=lse_win, **args)


def _bwd_fake(do, q, k, v, lse_slc, lse_win, delta_slc, delta_win, bits, doc_start, block_size, window, scale,
              kernels="triton"):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _bwd_inputs(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, do: Tensor, lse_slc: Tensor, lse_win: Tensor,
                delta_slc: Tensor, delta_win: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """The backward's inputs, contiguous: q, k, v, bits, and the gradient and the branches' statistics as the dQ
    and dK/dV launchers (Triton's and Gluon's) take them."""
    q, k, v, bits = (x.contiguous() for x in (q, k, v, bits))
    grads = dict(do=do.contiguous(), lse_slc=lse_slc.contiguous(), lse_win=lse_win.contiguous(),
                 delta_slc=delta_slc.contiguous(), delta_win=delta_win.contiguous())
    return q, k, v, bits, grads


@triton_common.kernel_op("nsa::selected_window_bwd", _bwd_fake)
def selected_window_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse_slc: Tensor, lse_win: Tensor,
                        delta_slc: Tensor, delta_win: Tensor, bits: Tensor, doc_start: Tensor | None,
                        block_size: int, window: int, scale: float,
                        kernels: str = "triton") -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of o = g_slc o_slc + g_win o_win given its gradient do, each branch's gated lse (`gated_lse`)
    and delta = rowsum(o_branch * do) [B, T, HQ] (fp32); kernels: "gluon_hopper" runs `gluon_selected_window`'s dQ
    and dK/dV kernels (`gluon_selected_window_bwd`: Hopper, bf16, head dim 64 or 128, blocks of 64 keys: they
    raise outside them); "triton" this module's."""
    if kernels == "gluon_hopper":
        return gluon_selected_window_bwd(do, q, k, v, lse_slc, lse_win, delta_slc, delta_win, bits, doc_start, window,
                                         scale)
    q, k, v, bits, grads = _bwd_inputs(q, k, v, bits, do, lse_slc, lse_win, delta_slc, delta_win)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    triton_bwd_dq(q, k, v, bits, doc_start, block_size, window, scale, **grads, dq=dq,
                  launch=triton_common.op_launch)
    triton_bwd_dkdv(q, k, v, bits, doc_start, block_size, window, scale, **grads, dk=dk, dv=dv,
                    launch=triton_common.op_launch)
    return dq, dk, dv


@torch.library.custom_op("nsa::gluon_selected_window_bwd", mutates_args=())
def gluon_selected_window_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse_slc: Tensor, lse_win: Tensor,
                              delta_slc: Tensor, delta_win: Tensor, bits: Tensor, doc_start: Tensor | None,
                              window: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """`selected_window_bwd` through the Gluon kernels: an opaque custom op (inductor cannot launch Gluon kernels)."""
    from nsa_models.nsa import gluon_selected_window as gluon  # only here: CPU runs never load Gluon

    q, k, v, bits, grads = _bwd_inputs(q, k, v, bits, do, lse_slc, lse_win, delta_slc, delta_win)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    gluon.gluon_bwd_dq(q, k, v, bits, doc_start, window, scale, **grads, dq=dq)
    gluon.gluon_bwd_dkdv(q, k, v, bits, doc_start, window, scale, **grads, dk=dk, dv=dv)
    return dq, dk, dv


@gluon_selected_window_bwd.register_fake
def _(do, q, k, v, lse_slc, lse_win, delta_slc, delta_win, bits, doc_start, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _grad_args(do: Tensor, lse_slc: Tensor, lse_win: Tensor, delta_slc: Tensor, delta_win: Tensor) -> dict:
    """The backward kernels' keyword arguments for the gradient and the branches' statistics."""
    return dict(DO=do, LSE_SLC=lse_slc, LSE_WIN=lse_win, DELTA_SLC=delta_slc, DELTA_WIN=delta_win)


def triton_bwd_dq(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, doc_start: Tensor | None, block_size: int,
                  window: int, scale: float, do: Tensor, lse_slc: Tensor, lse_win: Tensor, delta_slc: Tensor,
                  delta_win: Tensor, dq: Tensor, launch: Callable = triton_common.direct_launch) -> None:
    """Launch the Triton dQ kernel into dq (as `gluon_selected_window.gluon_bwd_dq`, with the block size)."""
    args, tiles = _launch(q, k, bits, doc_start, block_size, window, scale, DQ_LAUNCH)
    k_op, v_op = triton_common.kv_sources(k, v)
    launch(_bwd_dq_kernel)[(tiles, q.shape[0] * args["H"])](q, k_op, v_op, DQ=dq, scale=scale, **args,
                                                            **_grad_args(do, lse_slc, lse_win, delta_slc, delta_win))


def triton_bwd_dkdv(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, doc_start: Tensor | None, block_size: int,
                    window: int, scale: float, do: Tensor, lse_slc: Tensor, lse_win: Tensor, delta_slc: Tensor,
                    delta_win: Tensor, dk: Tensor, dv: Tensor, launch: Callable = triton_common.direct_launch) -> None:
    """Launch the Triton dK/dV kernel into dk, dv (as `gluon_selected_window.gluon_bwd_dkdv`, with the block
    size)."""
    args, _ = _launch(q, k, bits, doc_start, block_size, window, scale, DKDV_LAUNCH)
    k_op, v_op = triton_common.kv_sources(k, v)
    query_ends = args["DOC"] if doc_start is None else triton_common.document_query_ends(doc_start, args["BN"])
    launch(_bwd_dkdv_kernel)[(triton.cdiv(q.shape[1], args["BN"]), q.shape[0] * args["H"])](
        q, k_op, v_op, QEND=query_ends, DK=dk, DV=dv, scale=scale, **args,
        **_grad_args(do, lse_slc, lse_win, delta_slc, delta_win))


def _setup_context(ctx, inputs, output):
    q, k, v, gates, bits, doc_start, block_size, window, scale, kernels = inputs
    _, o_slc, o_win, lse_slc, lse_win = output
    # The branches' outputs and lse are the backward's, not the model's: no gradient flows into them.
    ctx.mark_non_differentiable(o_slc, o_win, lse_slc, lse_win)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(o_slc, o_win, lse_slc, lse_win, q, k, v, gates, bits, doc_start)
    ctx.block_size, ctx.window, ctx.scale, ctx.kernels = block_size, window, scale, kernels


def _backward(ctx, do, *_):
    o_slc, o_win, lse_slc, lse_win, q, k, v, gates, bits, doc_start = ctx.saved_tensors
    # Each branch's rowsum(o_branch * dO): its gate's gradient, and the softmax term of its dS.
    delta_slc, delta_win = (triton_common.softmax_delta(o, do, None) for o in (o_slc, o_win))
    dq, dk, dv = selected_window_bwd(do, q, k, v, gated_lse(lse_slc, gates[..., 0]), gated_lse(lse_win, gates[..., 1]),
                                     delta_slc, delta_win, bits, doc_start, ctx.block_size, ctx.window, ctx.scale,
                                     ctx.kernels)
    return dq, dk, dv, torch.stack([delta_slc, delta_win], -1).to(gates.dtype), None, None, None, None, None, None


selected_window_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_fused(T: int, block_size: int) -> None:
    """Raise ValueError unless a sequence of T tokens fits the fused sweep (`MAX_FUSED_BLOCKS`)."""
    if triton.cdiv(T, block_size) > MAX_FUSED_BLOCKS:
        raise ValueError(f"model.nsa.window_backend = 'fused_with_selected' runs sequences of at most "
                         f"{MAX_FUSED_BLOCKS * block_size} tokens ({MAX_FUSED_BLOCKS} selection blocks; its work "
                         f"grows as T^2), got {T}: set window_backend to 'flex' or 'flash_attn_4'")


def selected_window_attention(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, block_indices: Tensor,
                              block_size: int, window: int, scale: float | None = None,
                              doc_start: Tensor | None = None, kernels: str = "triton") -> Tensor:
    """g_slc o_slc + g_win o_win [B, T, HQ, D]: the selected and window branches' outputs over the same k, v
    [B, T, H, D], each weighted by its gate (gates [B, T, HQ, 2]); block_indices [B, H, T, n] int64 (-1: none),
    inside each query's document; doc_start [B, T] int32 (multiples of block_size) or None; kernels: "gluon_hopper"
    runs `gluon_selected_window`'s forward, dQ and dK/dV (Hopper), "triton" this module's."""
    B, T, HQ, D = q.shape
    check_fused(T, block_size)
    triton_common.check_batch_heads(B, k.shape[2], "selected + window attention")
    if gates.shape != (B, T, HQ, 2):
        raise ValueError(f"selected + window attention: gates must be [B, T, HQ, 2] = [{B}, {T}, {HQ}, 2], got "
                         f"{tuple(gates.shape)}")
    scale = D ** -0.5 if scale is None else scale
    return selected_window_fwd(q, k, v, gates, chosen_bits(block_indices), doc_start, block_size, window, scale,
                               kernels)[0]


# The sliding window alone, through the sweep's Gluon kernels without the selected branch (`window_backend =
# "gluon_hopper"`): a tile walks only its rows' window steps. Gluon only (Hopper, bf16): `check_backend` refuses
# the rest.
@torch.library.custom_op("nsa::window_sweep_fwd", mutates_args=())
def window_sweep_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: Tensor | None, window: int,
                     scale: float) -> tuple[Tensor, Tensor]:
    """o [B, T, HQ, D] (dtype of q) and the natural-log lse [B, T, HQ] (fp32) of the window branch alone."""
    from nsa_models.nsa import gluon_selected_window  # only here: CPU runs never load Gluon

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    gluon_selected_window.gluon_fwd(q, k, v, None, doc_start, window, scale, None, o, None, lse)
    return o, lse


@window_sweep_fwd.register_fake
def _(q, k, v, doc_start, window, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("nsa::window_sweep_bwd", mutates_args=())
def window_sweep_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                     doc_start: Tensor | None, window: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of the window branch alone, given delta = rowsum(o * do) - dlse [B, T, HQ] (fp32)."""
    from nsa_models.nsa import gluon_selected_window

    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    stats = dict(do=do, lse_slc=None, lse_win=lse.contiguous(), delta_slc=None, delta_win=delta.contiguous())
    gluon_selected_window.gluon_bwd_dq(q, k, v, None, doc_start, window, scale, **stats, dq=dq)
    gluon_selected_window.gluon_bwd_dkdv(q, k, v, None, doc_start, window, scale, **stats, dk=dk, dv=dv)
    return dq, dk, dv


@window_sweep_bwd.register_fake
def _(do, q, k, v, lse, delta, doc_start, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _window_setup_context(ctx, inputs, output):
    q, k, v, doc_start, window, scale = inputs
    ctx.save_for_backward(*output, q, k, v, doc_start)
    ctx.window, ctx.scale = window, scale


def _window_backward(ctx, do, dlse):
    o, lse, q, k, v, doc_start = ctx.saved_tensors
    dq, dk, dv = window_sweep_bwd(do, q, k, v, lse, triton_common.softmax_delta(o, do, dlse), doc_start, ctx.window,
                                  ctx.scale)
    return dq, dk, dv, None, None, None


window_sweep_fwd.register_autograd(_window_backward, setup_context=_window_setup_context)


def window_sweep_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None,
                           doc_start: Tensor | None = None) -> Tensor:
    """The window branch [B, T, HQ, D]: query t attends keys max(doc_start[t], t - window + 1) .. t of k, v
    [B, T, H, D] (doc_start [B, T] int32 or None), through the Gluon kernels (`window_sweep_fwd`)."""
    triton_common.check_batch_heads(q.shape[0], k.shape[2], "window attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return window_sweep_fwd(q, k, v, doc_start, window, scale)[0]
