"""Compressed attention (NSA branch 1) in Triton, as torch ops (`triton_common.kernel_op`). The top-n block
selection (branches 2-3), which reruns these scores from the forward's log-sum-exp, is in `triton_selection` and
shares the tiling and block-visibility helpers below.

Layout as the reference: q, o [B, T, HQ, D]; compressed k, v [B, Nc, H, D]; query head h * G + g reads KV head h.
Query row r sits at position t = q_start + r of the sequence the compressed blocks summarise (q_start: a runtime
argument, 0 unless context parallelism hands a shard's chunks of queries, whose two chunks are the even and odd
batch rows of one call, at q_start and q_start_odd; the document masks need q_start = 0).
Compressed block i (tokens [i*d, i*d + l)) is visible to query t iff i*d + l - 1 <= t, and, with packed documents
(doc_start [B, T] int32: the first position of each token's document, a multiple of d; a multiple of l' for the
selection), iff also i*d >= doc_start[t]. Documents only mask (a constexpr DOC_MASK flag: without them every kernel
compiles as before): a document's blocks are the global ones from its start on, and each kernel skips the key
tiles (or query steps) of the documents before (after) the ones its tile touches.

A tile's rows are QB consecutive query positions x the G heads of one KV group (row r is head r % GP of position
t0 + r // GP, QB = BM // GP), so every query of the group shares the loaded keys and a small G still fills the
matrix-unit rows with positions. The forward and dQ take GP = G (21 positions, 63 rows at G = 3); dK/dV and
the selection take the heads in two slices of power-of-two rows a position (`_head_slices`: 2 + 1 at G = 3;
with G rows a position dK/dV spills, and the selection's group sum reshapes each slice's rows into [QB, GP]).
Key/value tiles come through TMA descriptors made on the device at D = 128
(`triton_common.kv_sources`), query rows through pointer loads (a tile's unused rows must read as zeros).

- Forward: online softmax over the visible compressed blocks; writes o and the fp32 log-sum-exp. Only the key
  tiles that some row of the tile cannot fully see are masked (the last ones of a query tile; in dK/dV the
  first query steps after a key tile): the others skip the per-element visibility test. The op applies the
  branch's gate (g_cmp o, in torch), as the selected + window sweep does its two, so that its backward reads
  the block's dO itself: the kernels see g P through the gated lse (`triton_common.gated_lse`), and
  rowsum(o dO) is both their softmax delta and the gate's gradient. Gated in torch outside the op, the compiled
  backward wrote g dO [B, T, HQ, D] once for each backward kernel, and ran a kernel of its own for the gate's
  gradient.
- Backward: dQ with the forward's grid; dK/dV with one program per (KV head, tile of compressed blocks, chunk of
  queries) writing fp32 partial sums, added in a fixed order: no atomics, bitwise reproducible. The dK/dV
  program computes the transposed scores (keys x query rows), so that every product has the key tile as its
  rows and no probability tile is transposed in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from nsa_models.nsa import triton_common
from nsa_models.nsa.triton_common import (
    LOG2E,
    head_rows_descriptors,
    load_head_rows,
    load_rows,
    online_softmax_update,
    query_offsets,
    row_offset,
    softmax_output,
)

_ROWS = 64  # rows per tile: query positions x the group's heads (a slice of them in dK/dV and the selection)
_KEYS = 64  # compressed blocks per tile (forward, dQ, selection: BJ * l'/d of them)
_KEYS_BWD = 64  # compressed blocks per dK/dV program: each query row loaded serves this many keys
# Query positions per dK/dV program: enough programs to fill the GPU at short T (about _BWD_PROGRAMS: several per
# SM of a 132-SM H100/H200), chunks of at least _BWD_CHUNK_MIN queries, and at most _BWD_CHUNKS_MAX chunks, which
# bounds the fp32 partial sums' memory at long T.
_BWD_PROGRAMS = 1024
_BWD_CHUNK_MIN = 256
_BWD_CHUNK_MAX = 2048
_BWD_CHUNKS_MAX = 32


@triton.jit
def _tile_rows(t0, b, h, T, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr,
               G0: tl.constexpr = 0):
    """Query positions [BM], rows of [B * T * HQ] [BM] and their validity for the tile starting at t0: GP rows a
    position, the group's heads from G0 on (a slice of the group: `_head_slices`)."""
    r = tl.arange(0, BM)
    t = t0 + r // GP
    g = r % GP
    ok = (g < G - G0) & (t < T) & (r < BM // GP * GP)  # the rows past QB whole positions are unused
    return t, (b * T + t) * (H * G) + h * G + G0 + g, ok


@triton.jit
def _query_tile(T, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                BD: tl.constexpr):
    """This program's query tile (grid: query tiles x batch * KV heads): first position, positions, rows and
    their validity, head-dim lanes, the q/o mask, its batch and KV head."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    t0 = tl.program_id(0).to(tl.int64) * (BM // GP)
    t, rows, row_ok = _tile_rows(t0, b, h, T, H, G, GP, BM)
    d = tl.arange(0, BD)
    d_ok = d < D
    return t0, t, rows, row_ok, d, d_ok, row_ok[:, None] & d_ok[None, :], b, h


@triton.jit
def _load_keys(K, V, b, h, n0, NC, d, d_ok, BN: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
               TMA: tl.constexpr):
    """Compressed keys and values [BN, BD] of blocks [n0, n0 + BN) of KV head h of batch b (zeros past the last
    block), through TMA (`head_rows_descriptors`) or pointer loads."""
    return (load_head_rows(K, b, h, n0, NC, d, d_ok, BN, H, D, BD, TMA),
            load_head_rows(V, b, h, n0, NC, d, d_ok, BN, H, D, BD, TMA))


@triton.jit
def _n_visible(t, NC, L: tl.constexpr, S: tl.constexpr):
    """Compressed blocks visible to query t (t may be a tensor): i*S + L - 1 <= t."""
    return tl.minimum(tl.where(t + 1 >= L, (t + 1 - L) // S + 1, 0), NC)


@triton.jit
def _sees(n, t, NC, L: tl.constexpr, S: tl.constexpr):
    """Whether query t sees compressed block n (tensors of broadcastable shapes): the block exists and ends at or
    before t."""
    return (n * S + L - 1 <= t) & (n < NC)


@triton.jit
def _first_block(DOC, b, t, T, S: tl.constexpr):
    """The first compressed block of the document of query t (a tensor of positions; those past T, whose rows are
    masked elsewhere, read 0): the queries see blocks from there on."""
    return tl.load(DOC + b * T + t, mask=t < T, other=0) // S


@triton.jit
def _document_blocks(DOC, b, t0, T, S: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr):
    """For the query tile of QB positions from t0, whole key tiles of BN blocks: [0, lo) are seen by no query
    (they precede its first document), from hi on every query's document holds them all."""
    first = tl.load(DOC + b * T + t0)
    last = tl.load(DOC + b * T + tl.minimum(t0 + QB, T) - 1)
    return first // S // BN * BN, tl.cdiv(last // S, BN) * BN


@triton.jit
def _visible_range(t0, T, NC, L: tl.constexpr, S: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr):
    """The compressed blocks of the query tile of QB positions from t0: [0, common) is seen by every query, in
    whole key tiles (no mask needed), [common, end) by some."""
    return _n_visible(t0, NC, L, S) // BN * BN, _n_visible(tl.minimum(t0 + QB, T) - 1, NC, L, S)


@triton.jit
def _fwd_keys(q, K, V, b, h, m, l, acc, t, first, lo, hi, NC, d, d_ok, qk_scale, H: tl.constexpr, D: tl.constexpr,
              L: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr,
              PRECISION: tl.constexpr, MASKED: tl.constexpr, DOC_MASK: tl.constexpr = False):
    """Fold compressed blocks [lo, hi) into the running softmax; MASKED: mask per row the blocks its query does
    not see yet (only the tile's last key tiles need it); DOC_MASK: also those before the row's `first` block (its
    document's)."""
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        k, v = _load_keys(K, V, b, h, n0, NC, d, d_ok, BN, H, D, BD, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        if DOC_MASK:
            s = tl.where(n[None, :] >= first[:, None], s, float("-inf"))
        if MASKED:
            s = tl.where(_sees(n[None, :], t[:, None], NC, L, S), s, float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, s, v, PRECISION)
    return m, l, acc


@triton.jit(do_not_specialize=["T", "NC", "Q0", "Q0_ODD"])
def _fwd_kernel(Q, K, V, DOC, O, LSE, T, NC, Q0, Q0_ODD, qk_scale, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                D: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BD: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                DOC_MASK: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 when inductor launches it (`triton_common.kernel_op`)
    t0, t, rows, row_ok, d, d_ok, qd_mask, b, h = _query_tile(T, H, G, GP, D, BM, BD)
    K, V = head_rows_descriptors(K, V, tl.num_programs(1) // H, NC, H, D, BN, BD, TMA)
    Q0 = row_offset(Q0, Q0_ODD, b)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    pos = Q0 + t  # the rows' positions: the causal rule's; documents are per row
    common, end = _visible_range(Q0 + t0, Q0 + T, NC, L, S, BM // GP, BN)
    lo, first = 0, 0
    if DOC_MASK:  # the key tiles some query's document does not hold: masked by both rules
        lo, hi = _document_blocks(DOC, b, t0, T, S, BM // GP, BN)
        first = _first_block(DOC, b, t, T, S)
        m, l, acc = _fwd_keys(q, K, V, b, h, m, l, acc, pos, first, lo, tl.minimum(hi, end), NC, d, d_ok, qk_scale,
                              H, D, L, S, BN, BD, TMA, PRECISION, MASKED=True, DOC_MASK=True)
        lo, common = hi, tl.maximum(common, hi)
    m, l, acc = _fwd_keys(q, K, V, b, h, m, l, acc, pos, first, lo, common, NC, d, d_ok, qk_scale, H, D, L, S, BN,
                          BD, TMA, PRECISION, MASKED=False)
    m, l, acc = _fwd_keys(q, K, V, b, h, m, l, acc, pos, first, common, end, NC, d, d_ok, qk_scale, H, D, L, S, BN,
                          BD, TMA, PRECISION, MASKED=True)
    o, lse = softmax_output(m, l, acc)  # a query that sees no compressed block: o = 0, lse = -inf
    tl.store(O + rows[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=qd_mask)
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def _dq_keys(q, do, lse, delta, dq, K, V, b, h, t, first, lo, hi, NC, d, d_ok, qk_scale, H: tl.constexpr,
             D: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr,
             PRECISION: tl.constexpr, MASKED: tl.constexpr, DOC_MASK: tl.constexpr = False):
    """Add compressed blocks [lo, hi)'s terms to dq; MASKED, DOC_MASK as in _fwd_keys. Unmasked, a row past the
    sequence or a padded head adds 0: its q, dO, lse and delta load as 0."""
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        k, v = _load_keys(K, V, b, h, n0, NC, d, d_ok, BN, H, D, BD, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None])
        if DOC_MASK:
            p = tl.where(n[None, :] >= first[:, None], p, 0.0)
        if MASKED:
            p = tl.where(_sees(n[None, :], t[:, None], NC, L, S), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        dq += tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["T", "NC", "Q0", "Q0_ODD"])
def _bwd_dq_kernel(Q, K, V, DOC, DO, LSE, DELTA, DQ, T, NC, Q0, Q0_ODD, qk_scale, scale, H: tl.constexpr,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                   TMA: tl.constexpr, DOC_MASK: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    t0, t, rows, row_ok, d, d_ok, qd_mask, b, h = _query_tile(T, H, G, GP, D, BM, BD)
    K, V = head_rows_descriptors(K, V, tl.num_programs(1) // H, NC, H, D, BN, BD, TMA)
    Q0 = row_offset(Q0, Q0_ODD, b)
    q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D)
    dq = tl.zeros([BM, BD], tl.float32)
    pos = Q0 + t  # as in the forward
    common, end = _visible_range(Q0 + t0, Q0 + T, NC, L, S, BM // GP, BN)
    lo, first = 0, 0
    if DOC_MASK:
        lo, hi = _document_blocks(DOC, b, t0, T, S, BM // GP, BN)
        first = _first_block(DOC, b, t, T, S)
        dq = _dq_keys(q, do, lse, delta, dq, K, V, b, h, pos, first, lo, tl.minimum(hi, end), NC, d, d_ok, qk_scale,
                      H, D, L, S, BN, BD, TMA, PRECISION, MASKED=True, DOC_MASK=True)
        lo, common = hi, tl.maximum(common, hi)
    dq = _dq_keys(q, do, lse, delta, dq, K, V, b, h, pos, first, lo, common, NC, d, d_ok, qk_scale, H, D, L, S, BN,
                  BD, TMA, PRECISION, MASKED=False)
    dq = _dq_keys(q, do, lse, delta, dq, K, V, b, h, pos, first, common, end, NC, d, d_ok, qk_scale, H, D, L, S, BN,
                  BD, TMA, PRECISION, MASKED=True)
    tl.store(DQ + rows[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _dkdv_rows(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, lo, hi, stop, T, NC, Q0, d, d_ok, qk_scale,
               H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, G0: tl.constexpr, D: tl.constexpr,
               L: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
               DOC_MASK: tl.constexpr = False):
    """Add the terms of the query steps from rows lo to hi (before `stop`) of the heads [G0, G0 + GP) to a key
    tile's dk, dv; MASKED: mask the blocks a row's query does not see yet (only the first steps after a tile's
    blocks end need it); DOC_MASK: also those before its document. Rows at or past `stop` add 0: their q, dO, lse
    and delta load as 0."""
    for t0 in range(lo, hi, BM // GP):
        t, rows, row_ok = _tile_rows(t0, b, h, T, H, G, GP, BM, G0)
        row_ok &= t < stop
        qd_mask = row_ok[:, None] & d_ok[None, :]
        q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D)
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BN, BM]: keys x query rows
        p = tl.exp2(s - lse[None, :])
        if DOC_MASK:
            p = tl.where(n[:, None] >= _first_block(DOC, b, t, T, S)[None, :], p, 0.0)
        if MASKED:
            p = tl.where(_sees(n[:, None], Q0 + t[None, :], NC, L, S) & row_ok[None, :], p, 0.0)
        dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dk += tl.dot((p * (dp - delta[None, :])).to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_slice(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, start, sees_all, whole, stop, T, NC, Q0, d, d_ok,
                qk_scale, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, G0: tl.constexpr, D: tl.constexpr,
                L: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr, DOC_MASK: tl.constexpr):
    """Add to the key tile's dk, dv the terms of the query rows [start, stop) in the heads [G0, G0 + GP) of the
    group, GP rows a position (a step: BM // GP positions). The kernel's bounds (rows, not yet whole steps):
    from sees_all on every query sees the tile's last block; with documents, up to whole every query's document
    holds the tile's first block."""
    QB: tl.constexpr = BM // GP
    # From the first step whose queries all see the tile's last block on, unmasked.
    unmasked = tl.minimum(start + tl.cdiv(tl.maximum(sees_all - start, 0), QB) * QB, stop)
    if DOC_MASK:  # in whole steps, unless it reaches `stop` (one document: the unmasked steps as without documents)
        whole = tl.where(whole >= stop, stop, unmasked + tl.maximum(whole - unmasked, 0) // QB * QB)
    dk, dv = _dkdv_rows(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, start, unmasked, stop, T, NC, Q0, d, d_ok,
                        qk_scale, H, G, GP, G0, D, L, S, BM, PRECISION, MASKED=True, DOC_MASK=DOC_MASK)
    dk, dv = _dkdv_rows(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, unmasked, whole, stop, T, NC, Q0, d, d_ok,
                        qk_scale, H, G, GP, G0, D, L, S, BM, PRECISION, MASKED=False)
    if DOC_MASK:
        dk, dv = _dkdv_rows(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, whole, stop, stop, T, NC, Q0, d, d_ok,
                            qk_scale, H, G, GP, G0, D, L, S, BM, PRECISION, MASKED=True, DOC_MASK=True)
    return dk, dv


@triton.jit(do_not_specialize=["T", "NC", "Q0", "Q0_ODD", "CHUNK"])
def _bwd_dkdv_kernel(Q, K, V, DOC, DOC_END, DO, LSE, DELTA, DK_PART, DV_PART, T, NC, Q0, Q0_ODD, CHUNK, qk_scale, scale,
                     H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr,
                     L: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                     PRECISION: tl.constexpr, TMA: tl.constexpr, DOC_MASK: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    tile, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    bh = tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    K, V = head_rows_descriptors(K, V, tl.num_programs(2) // H, NC, H, D, BN, BD, TMA)
    Q0 = row_offset(Q0, Q0_ODD, b)
    n = tile * BN + tl.arange(0, BN)
    d = tl.arange(0, BD)
    d_ok = d < D
    k, v = _load_keys(K, V, b, h, tile * BN, NC, d, d_ok, BN, H, D, BD, TMA)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    stop = tl.minimum(chunk * CHUNK + CHUNK, T)
    # This chunk's query rows, from the first one that sees the tile's first block on (none: zero partials); from
    # sees_all on, every row sees the tile's last block. (Row = position - Q0.)
    start = tl.maximum(chunk * CHUNK, tile * BN * S + L - 1 - Q0)
    sees_all = (tl.minimum(tile * BN + BN, NC) - 1) * S + L - 1 - Q0
    whole = stop
    if DOC_MASK:
        # The queries past the end of the document holding the tile's last block see none of it, and those of
        # the document holding its first block (to `whole`) every block that the causal rule lets them.
        ends = DOC_END + b * T
        stop = tl.minimum(stop, tl.load(ends + tl.minimum((tl.minimum(tile * BN + BN, NC) - 1) * S, T - 1)))
        whole = tl.load(ends + tl.minimum(tile * BN * S, T - 1))
    # The group's heads in two slices (`_head_slices`): [0, GP), then [GP, G) padded to GB rows a position.
    dk, dv = _dkdv_slice(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, start, sees_all, whole, stop, T, NC, Q0, d,
                         d_ok, qk_scale, H, G, GP, 0, D, L, S, BM, PRECISION, DOC_MASK)
    if GB > 0:
        dk, dv = _dkdv_slice(Q, DO, LSE, DELTA, DOC, k, v, dk, dv, n, b, h, start, sees_all, whole, stop, T, NC, Q0,
                             d, d_ok, qk_scale, H, G, GB, GP, D, L, S, BM, PRECISION, DOC_MASK)
    kv_base = b * NC * H * D + h * D
    ptr = chunk * tl.num_programs(2) * NC * D + kv_base + n[:, None] * (H * D) + d[None, :]  # [chunks, B, NC, H, D]
    mask = (n < NC)[:, None] & d_ok[None, :]
    tl.store(DK_PART + ptr, dk * scale, mask=mask)
    tl.store(DV_PART + ptr, dv, mask=mask)


def _head_slices(G: int) -> tuple[int, int]:
    """The group's heads as two slices of power-of-two rows a position, for the kernels whose tiles need them
    (dK/dV, the selection): the largest power of two GP <= G, then the rest padded to a power of two GB (0: no
    rest). G = 3 takes 2 + 1 rows a position instead of padding to 4, G = 6 4 + 2, G = 7 4 + 4."""
    GP = 1 << (G.bit_length() - 1)
    return GP, triton.next_power_of_2(G - GP) if G > GP else 0


def _tiling(G: int, D: int, dtype: torch.dtype, sliced: bool = False) -> dict:
    """Rows per query position (G; sliced: the two slices of `_head_slices`, GP and GB), padded head dim and the
    dot precision (exact fp32 for fp32 inputs).

    G rows a position instead of 4 at G = 3 (H200, bf16, kernel ms, forward / dQ): nsa-125m (D = 64) 16 x 2k
    0.097 / 0.089 -> 0.078 / 0.073, 1 x 32k 0.384 / 0.388 -> 0.305 / 0.317, 1 x 64k 1.36 / 1.40 -> 1.06 / 1.13;
    1 x 32k, D = 128 2.38 / 2.86 -> 1.85 / 2.22."""
    if G > _ROWS:
        raise ValueError(f"compressed attention: GQA group size {G} is above {_ROWS}")
    rows = dict(zip(("GP", "GB"), _head_slices(G))) if sliced else dict(GP=G)
    return dict(G=G, D=D, BD=triton.next_power_of_2(D), BM=_ROWS, PRECISION=triton_common.dot_precision(dtype),
                **rows)


def _check(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, block: int, stride: int,
           doc_start: Tensor | None = None, q_start: int = 0, q_start_odd: int | None = None) -> None:
    B, T, HQ, D = q.shape
    H = k.shape[2]
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or v.shape != k.shape or HQ % H:
        raise ValueError(f"compressed attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} "
                         "must be [B, T, HQ, D] and [B, Nc, H, D] with H dividing HQ")
    if gate.shape != (B, T, HQ):
        raise ValueError(f"compressed attention: gate {tuple(gate.shape)} must be [B, T, HQ] = {(B, T, HQ)}")
    triton_common.check_batch_heads(B, H, "compressed attention")
    if stride & (stride - 1) or block % stride:
        raise ValueError(f"compressed attention: stride d = {stride} must be a power of two dividing l = {block}")
    if doc_start is not None and (doc_start.shape != (B, T) or doc_start.dtype != torch.int32):
        raise ValueError(f"compressed attention: doc_start {tuple(doc_start.shape)} {doc_start.dtype} must be "
                         f"[B, T] = {(B, T)} int32")
    # dK/dV finds a key's document end by its position among the query rows: they must be the whole sequence.
    if doc_start is not None and (q_start or q_start_odd):
        raise ValueError(f"compressed attention: packed documents (doc_start) need q_start = 0, got {q_start} "
                         f"(odd rows: {q_start_odd})")


def _document_ends(doc_start: Tensor) -> Tensor:
    """[B, T] int32: the end (exclusive) of the document of each position, from doc_start [B, T] (the first
    position of each token's document): the next position that starts a document, or T."""
    T = doc_start.shape[1]
    t = torch.arange(T, device=doc_start.device, dtype=torch.int32)
    starts = torch.where(doc_start == t, t, T)[:, 1:]  # the positions after t that begin a document
    return F.pad(starts, (0, 1), value=T).flip(1).cummin(1).values.flip(1).contiguous()


def _contiguous(doc_start: Tensor | None) -> Tensor | None:
    return None if doc_start is None else doc_start.contiguous()


def _fwd_fake(q, k, v, gate, block, stride, scale, doc_start=None, q_start=0, q_start_odd=None):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), torch.empty_like(q)


@triton_common.kernel_op("nsa::compressed_attention_fwd", _fwd_fake)
def compressed_attention_fwd(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, block: int, stride: int, scale: float,
                             doc_start: Tensor | None = None, q_start: int = 0,
                             q_start_odd: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gated output g_cmp o [B, T, HQ, D] (dtype of q; gate [B, T, HQ] >= 0), the natural-log lse [B, T, HQ]
    (fp32; -inf: no visible block) and, for the backward (not differentiable), the ungated o. doc_start [B, T]
    int32 (multiples of d), or None; q_start: the first query's position (q_start_odd: in odd batch rows, if it
    differs). See the module's docstring."""
    _check(q, k, v, gate, block, stride, doc_start, q_start, q_start_odd)
    q, k, v, doc_start = q.contiguous(), k.contiguous(), v.contiguous(), _contiguous(doc_start)
    B, T, HQ, D = q.shape
    H, NC = k.shape[2], k.shape[1]
    tiles = _tiling(HQ // H, D, q.dtype)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, tiles["BM"] // tiles["GP"]), B * H)
    # 3 stages: 1-10% faster than 2 from 2k to 64k (H200); the backward kernels gained at some shapes and lost
    # at others, so they keep 2.
    triton_common.op_launch(_fwd_kernel)[grid](q, *triton_common.kv_sources(k, v), doc_start, o, lse, T, NC,
                                               *query_offsets(q_start, q_start_odd), scale * LOG2E, H=H, L=block,
                                               S=stride, BN=_KEYS, TMA=triton_common.kv_tma(k),
                                               DOC_MASK=doc_start is not None, **tiles, num_warps=4, num_stages=3)
    # In torch, not in the kernel's epilogue: compiled, inductor fuses it with the caller's sum of the branches.
    return gate.to(o.dtype)[..., None] * o, lse, o


def _dkdv_chunk(T: int, n_tiles: int, n_heads: int) -> int:
    """Query positions per dK/dV program (see _BWD_PROGRAMS)."""
    chunk = triton.next_power_of_2(triton.cdiv(T * n_tiles * n_heads, _BWD_PROGRAMS))
    chunk = min(max(chunk, _BWD_CHUNK_MIN), _BWD_CHUNK_MAX)
    return max(chunk, triton.cdiv(T, _BWD_CHUNKS_MAX))


def _bwd_fake(do, q, k, v, lse, delta, block, stride, scale, doc_start=None, q_start=0, q_start_odd=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@triton_common.kernel_op("nsa::compressed_attention_bwd", _bwd_fake)
def compressed_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, block: int,
                             stride: int, scale: float, doc_start: Tensor | None = None,
                             q_start: int = 0, q_start_odd: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv given do, the lse and delta = rowsum(o * do) - dlse [B, T, HQ] (fp32) of the ungated o; or, for
    the gated output g o, its do, the gated lse (`triton_common.gated_lse`) and delta = rowsum(o * do). Bitwise
    deterministic."""
    q, k, v, do, lse, delta = (x.contiguous() for x in (q, k, v, do, lse, delta))
    q_start, q_start_odd = query_offsets(q_start, q_start_odd)
    doc_start = _contiguous(doc_start)
    doc_end = None if doc_start is None else _document_ends(doc_start)
    B, T, HQ, D = q.shape
    H, NC = k.shape[2], k.shape[1]
    tiles = _tiling(HQ // H, D, q.dtype)
    args = dict(H=H, L=block, S=stride, TMA=triton_common.kv_tma(k), DOC_MASK=doc_start is not None, num_warps=4,
                num_stages=2)
    dq = torch.empty_like(q)
    triton_common.op_launch(_bwd_dq_kernel)[(triton.cdiv(T, tiles["BM"] // tiles["GP"]), B * H)](
        q, *triton_common.kv_sources(k, v), doc_start, do, lse, delta, dq, T, NC, q_start, q_start_odd, scale * LOG2E,
        scale, BN=_KEYS,
        **tiles, **args)
    # dK/dV: one program per (tile of compressed blocks, chunk of queries); the chunks' fp32 partial sums are
    # added in a fixed order (torch's sum), so no program waits on the whole causal range of a block. Its steps
    # take the group's heads in power-of-two slices (`_head_slices`): with G rows a position (G = 3) it spilled 104
    # registers at D = 64 and 140 at D = 128, and ran 1.4-1.6x slower than with the heads padded to 4 (H200: 1 x 32k,
    # D = 64, 0.83 -> 1.15 ms); slices of 2 + 1 rows a position do a quarter fewer steps than the padding.
    n_tiles = triton.cdiv(NC, _KEYS_BWD)
    chunk = _dkdv_chunk(T, n_tiles, B * H)
    n_chunks = triton.cdiv(T, chunk)
    dk_part = torch.empty(n_chunks, B, NC, H, D, device=q.device, dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    if NC:
        triton_common.op_launch(_bwd_dkdv_kernel)[(n_tiles, n_chunks, B * H)](
            q, *triton_common.kv_sources(k, v), doc_start, doc_end, do, lse, delta, dk_part, dv_part, T, NC, q_start,
            q_start_odd, chunk, scale * LOG2E, scale, BN=_KEYS_BWD, **_tiling(HQ // H, D, q.dtype, sliced=True),
            **args)
    return dq, dk_part.sum(0).to(k.dtype), dv_part.sum(0).to(v.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, gate, block, stride, scale, doc_start, q_start, q_start_odd = inputs
    _, lse, o = output
    ctx.mark_non_differentiable(o)  # the backward's, not the model's
    # Absent gradients stay None: the backward takes its gated path only where lse has none.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, gate, o, lse, doc_start)
    ctx.block, ctx.stride, ctx.scale, ctx.q_start, ctx.q_start_odd = block, stride, scale, q_start, q_start_odd


def _backward(ctx, do, dlse, _):
    q, k, v, gate, o, lse, doc_start = ctx.saved_tensors
    if do is None:  # only lse is differentiated
        do = torch.zeros_like(o)
    dgate = triton_common.softmax_delta(o, do, None)  # rowsum(o * dO): the gate's gradient
    if dlse is None:
        # exp(s - gated lse) = g P, so the gated output's dO serves the kernels as it is (no g dO written), and
        # its dS = g P (dP - rowsum(o dO)): the gate's gradient is also the kernels' delta.
        do_k, lse_k, delta = do, triton_common.gated_lse(lse, gate), dgate
    else:
        # An lse gradient adds dlse P to dS, which g P cannot carry where g = 0 (dlse / g): the ungated
        # probabilities against g dO.
        do_k = gate.to(do.dtype)[..., None] * do
        lse_k, delta = lse, gate.float() * dgate - dlse  # rowsum(o * g dO) - dlse
    dq, dk, dv = compressed_attention_bwd(do_k, q, k, v, lse_k, delta, ctx.block, ctx.stride, ctx.scale, doc_start,
                                          ctx.q_start, ctx.q_start_odd)
    return dq, dk, dv, dgate.to(gate.dtype), None, None, None, None, None, None


compressed_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
