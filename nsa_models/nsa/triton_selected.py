"""Selected-block attention (NSA branch 4) in Triton: forward and deterministic backward, as torch custom ops.

Layout as the reference: q, o [B, T, HQ, D]; k, v [B, TK, H, D]; block_indices [B, H, T, n] int64 (-1 = none),
shared by the G = HQ / H query heads of a KV group. Query row r sits at position t = q_start + r of the keys'
sequence (q_start + T <= TK; q_start a runtime argument, 0 unless context parallelism hands a shard's chunks of
queries, whose two chunks are the even and odd batch rows of one call, at q_start and q_start_odd) and attends the
tokens u <= t of its chosen blocks. Work lists and dK/dV cover the TK / l' key blocks.

Two layouts for the forward and dQ, chosen from the static shapes by `_key_major`:
- Query tiles (G >= 16, or few blocks): one program per (tile of consecutive queries, batch, KV head) holds the
  G heads of each of its queries as the rows of one tile (about `_TILE_ROWS` rows: 21 queries at G = 3; at
  G >= 16 one query, or 4 with few blocks: `_queries_per_tile`), so small groups do not leave the matrix units'
  rows empty. It runs an online softmax over the union of the tile's chosen blocks (ascending, built with torch
  ops), masking per row the blocks that row's query did not choose (a packed tile reads that from a per-query
  bitmask over its union, `_tile_blocks`): a key block is loaded once per tile instead of once per query (through
  TMA, except in packed tiles that compare block lists). dQ: same tiles, recomputing the probabilities from the
  log-sum-exp; or, where a tile's union is wide (`_dq_by_key_blocks`), the key-block-major dQ terms below.
- Key-block-major (Flash Sparse Attention's order; G < 16 with many blocks): one program per work item, a key
  block with up to `_ITEM_QUERIES` of the queries that chose it (fewer in small calls: `_item_queries`), all
  their G heads as rows. The forward writes each (query row, chosen block) pair's normalised output and
  log-sum-exp into the pair's slot, and a second kernel merges a row's slots; the backward's dK/dV kernel also
  writes each pair's dQ term, summed per row the same way. The work is exactly the chosen pairs, whatever the
  queries of a tile would have chosen.
dK/dV (both layouts): without float atomics, so that the result is bitwise reproducible. A reverse index (key
block -> the queries that chose it, ascending) is built with torch ops and cut into those work items, so that
block 0 (chosen by every query) does not serialise the kernel; each item writes fp32 partial sums and a second
kernel adds a block's items in order. The tiles' unions and the reverse index are built once per call
(`work_lists`), outside the ops, and serve the forward and the backward.
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
    load_head_rows,
    load_rows,
    online_softmax_update,
    query_offsets,
    row_offset,
    softmax_output,
)

# (query, slot) pairs per key-block work item: bounds the longest program (block 0 is chosen by every query). Fewer
# items mean fewer fp32 dK/dV partial tiles to write and add. Measured (H200, selected fwd+bwd, 256 -> 1024): 1 x 32k
# G = 3 D = 64 4.07 -> 3.53 ms, 4 x 8k G = 3 3.62 -> 3.35, 1 x 64k G = 3 8.06 -> 6.95, 32k G = 1 D = 128 44.4 -> 39.0,
# G = 4 31.1 -> 29.4, 64k G = 16 52.5 -> 52.3, 8k G = 16 6.15 -> 6.22; 2048 and up lost at G = 3 and 8k G = 16.
_ITEM_QUERIES = 1024
# A call with few (query, slot) pairs (one short sequence) cuts its items smaller, down to _ITEM_QUERIES_MIN, so
# that it has about _MIN_ITEMS of them: with 1024-pair items, the items of block 0 and of the recent blocks (which
# every query chose) are a few long programs that the rest of the GPU waits for (`_item_queries`).
_MIN_ITEMS = 1024
_ITEM_QUERIES_MIN = 64
_ITEM_ROWS = 64  # rows (queries x heads) per step of a key-block work item
# Rows per step of the dK/dV kernel with the dQ term at G >= 3 and D > 64. Measured (H200, D = 128, bwd op, 64 ->
# 128 rows on 8 warps): G = 4 (32k) 27.87 -> 23.12 ms, G = 8 (32k) 26.00 -> 22.07; G = 2 even (30.97 / 31.03) and
# G = 1 slower (37.35 / 40.08), so those keep 64; so does D <= 64 (on 4 warps: see selected_attention_bwd) and the
# kernel without the dQ term (4 warps: 30.23 -> 38.70 at 64k, G = 16).
_ITEM_ROWS_DQ = 128
_TILE_ROWS = 64  # rows (queries x heads) aimed at per forward / dQ tile
_ROW_BITS_MAX = 64  # union places a query's bitmask covers (one int64); wider unions compare lists (`_tile_blocks`)


@triton.jit
def _load_block(K, V, b, h, blk, u, d, d_ok, T, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                BD: tl.constexpr, TMA: tl.constexpr):
    """Positions [BS] and keys/values [BS, BD] of selection block `blk` of KV head h of batch b; block -1
    (padding) gives negative positions and zeros. No branch on `blk`: the loop stays a straight line, which the
    pipeliner can prefetch through."""
    return (blk * BS + u, load_head_rows(K, b, h, blk * BS, T, d, d_ok, BS, H, D, BD, TMA),
            load_head_rows(V, b, h, blk * BS, T, d, d_ok, BS, H, D, BD, TMA))


@triton.jit
def _query_tile(IDX, TILE_BLOCKS, TILE_COUNTS, TILE_BITS, T, N_SEL, L, H: tl.constexpr, G: tl.constexpr,
                D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr,
                BD: tl.constexpr, ROW_BITS: tl.constexpr):
    """This program's query tile (grid: query tiles x batch * KV heads); row r is head r % G of query
    tile * QT + r // G. Returns the query positions [BM], the rows of [B * T * HQ] [BM], which rows exist [BM],
    what each row's query chose (ROW_BITS: its bitmask of union positions [BM], else its chosen blocks [BM, NP],
    -1: none), the tile's number of union blocks, where its union list starts, the head-dim lanes [BD] and their
    validity, key lanes [BS], the batch and the KV head."""
    tile = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    r = tl.arange(0, BM)
    t = tile * QT + r // G
    row_ok = (r < QT * G) & (t < T)
    rows = (b * T + t) * (H * G) + h * G + r % G
    if ROW_BITS:
        chosen = tl.load(TILE_BITS + bh * T + t, mask=row_ok, other=0)
    else:
        s = tl.arange(0, NP)
        chosen = tl.load(IDX + (bh * T + t)[:, None] * N_SEL + s[None, :],
                         mask=row_ok[:, None] & (s < N_SEL)[None, :], other=-1)
    tile_id = bh * tl.cdiv(T, QT) + tile
    d = tl.arange(0, BD)
    return (t, rows, row_ok, chosen, tl.load(TILE_COUNTS + tile_id), TILE_BLOCKS + tile_id * L, d, d < D,
            tl.arange(0, BS), b, h)


@triton.jit
def _visible(chosen, blk, i, pos, t, ROW_BITS: tl.constexpr):
    """[BM, BS] mask: the row's query chose block `blk`, the tile's i-th union block (not padding), and may see
    the key (causal). With ROW_BITS, bit i of the row's bitmask says it chose the block: one shift a step instead
    of a reduction over the row's list, whose result also had to change register layout through shared memory
    (packed tiles' kernels measured 4-17% faster, see `_tile_blocks`)."""
    if ROW_BITS:
        row_chose = ((chosen >> i) & 1) != 0
    else:
        row_chose = tl.sum((chosen == blk).to(tl.int32), 1) > 0
    return row_chose[:, None] & (pos >= 0)[None, :] & (pos[None, :] <= t[:, None])


@triton.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_SEL", "L"])  # one compile for every length and offset
def _fwd_kernel(Q, K, V, IDX, TILE_BLOCKS, TILE_COUNTS, TILE_BITS, O, LSE, T, TK, Q0, Q0_ODD, N_SEL, L, qk_scale,
                H: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr,
                NP: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                ROW_BITS: tl.constexpr):
    t, rows, row_ok, chosen, count, blocks, d, d_ok, u, b, h = _query_tile(
        IDX, TILE_BLOCKS, TILE_COUNTS, TILE_BITS, T, N_SEL, L, H, G, D, BS, QT, BM, NP, BD, ROW_BITS)
    Q0 = row_offset(Q0, Q0_ODD, b)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for i in range(count):
        blk = tl.load(blocks + i)
        pos, k, v = _load_block(K, V, b, h, blk, u, d, d_ok, TK, H, D, BS, BD, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(_visible(chosen, blk, i, pos, Q0 + t, ROW_BITS), s, float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, s, v, PRECISION)
    o, lse = softmax_output(m, l, acc)
    tl.store(O + rows[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_SEL", "L"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, IDX, TILE_BLOCKS, TILE_COUNTS, TILE_BITS, DQ, T, TK, Q0, Q0_ODD, N_SEL, L,
                   qk_scale, scale, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   QT: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                   TMA: tl.constexpr, ROW_BITS: tl.constexpr):
    t, rows, row_ok, chosen, count, blocks, d, d_ok, u, b, h = _query_tile(
        IDX, TILE_BLOCKS, TILE_COUNTS, TILE_BITS, T, N_SEL, L, H, G, D, BS, QT, BM, NP, BD, ROW_BITS)
    Q0 = row_offset(Q0, Q0_ODD, b)
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D)
    dq = tl.zeros([BM, BD], tl.float32)
    for i in range(count):
        blk = tl.load(blocks + i)
        pos, k, v = _load_block(K, V, b, h, blk, u, d, d_ok, TK, H, D, BS, BD, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(_visible(chosen, blk, i, pos, Q0 + t, ROW_BITS), tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + rows[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _item_block(K, V, ITEM_SEG, ITEM_START, ITEM_END, TK, N_BLK, H: tl.constexpr, D: tl.constexpr,
                BS: tl.constexpr, BD: tl.constexpr):
    """This program's work item (grid: items): its query range [start, end) in the reverse index, batch, KV head,
    the key block's positions [BS] and keys/values [BS, BD], head-dim lanes and their validity, and which key
    rows to store (none for items past the real count, see reverse_index)."""
    item = tl.program_id(0).to(tl.int64)
    seg = tl.load(ITEM_SEG + item)  # (batch * H + head) * N_BLK + key block
    start = tl.load(ITEM_START + item)
    end = tl.load(ITEM_END + item)
    bh, j = seg // N_BLK, seg % N_BLK
    b, h = bh // H, bh % H
    d, u = tl.arange(0, BD), tl.arange(0, BS)
    d_ok = d < D
    # An item past the real count has an empty range: it runs no step and stores nothing. (A vector & a loaded
    # scalar's comparison trips the Triton interpreter, hence u against a scalar.)
    used = u < tl.where(start < end, BS, 0)
    k = load_head_rows(K, b, h, j * BS, TK, d, d_ok, BS, H, D, BD, False)
    v = load_head_rows(V, b, h, j * BS, TK, d, d_ok, BS, H, D, BD, False)
    return item, start, end, b, h, j * BS + u, used, k, v, d, d_ok


@triton.jit
def _item_rows(QSLOT, qs, end, b, h, T, N_SEL: tl.constexpr, H: tl.constexpr, G: tl.constexpr, BR: tl.constexpr,
               QB: tl.constexpr):
    """The rows of one step of an item: row r is head r % G of its (qs + r // G)-th (query, slot) entry. Returns
    which rows exist, their query rows (at positions Q0 + t), their rows of [B * T * HQ] and the slot of the key
    block in the query's list (where per-(row, slot) partial results go)."""
    r = tl.arange(0, BR)
    ok = (r < QB * G) & (qs + r // G < end)
    entry = tl.load(QSLOT + qs + r // G, mask=ok, other=0)  # t * N_SEL + slot
    t = entry // N_SEL
    return ok, t, (b * T + t) * (H * G) + h * G + r % G, entry % N_SEL


@triton.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_BLK"])
def _fwd_item_kernel(Q, K, V, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, O_PART, LSE_PART, T, TK, Q0, Q0_ODD, N_BLK,
                     qk_scale,
                     N_SEL: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     BR: tl.constexpr, QB: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """Key-block-major forward: each (query row, chosen block) pair's softmax over that block alone, normalised,
    and its log-sum-exp (log2 units), into the pair's slot; `_combine_kernel` merges a row's slots."""
    item, start, end, b, h, pos, used, k, v, d, d_ok = _item_block(K, V, ITEM_SEG, ITEM_START, ITEM_END, TK, N_BLK,
                                                                   H, D, BS, BD)
    Q0 = row_offset(Q0, Q0_ODD, b)
    for qs in range(start, end, QB):
        ok, t, rows, slot = _item_rows(QSLOT, qs, end, b, h, T, N_SEL, H, G, BR, QB)
        qd_mask = ok[:, None] & d_ok[None, :]
        q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(ok[:, None] & (pos[None, :] <= Q0 + t[:, None]), s, float("-inf"))
        m, l, acc = online_softmax_update(tl.full([BR], float("-inf"), tl.float32), tl.zeros([BR], tl.float32),
                                          tl.zeros([BR, BD], tl.float32), s, v, PRECISION)
        o, lse = softmax_output(m, l, acc)
        part = rows * N_SEL + slot
        tl.store(O_PART + part[:, None] * D + d[None, :], o.to(O_PART.dtype.element_ty), mask=qd_mask)
        tl.store(LSE_PART + part, lse * 1.4426950408889634, mask=ok)


@triton.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_BLK"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, DK_PART, DV_PART, DQ_PART, T,
                     TK, Q0, Q0_ODD, N_BLK, qk_scale, scale, N_SEL: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr, QB: tl.constexpr, BD: tl.constexpr,
                     PRECISION: tl.constexpr, WITH_DQ: tl.constexpr):
    """dK/dV partial sums of one item; with WITH_DQ (key-block-major layout) also each (query row, chosen block)
    pair's dQ term, into the pair's slot of DQ_PART."""
    item, start, end, b, h, pos, used, k, v, d, d_ok = _item_block(K, V, ITEM_SEG, ITEM_START, ITEM_END, TK, N_BLK,
                                                                   H, D, BS, BD)
    Q0 = row_offset(Q0, Q0_ODD, b)
    dk = tl.zeros([BS, BD], tl.float32)
    dv = tl.zeros([BS, BD], tl.float32)
    for qs in range(start, end, QB):
        ok, t, rows, slot = _item_rows(QSLOT, qs, end, b, h, T, N_SEL, H, G, BR, QB)
        qd_mask = ok[:, None] & d_ok[None, :]
        q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, ok, qd_mask, d, D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BR, BS]
        visible = ok[:, None] & (pos[None, :] <= Q0 + t[:, None])
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        if WITH_DQ:
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * scale
            tl.store(DQ_PART + (rows * N_SEL + slot)[:, None] * D + d[None, :], dq.to(DQ_PART.dtype.element_ty),
                     mask=qd_mask)
    part = item * BS * D + tl.arange(0, BS)[:, None] * D + d[None, :]
    tl.store(DK_PART + part, dk * scale, mask=used[:, None] & d_ok[None, :])
    tl.store(DV_PART + part, dv, mask=used[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T", "N_SEL", "N_ROWS"])
def _combine_kernel(PART, LSE_PART, IDX, OUT, LSE, T, N_SEL, N_ROWS, H: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, SOFTMAX: tl.constexpr):
    """Merge each query row's per-slot results in slot order (deterministic), over the slots its query filled
    (block index >= 0). SOFTMAX: the forward's partial outputs, weighted by their log-sum-exps, and the row's
    natural-log lse; else a plain sum (dQ)."""
    row = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # rows of [B * T * HQ]
    row_ok = row < N_ROWS
    bt, hq = row // (H * G), row % (H * G)
    b, t = bt // T, bt % T
    s = tl.arange(0, NP)
    chosen = tl.load(IDX + ((b * H + hq // G) * T + t)[:, None] * N_SEL + s[None, :],
                     mask=row_ok[:, None] & (s < N_SEL)[None, :], other=-1)
    filled = chosen >= 0
    if SOFTMAX:
        lse_s = tl.load(LSE_PART + row[:, None] * N_SEL + s[None, :], mask=filled, other=float("-inf"))
        m = tl.max(lse_s, 1)
        w = tl.exp2(lse_s - tl.where(m == float("-inf"), 0.0, m)[:, None])  # 0: empty slot or no key seen
    else:
        w = filled.to(tl.float32)
    d = tl.arange(0, BD)
    d_ok = d < D
    acc = tl.zeros([BM, BD], tl.float32)
    for slot in range(N_SEL):
        w_slot = tl.sum(tl.where(s[None, :] == slot, w, 0.0), 1)
        mask = row_ok[:, None] & d_ok[None, :] & (w_slot != 0)[:, None]
        acc += w_slot[:, None] * tl.load(PART + (row * N_SEL + slot)[:, None] * D + d[None, :], mask=mask,
                                         other=0.0).to(tl.float32)
    if SOFTMAX:  # the slots' outputs weighted by their shares of the row's softmax mass
        acc, lse = softmax_output(m, tl.sum(w, 1), acc)
        tl.store(LSE + row, lse, mask=row_ok)
    tl.store(OUT + row[:, None] * D + d[None, :], acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["TK", "N_BLK"])
def _bwd_reduce_kernel(DK_PART, DV_PART, SEG_ITEMS, DK, DV, TK, N_BLK, H: tl.constexpr, D: tl.constexpr,
                       BS: tl.constexpr, BD: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    bh, j = seg // N_BLK, seg % N_BLK
    b, h = bh // H, bh % H
    d, u = tl.arange(0, BD), tl.arange(0, BS)
    d_ok = d < D
    lo = tl.load(SEG_ITEMS + seg)
    hi = tl.load(SEG_ITEMS + seg + 1)
    dk = tl.zeros([BS, BD], tl.float32)
    dv = tl.zeros([BS, BD], tl.float32)
    for item in range(lo, hi):  # in item order: a fixed summation order
        part = item * BS * D + u[:, None] * D + d[None, :]
        dk += tl.load(DK_PART + part, mask=d_ok[None, :], other=0.0)
        dv += tl.load(DV_PART + part, mask=d_ok[None, :], other=0.0)
    pos = j * BS + u
    out = b * TK * H * D + h * D + pos[:, None] * (H * D) + d[None, :]
    mask = (pos < TK)[:, None] & d_ok[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)


def _queries_per_tile(G: int, n_blocks: int, n: int) -> int:
    """Queries whose G heads share one forward / dQ tile: about _TILE_ROWS rows below G = 16; from there one
    query, or _TILE_ROWS // G with at most 8n blocks.

    Packing pays while it fills empty rows; at G >= 16 one query's heads already fill a 16-row tile, and each
    added query widens the union of blocks the tile visits: with many blocks that costs more than the shared
    loads save, with few the queries share most of theirs. Measured (H200, G = 16, D = 128, random selections,
    selected fwd + bwd ops, 1 -> 4 queries): 4k (4n blocks) 2.97 -> 2.41 ms, 8k (8n) 5.78 -> 5.43; 16k 11.54 ->
    12.33, 32k 25.08 -> 27.00; 2 queries were slower at every length."""
    packed = max(1, _TILE_ROWS // G)
    return packed if G < 16 or n_blocks <= 8 * n else 1


def _tile_blocks(block_indices: Tensor, n_blocks: int, QT: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per tile of QT consecutive queries of one (batch, KV head): the union of their chosen blocks, ascending and
    -1 padded [B, H, T / QT, L], and its size [B, H, T / QT] int32; and per query which of its tile's union blocks
    it chose, as a bitmask [B, H, T] int64 (bit p: the p-th) when the union has `_ROW_BITS_MAX` places at most
    (else empty: the kernels then compare each block with the query's list). One query per tile: its own list, as
    is, and no bitmask.

    The bitmask makes a step's row test one shift. Measured (H200, bf16, random choices, selected ops, ms, list
    comparison -> bitmask): forward 8k G = 16 (4-query tiles) 1.80 -> 1.72, 4k 0.695 -> 0.667, nsa-125m (G = 3,
    21-query tiles) 16 x 2k 0.571 -> 0.463, 8 x 2k 0.305 -> 0.250; the tiles' dQ kernel alone 8k 1.953 -> 1.857,
    16 x 2k 0.527 -> 0.444. Outputs bitwise the same. One-query tiles (whose rows all chose every block but the
    padding) lost with it: forward 64k 14.22 -> 14.88, 16k 3.48 -> 3.67."""
    B, H, T, n = block_indices.shape
    if QT == 1:
        return block_indices, block_indices.new_full((B, H, T), n, dtype=torch.int32), block_indices.new_empty(0)
    n_tiles = triton.cdiv(T, QT)
    idx = F.pad(block_indices, (0, 0, 0, n_tiles * QT - T), value=-1).view(B, H, n_tiles, QT * n)
    # Column n_blocks collects the padding; it is dropped.
    present = torch.zeros(B, H, n_tiles, n_blocks + 1, dtype=torch.bool, device=idx.device)
    present = present.scatter_(3, torch.where(idx < 0, n_blocks, idx), True)[..., :n_blocks]
    L = min(QT * n, n_blocks)
    slot = torch.where(present, torch.cumsum(present, -1) - 1, L)  # absent blocks go to the dropped slot L
    blocks = idx.new_full((B, H, n_tiles, L + 1), -1)
    blocks = blocks.scatter_(3, slot, torch.arange(n_blocks, device=idx.device).expand_as(slot))[..., :L]
    blocks, counts = blocks.contiguous(), present.sum(-1, dtype=torch.int32)
    if L > _ROW_BITS_MAX:
        return blocks, counts, block_indices.new_empty(0)
    # The union place of each query's chosen block (under padding: any; it sets no bit). A query's chosen blocks
    # are distinct, so the sum of their bits is their bitwise or (bit 63 wraps to the sign).
    union_slot = slot.gather(3, idx.clamp(min=0)).view(B, H, n_tiles * QT, n)[:, :, :T]
    return blocks, counts, torch.where(block_indices >= 0, 1 << union_slot, 0).sum(-1)


def _key_major(G: int, n_blocks: int, n: int) -> bool:
    """Whether the forward and dQ run key-block-major (Flash Sparse Attention's order: each key block with the
    queries that chose it, per-(query, slot) results merged afterwards) instead of by query tiles.

    Below G = 16 once there are more than 2n blocks: a packed query tile then walks a union that grows with its
    queries' differing choices (random choices at 32k, G = 1: 233 blocks per tile, 16 of them useful per row),
    while key-block-major work is exactly the chosen pairs, at the price of per-slot partials in memory
    ([B, T, HQ, n, D]). At 2n blocks the first half of the queries choose every block they see, and the tiles
    win. Measured (H200, bf16, random choices, selected fwd+bwd ms, tiles -> key blocks): 4n: 8 x 4k G = 3
    D = 64 3.08 -> 2.94, 4 x 4k G = 4 D = 128 12.94 -> 12.48, G = 2 15.72 -> 15.31; 2n: 16 x 2k G = 3 D = 64
    2.44 -> 2.70, 4 x 2k G = 1 D = 128 6.47 -> 7.91, 8 x 1k G = 8 3.66 -> 4.77. G >= 16 keeps query tiles: one
    query's heads fill the rows, and writing and re-reading n partial outputs per row would outweigh that."""
    return G < 16 and n_blocks > 2 * n


def _dq_by_key_blocks(G: int, n_blocks: int, n: int, D: int) -> bool:
    """Whether a query-tile forward's backward takes dQ from the key-block-major dK/dV kernel (each (query row,
    chosen block) pair's dQ term, summed per row) instead of the tiles' dQ kernel (`_key_major` layouts always do).

    The dQ kernel walks a tile's union of blocks; the key-block-major terms are exactly the chosen pairs but cost
    a [B, T, HQ, n, D] write and read. The terms win once a tile holds several queries, except at head dim > 64
    (terms twice as large) while the union stays tight: up to 4n blocks (2n below G = 16, where the tiles end).
    Measured (H200, bf16, random choices, selected fwd+bwd ms, dQ kernel -> terms): D = 64: 16 x 2k G = 3 2.71
    -> 2.43, 16 x 2k G = 1 3.18 -> 2.93; D = 128: 8k G = 16 6.28 -> 6.06, 6k G = 16 4.61 -> 4.58, but 4k
    G = 16 2.88 -> 2.98, 4 x 2k G = 16 4.22 -> 4.76, 4 x 2k G = 1 6.44 -> 7.28. One-query tiles (G >= 16 past
    8n blocks) keep the dQ kernel: even (32k: 23.90 -> 23.88; 64k: 46.62 -> 46.81) and 17 GB less memory at
    64k with 64 heads."""
    return _queries_per_tile(G, n_blocks, n) > 1 and (D <= 64 or n_blocks > 4 * n)


def _layout_shape(q: Tensor, k: Tensor, block_indices: Tensor, block_size: int) -> tuple[int, int, int]:
    """(G, key blocks, n) of these inputs: what `_key_major` and `_queries_per_tile` decide from, so that the
    public function, the work lists and both ops agree on the layout and the tiles."""
    return q.shape[2] // k.shape[2], triton.cdiv(k.shape[1], block_size), block_indices.shape[3]


def _tile_args(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, tile_blocks: Tensor, tile_counts: Tensor,
               tile_bits: Tensor, block_size: int, q_starts: tuple[int, int],
               dq: bool) -> tuple[tuple[int, int], dict]:
    """Grid and the keyword arguments of the forward (or, with dq, the dQ) kernel: the key/value descriptors, the
    chosen blocks, the tiles' union lists, sizes and row bitmasks (`work_lists`), lengths, and meta-parameters."""
    B, T, HQ, D = q.shape
    H, n = k.shape[2], block_indices.shape[3]
    G = HQ // H
    QT = _queries_per_tile(*_layout_shape(q, k, block_indices, block_size))
    rows = max(16, triton.next_power_of_2(QT * G))
    # One query of G = 16 fills 16 rows: 2 warps cover them (measured 6-9% faster than 4 at 8k and 64k, G = 16).
    # Key blocks come through TMA, with fewer instructions and registers than pointer loads. Measured (H200, bf16,
    # kernels alone, pointer loads -> TMA, forward / dQ): one-query tiles (G = 16, D = 128, bound by the L2 traffic
    # of a key block per 16 rows) 64k 16.56 / 17.21 -> 14.28 / 15.63 ms, 16k 4.09 / 4.20 -> 3.58 / 3.91; packed
    # tiles with row bitmasks (`_tile_blocks`) 8k G = 16 1.681 / 1.823 -> 1.394 / 1.744, 4k 0.636 / 0.704 ->
    # 0.537 / 0.674, nsa-125m 16 x 2k (G = 3, D = 64) 0.465 / 0.458 -> 0.450 / 0.427. Packed tiles that compare
    # block lists (unions wider than 64) keep pointer loads: with TMA they were not measured.
    row_bits = tile_bits.numel() > 0
    tma = rows <= 16 or row_bits
    k_operand, v_operand = (triton_common.head_rows_operand(x, block_size, tma) for x in (k, v))
    tile = dict(K=k_operand, V=v_operand, IDX=block_indices,
                TILE_BLOCKS=tile_blocks, TILE_COUNTS=tile_counts, TILE_BITS=tile_bits, T=T, TK=k.shape[1],
                Q0=q_starts[0], Q0_ODD=q_starts[1],
                N_SEL=n,
                L=tile_blocks.shape[3], H=H, G=G, D=D, BS=block_size, QT=QT, BM=rows, NP=triton.next_power_of_2(n),
                BD=triton.next_power_of_2(D), PRECISION=triton_common.dot_precision(q.dtype), TMA=tma,
                ROW_BITS=row_bits,
                num_warps=2 if rows <= 16 else 4,
                # 3 pipeline stages for the dQ of one-query tiles: 64k, G = 16, 15.63 -> 15.22 ms, 16k 3.91 -> 3.72;
                # packed tiles' dQ loses (TMA, 8k G = 16: 1.744 -> 2.039), and so did the one-query forward (64k
                # 14.28 -> 15.23). The forward of packed tiles at D = 128 gains (TMA, 8k G = 16 1.540 -> 1.394, 4k
                # 0.584 -> 0.537) and at D = 64 loses (nsa-125m 16 x 2k 0.450 -> 0.476); 4 stages lose everywhere.
                num_stages=3 if (dq and rows <= 16) or (not dq and rows > 16 and D > 64) else 2)
    return (triton.cdiv(T, QT), B * H), tile


def _check(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int,
           q_starts: tuple[int, int]) -> None:
    B, T, HQ, D = q.shape
    H = k.shape[2]
    inside = all(0 <= start <= k.shape[1] - T for start in q_starts)
    if k.shape != (B, k.shape[1], H, D) or v.shape != k.shape or HQ % H or not inside:
        raise ValueError(f"selected attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} "
                         "must be [B, T, HQ, D] and [B, TK, H, D] with H dividing HQ and the queries' positions "
                         f"q_start = {' and '.join(map(str, dict.fromkeys(q_starts)))} .. q_start + T - 1 inside "
                         "the TK keys")
    if block_indices.shape[:3] != (B, H, T) or block_indices.dtype != torch.int64:
        raise ValueError(f"selected attention: block_indices must be int64 [B, H, T, n] = [{B}, {H}, {T}, n], "
                         f"got {block_indices.dtype} {tuple(block_indices.shape)}")
    triton_common.check_batch_heads(B, H, "selected attention")
    if not 16 <= block_size <= 256 or block_size & (block_size - 1):
        raise ValueError(f"selected attention: block size {block_size} must be a power of two from 16 to 256 "
                         "(the rows of a TMA box)")


KERNELS = ("triton", "gluon_hopper")  # `selected_attention`'s kernels (model.nsa.selected_kernels)


def _gluon(kernels: str, load: bool = True):
    """The `gluon_selected` module when `kernels` chooses it (imported only then: CPU installs and the Triton
    interpreter never load Gluon), else None; ValueError for an unknown choice."""
    if kernels not in KERNELS:
        raise ValueError(f"selected attention: kernels = {kernels!r}; valid: {', '.join(map(repr, KERNELS))}")
    if kernels == "triton" or not load:
        return None
    from nsa_models.nsa import gluon_selected

    return gluon_selected


@torch.library.custom_op("nsa::selected_attention_fwd", mutates_args=())
def selected_attention_fwd(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, items: Tensor,
                           query_slot: Tensor, seg_items: Tensor, tile_blocks: Tensor, tile_counts: Tensor,
                           tile_bits: Tensor, block_size: int, scale: float, q_start: int = 0,
                           q_start_odd: int | None = None, kernels: str = "triton") -> tuple[Tensor, Tensor]:
    """Returns o [B, T, HQ, D] (dtype of q) and the natural-log lse [B, T, HQ] (fp32; -inf: no visible key).
    items ... tile_bits: `work_lists(q, k, block_indices, block_size)`; q_start: the first query's position
    (q_start_odd: in odd batch rows, if it differs); kernels: `selected_attention`'s."""
    q_starts = query_offsets(q_start, q_start_odd)
    gluon = _gluon(kernels)
    q, k, v, block_indices = q.contiguous(), k.contiguous(), v.contiguous(), block_indices.contiguous()
    B, T, HQ, D = q.shape
    n = block_indices.shape[3]
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    if _key_major(*_layout_shape(q, k, block_indices, block_size)):
        o_part = q.new_empty(B, T, HQ, n, D)  # normalised per slot: the input's precision suffices
        lse_part = q.new_empty(B, T, HQ, n, dtype=torch.float32)
        # 3 pipeline stages at D = 128: 32k G = 1 13.5 -> 12.7 ms, G = 4 11.2 -> 10.2; at nsa-125m's D = 64, 2
        # (G = 3, 4 x 8k: 1.38 with 2, 1.48 with 3; 1 x 64k: 2.64, 2.90).
        item_args = _item_args(q, k, n, items, query_slot, block_size, q_starts, _ITEM_ROWS,
                               stages=3 if D > 64 else 2)
        if gluon is None:
            _fwd_item_kernel[(items.shape[1],)](q, k, v, O_PART=o_part, LSE_PART=lse_part, qk_scale=scale * LOG2E,
                                                num_warps=4, **item_args)
        else:  # the same arguments (and grid: one program per item); its own warps and pipeline
            gluon.gluon_fwd_items(q, k, v, O_PART=o_part, LSE_PART=lse_part, qk_scale=scale * LOG2E, **item_args)
        _combine(o_part, lse_part, block_indices, o, lse)
    else:
        grid, tile = _tile_args(q, k, v, block_indices, tile_blocks, tile_counts, tile_bits, block_size, q_starts,
                                dq=False)
        _fwd_kernel[grid](q, O=o, LSE=lse, qk_scale=scale * LOG2E, **tile)
    return o, lse


@selected_attention_fwd.register_fake
def _(q, k, v, block_indices, items, query_slot, seg_items, tile_blocks, tile_counts, tile_bits, block_size,
      scale, q_start=0, q_start_odd=None, kernels="triton"):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _item_queries(pairs: int) -> int:
    """(query, slot) entries per work item for a call of `pairs` entries: _ITEM_QUERIES, or fewer (a power of two,
    _ITEM_QUERIES_MIN at least) when that would give fewer than _MIN_ITEMS items. A static function of the shapes:
    one graph per shape, as ever."""
    return min(_ITEM_QUERIES, max(_ITEM_QUERIES_MIN, triton.next_power_of_2(max(1, pairs // _MIN_ITEMS))))


def _sort_key_dtype(n_segs: int) -> torch.dtype:
    """The reverse index's sort keys: the narrowest of int16 / int32 that holds segment ids 0 .. n_segs (n_segs:
    the padding's)."""
    return torch.int16 if n_segs <= torch.iinfo(torch.int16).max else torch.int32


def reverse_index(block_indices: Tensor, block_size: int,
                  seq_len: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Work items over (batch, KV head, key block) -> the (query, slot) pairs that chose the block, in ascending
    query order (a query's chosen blocks must be distinct, as the selection gives them). seq_len: the keys'
    length, which sets the key blocks (default: the queries' T).

    Returns `items` [3, max_items]: per item its segment (b * H + h) * n_blocks + j and its [start, end) range in
    `query_slot` (entries t * n + slot: the query and where the block sits in its list); `query_slot`; and per
    segment the [first, last + 1) range of its items. A stable sort is deterministic. No device-to-host sync
    (so a backward can be captured in a CUDA graph and the host never waits): the item count is bounded from the
    shapes, and the items past the real count get empty ranges.
    """
    B, H, T, n = block_indices.shape
    n_blocks = triton.cdiv(T if seq_len is None else seq_len, block_size)
    device = block_indices.device
    n_segs = B * H * n_blocks
    # A stable sort of each entry's segment (its padding: n_segs, past every segment) orders the entries by segment
    # and, within one, by query (the flattened [B, H, T, n] order); the sort's indices give each entry's t * n + slot.
    # Every key and every value compared is at most n_segs, so the keys take the narrowest integer type that holds
    # it: 16 bits up to 32,767 segments (nsa-125m's 2048 at 2k and 8k, 8192 at 128k), a radix sort of half the
    # passes of 32-bit keys, which hold the rest. Sorting segment * T + t instead needed 64-bit keys past 2^31
    # (B * H * T^2 / l' of them: nsa-125m from 185k tokens on), and there Inductor's GPU code for the segment
    # bounds' search values (arange * T) overflowed: wrong work items and NaN outputs under torch.compile (eager
    # was right).
    if n_segs >= torch.iinfo(torch.int32).max:
        raise ValueError(f"selected attention: {n_segs} (batch x KV head x key block) segments do not fit the "
                         "reverse index's 32-bit keys: split the batch")
    key_dtype = _sort_key_dtype(n_segs)
    seg = torch.arange(B * H, device=device).view(B, H, 1, 1) * n_blocks + block_indices
    key = torch.where(block_indices >= 0, seg, n_segs).to(key_dtype).flatten()
    key, order = torch.sort(key, stable=True)
    query_slot = order % (T * n)
    # Segment s holds the entries [bounds[s], bounds[s + 1]).
    bounds = torch.searchsorted(key, torch.arange(n_segs + 1, device=device, dtype=key_dtype))
    per_item = _item_queries(key.numel())
    n_items = (bounds[1:] - bounds[:-1] + per_item - 1) // per_item
    seg_items = torch.cat([n_items.new_zeros(1), torch.cumsum(n_items, 0)])
    # Each non-empty segment has one partial item at most: no more than this many items, whatever was chosen.
    max_items = min(n_segs, key.numel()) + key.numel() // per_item
    item = torch.arange(max_items, device=device)
    item_seg = (torch.searchsorted(seg_items, item, right=True) - 1).clamp_(max=n_segs - 1)
    item_start = bounds[item_seg] + (item - seg_items[item_seg]) * per_item
    item_end = torch.where(item < seg_items[-1], torch.minimum(item_start + per_item, bounds[item_seg + 1]),
                           item_start)
    return torch.stack([item_seg, item_start, item_end]), query_slot, seg_items


def _item_args(q: Tensor, k: Tensor, n: int, items: Tensor, query_slot: Tensor, block_size: int,
               q_starts: tuple[int, int],
               rows: int, stages: int = 2) -> dict:
    """The keyword arguments the key-block-major kernels share (grid: one program per item): the work items,
    lengths, the first query's position and meta-parameters, `rows` per step at least."""
    B, T, HQ, D = q.shape
    TK, H = k.shape[1], k.shape[2]
    G = HQ // H
    rows = max(rows, triton.next_power_of_2(G))
    return dict(ITEM_SEG=items[0], ITEM_START=items[1], ITEM_END=items[2], QSLOT=query_slot, T=T, TK=TK,
                Q0=q_starts[0], Q0_ODD=q_starts[1],
                N_BLK=triton.cdiv(TK, block_size), N_SEL=n, H=H, G=G, D=D, BS=block_size, BR=rows, QB=rows // G,
                BD=triton.next_power_of_2(D), PRECISION=triton_common.dot_precision(q.dtype), num_stages=stages)


def _combine(part: Tensor, lse_part: Tensor | None, block_indices: Tensor, out: Tensor, lse: Tensor | None) -> None:
    """out [B, T, HQ, D] (and lse) from per-slot results part [B, T, HQ, n, D]: the forward's softmax merge when
    lse_part (fp32 [B, T, HQ, n], log2 units) is given, else the plain sum (dQ)."""
    B, T, HQ, n, D = part.shape
    H = block_indices.shape[1]
    rows, BM, BD = B * T * HQ, 16, triton.next_power_of_2(D)
    softmax = lse_part is not None
    # A memory-bound pass (it reads the [B, T, HQ, n, D] slots once): 16 rows a program and a slot's [16, BD] tile
    # spread as 16 elements per thread. Measured against 32 rows on 4 warps (H200, bf16, dQ sum / softmax merge,
    # ms): 8k G = 16 D = 128 0.641 / 0.685 -> 0.542 / 0.515; 32k G = 1 D = 128 2.644 / 2.817 -> 2.247 / 2.141;
    # nsa-125m (D = 64, 2 warps) 1 x 32k 0.242 / 0.270 -> 0.235 / 0.259, 16 x 2k 0.206 / 0.233 -> 0.201 / 0.226.
    # Results are bitwise the same (each row still adds its slots in order).
    _combine_kernel[(triton.cdiv(rows, BM),)](part, lse_part if softmax else part, block_indices, out,
                                              lse if softmax else out, T, n, rows, H=H, G=HQ // H, D=D, BM=BM,
                                              NP=triton.next_power_of_2(n), BD=BD, SOFTMAX=softmax,
                                              num_warps=max(1, BM * BD // (16 * 32)))


@torch.library.custom_op("nsa::selected_attention_bwd", mutates_args=())
def selected_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                           block_indices: Tensor, items: Tensor, query_slot: Tensor, seg_items: Tensor,
                           tile_blocks: Tensor, tile_counts: Tensor, tile_bits: Tensor, block_size: int,
                           scale: float, q_start: int = 0, q_start_odd: int | None = None,
                           kernels: str = "triton") -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv given do and delta = rowsum(o * do) - dlse [B, T, HQ] (fp32). Bitwise deterministic."""
    q_starts = query_offsets(q_start, q_start_odd)
    gluon = _gluon(kernels)
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    lse, delta, block_indices = lse.contiguous(), delta.contiguous(), block_indices.contiguous()
    B, T, HQ, D = q.shape
    G, n_blocks, n = _layout_shape(q, k, block_indices, block_size)
    # dQ from the dK/dV kernel's pairs, or from the query tiles' own kernel
    dq_terms = _key_major(G, n_blocks, n) or _dq_by_key_blocks(G, n_blocks, n, D)
    dq = torch.empty_like(q)
    if not dq_terms:
        grid, tile = _tile_args(q, k, v, block_indices, tile_blocks, tile_counts, tile_bits, block_size, q_starts,
                                dq=True)
        _bwd_dq_kernel[grid](q, DO=do, LSE=lse, DELTA=delta, DQ=dq, qk_scale=scale * LOG2E, scale=scale, **tile)
    n_items = items.shape[1]
    rows = _ITEM_ROWS_DQ if dq_terms and G >= 3 and D > 64 else _ITEM_ROWS
    # With the dQ term, 3 pipeline stages (32k, 1024 queries per item: G = 1 39.1 -> 38.2 ms, G = 3 3.52 -> 3.45,
    # G = 4 29.4 -> 28.0); without it (G = 16) 2 (64k: 52.4 with 2, 53.3 with 3; 8k: 6.20, 6.41).
    item_args = _item_args(q, k, n, items, query_slot, block_size, q_starts, rows, stages=3 if dq_terms else 2)
    dk_part = torch.empty(n_items, block_size, D, device=q.device, dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    # With dq_terms the dK/dV kernel also writes each (query row, chosen block) pair's dQ term, summed below in
    # fp32. The terms are stored in the input's precision, like the forward's per-slot outputs: they are
    # [B, T, HQ, n, D], written once and read once (17 GB in fp32 at 32k with 64 heads, twice the bf16 traffic).
    dq_part = q.new_empty(B, T, HQ, n, D) if dq_terms else dk_part
    # With the dQ term at D > 64, 8 warps: 4 spill, and 8 ran 1.3x faster (H200, 32k, G = 1). At D <= 64, 64 rows a
    # step on 4 warps fit without spilling and beat 128 rows on 8 (H200, G = 3, selected fwd+bwd: 1 x 32k 3.44 ->
    # 3.14 ms, 1 x 64k 6.73 -> 6.11; G = 1, 1 x 32k 4.62 -> 3.57). Without the term 4 warps stay faster despite
    # their smaller spill.
    dkdv = dict(DK_PART=dk_part, DV_PART=dv_part, DQ_PART=dq_part, qk_scale=scale * LOG2E, scale=scale,
                WITH_DQ=dq_terms, num_warps=8 if dq_terms and D > 64 else 4, **item_args)
    if gluon is not None:
        # the same arguments and grid; its own rows per step and warps (`gluon_selected.bwd_launch_shape`)
        gluon.gluon_bwd_dkdv_items(q, k, v, do, lse, delta, **dkdv)
    else:
        _bwd_dkdv_kernel[(n_items,)](q, k, v, do, lse, delta, **dkdv)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    H = item_args["H"]
    _bwd_reduce_kernel[(B * H * n_blocks,)](dk_part, dv_part, seg_items, dk, dv, k.shape[1], n_blocks, H=H, D=D,
                                            BS=block_size, BD=item_args["BD"], num_warps=4)
    if dq_terms:
        _combine(dq_part, None, block_indices, dq, None)
    return dq, dk, dv


@selected_attention_bwd.register_fake
def _(do, q, k, v, lse, delta, block_indices, items, query_slot, seg_items, tile_blocks, tile_counts, tile_bits,
      block_size, scale, q_start=0, q_start_odd=None, kernels="triton"):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    *tensors, block_size, scale, q_start, q_start_odd, kernels = inputs
    o, lse = output
    ctx.save_for_backward(o, lse, *tensors)
    ctx.block_size, ctx.scale, ctx.q_start, ctx.q_start_odd = block_size, scale, q_start, q_start_odd
    ctx.kernels = kernels


def _backward(ctx, do, dlse):
    o, lse, q, k, v, block_indices, *lists = ctx.saved_tensors
    delta = triton_common.softmax_delta(o, do, dlse)
    dq, dk, dv = selected_attention_bwd(do, q, k, v, lse, delta, block_indices, *lists, ctx.block_size, ctx.scale,
                                        ctx.q_start, ctx.q_start_odd, ctx.kernels)
    # block_indices, the work lists, block_size, scale, the offsets, kernels
    return dq, dk, dv, *[None] * (len(lists) + 6)


selected_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int,
                       scale: float | None = None, q_start: int | tuple[int, int] = 0,
                       kernels: str = "triton") -> Tensor:
    """NSA selected-branch output [B, T, HQ, D] of queries at positions q_start .. q_start + T - 1 of the keys
    k, v [B, TK, H, D] (a pair: the even batch rows' and the odd ones'); scale defaults to 1 / sqrt(D).
    kernels (`model.nsa.selected_kernels`): "triton", or "gluon_hopper": the key-block-major forward's item kernel
    and the backward's dK/dV kernel are `gluon_selected`'s (Hopper, bf16, head dim 64 or 128, blocks of 64 keys:
    `check_backend` and `ModelArgs.validate` refuse the rest; a call outside them raises), all else the same."""
    q_starts = query_offsets(q_start)
    _check(q, k, v, block_indices, block_size, q_starts)
    _gluon(kernels, load=False)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    block_indices = block_indices.contiguous()
    return selected_attention_fwd(q, k, v, block_indices, *work_lists(q, k, block_indices, block_size, backward),
                                  block_size, scale, *q_starts, kernels)[0]


def work_lists(q: Tensor, k: Tensor, block_indices: Tensor, block_size: int,
               backward: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the kernels iterate over, built once per call from the chosen blocks (torch ops: under torch.compile
    they fuse into the caller's graph) and passed to both ops: the reverse index (`reverse_index`: the work items
    of the key-block-major forward and of every backward's dK/dV) and, in the query-tile layout, each tile's
    union of blocks and its queries' bitmasks over it (`_tile_blocks`: the forward's and the dQ kernel's). Built
    in each op instead, the backward repeated the forward's (the reverse index's sort over B * H * T * n entries
    took ~2.8 ms per call at 32k, G = 1, H200). A list a call does not use is empty: the reverse index of a
    query-tile forward with no backward to follow (evaluation), the unions in the key-block-major layout."""
    empty = block_indices.new_empty
    G, n_blocks, n = _layout_shape(q, k, block_indices, block_size)
    key_major = _key_major(G, n_blocks, n)
    index = (reverse_index(block_indices, block_size, k.shape[1]) if backward or key_major
             else (empty(3, 0), empty(0), empty(0)))
    if key_major:
        return *index, empty(0), empty(0), empty(0)
    return *index, *_tile_blocks(block_indices, n_blocks, _queries_per_tile(G, n_blocks, n))
