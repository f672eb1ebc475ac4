"""Selected-block attention (NSA branch 4) in Triton: forward and deterministic backward, as torch custom ops.

Layout as the reference: q, o [B, T, HQ, D]; k, v [B, T, H, D]; block_indices [B, H, T, n] int64 (-1 = none),
shared by the G = HQ / H query heads of a KV group. Query t attends the tokens u <= t of its chosen blocks.

- Forward: one program per (tile of consecutive queries, batch, KV head) holds the G heads of each of its queries
  as the rows of one tile (about `_TILE_ROWS` rows: 21 queries at G = 3, one query at G >= 16), so small groups
  do not leave the matrix units' rows empty. It runs an online softmax over the union of the tile's chosen
  blocks (ascending, built with torch ops), masking per row the blocks that row's query did not choose: a key
  block is loaded once per tile instead of once per query. Writes o and the fp32 log-sum-exp.
- dQ: same grid and tiles as the forward, recomputing the probabilities from the log-sum-exp.
- dK/dV: without float atomics, so that the result is bitwise reproducible. A reverse index (key block -> the
  queries that chose it, ascending) is built with torch ops and cut into work items of at most `_ITEM_QUERIES`
  queries, so that block 0 (chosen by every query) does not serialise the kernel. Each item packs several
  queries x G heads into one tile and writes fp32 partial sums; a second kernel adds a block's items in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_ITEM_QUERIES = 256  # queries per dK/dV work item: bounds the longest program
_ROWS_BWD = 64  # rows (queries x heads) per tile in the dK/dV kernel
_TILE_ROWS = 64  # rows (queries x heads) aimed at per forward / dQ tile


@triton.jit
def _load_block(K, V, kv_base, blk, u, d, d_ok, T, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Positions [BS] and keys/values [BS, BD] of selection block `blk` of one (batch, KV head); block -1
    (padding) gives negative positions and zeros. No branch on `blk`: the loop stays a straight line, which the
    pipeliner can prefetch through."""
    pos = blk * BS + u
    kv_ptr = kv_base + pos[:, None] * (H * D) + d[None, :]
    kv_mask = ((pos >= 0) & (pos < T))[:, None] & d_ok[None, :]
    return pos, tl.load(K + kv_ptr, mask=kv_mask, other=0.0), tl.load(V + kv_ptr, mask=kv_mask, other=0.0)


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
def _query_tile(IDX, TILE_BLOCKS, TILE_COUNTS, T, N_SEL, L, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                BS: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    """This program's query tile (grid: query tiles x batch * KV heads); row r is head r % G of query
    tile * QT + r // G. Returns the query positions [BM], the rows of [B * T * HQ] [BM], which rows exist [BM],
    each row's chosen blocks [BM, NP] (-1: none), the tile's number of union blocks, where its union list starts,
    the head-dim lanes [BD] and their validity, key lanes [BS], and the offset of the (batch, KV head) in K/V."""
    tile = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    r = tl.arange(0, BM)
    t = tile * QT + r // G
    row_ok = (r < QT * G) & (t < T)
    rows = (b * T + t) * (H * G) + h * G + r % G
    s = tl.arange(0, NP)
    chosen = tl.load(IDX + (bh * T + t)[:, None] * N_SEL + s[None, :], mask=row_ok[:, None] & (s < N_SEL)[None, :],
                     other=-1)
    tile_id = bh * tl.cdiv(T, QT) + tile
    d = tl.arange(0, BD)
    return (t, rows, row_ok, chosen, tl.load(TILE_COUNTS + tile_id), TILE_BLOCKS + tile_id * L, d, d < D,
            tl.arange(0, BS), b * T * H * D + h * D)


@triton.jit
def _visible(chosen, blk, pos, t):
    """[BM, BS] mask: the row's query chose block `blk` (not padding) and may see the key (causal)."""
    row_chose = tl.sum((chosen == blk).to(tl.int32), 1) > 0
    return row_chose[:, None] & (pos >= 0)[None, :] & (pos[None, :] <= t[:, None])


@triton.jit(do_not_specialize=["T", "N_SEL", "L"])  # one compile for every length
def _fwd_kernel(Q, K, V, IDX, TILE_BLOCKS, TILE_COUNTS, O, LSE, T, N_SEL, L, qk_scale, H: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr, BM: tl.constexpr,
                NP: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    t, rows, row_ok, chosen, count, blocks, d, d_ok, u, kv_base = _query_tile(
        IDX, TILE_BLOCKS, TILE_COUNTS, T, N_SEL, L, H, G, D, BS, QT, BM, NP, BD)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for i in range(count):
        blk = tl.load(blocks + i)
        pos, k, v = _load_block(K, V, kv_base, blk, u, d, d_ok, T, H, D, BS)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(_visible(chosen, blk, pos, t), s, float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, s, v, PRECISION)
    o, lse = softmax_output(m, l, acc)
    tl.store(O + rows[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D: tl.constexpr):
    """Backward inputs of query rows: q and dO [rows, BD], log-sum-exp (in log2 units) and delta [rows]."""
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * D + d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta


@triton.jit(do_not_specialize=["T", "N_SEL", "L"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, IDX, TILE_BLOCKS, TILE_COUNTS, DQ, T, N_SEL, L, qk_scale, scale,
                   H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr,
                   BM: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    t, rows, row_ok, chosen, count, blocks, d, d_ok, u, kv_base = _query_tile(
        IDX, TILE_BLOCKS, TILE_COUNTS, T, N_SEL, L, H, G, D, BS, QT, BM, NP, BD)
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, row_ok, qd_mask, d, D)
    dq = tl.zeros([BM, BD], tl.float32)
    for i in range(count):
        blk = tl.load(blocks + i)
        pos, k, v = _load_block(K, V, kv_base, blk, u, d, d_ok, T, H, D, BS)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(_visible(chosen, blk, pos, t), tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + rows[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit(do_not_specialize=["T", "N_BLK"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, ITEM_SEG, ITEM_START, ITEM_END, QPOS, DK_PART, DV_PART, T, N_BLK,
                     qk_scale, scale, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     BR: tl.constexpr, QB: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    item = tl.program_id(0).to(tl.int64)
    seg = tl.load(ITEM_SEG + item)  # (batch * H + head) * N_BLK + key block
    start = tl.load(ITEM_START + item)
    end = tl.load(ITEM_END + item)
    bh, j = seg // N_BLK, seg % N_BLK
    b, h = bh // H, bh % H
    r, d, u = tl.arange(0, BR), tl.arange(0, BD), tl.arange(0, BS)
    d_ok = d < D
    pos = j * BS + u
    kv_ptr = b * T * H * D + h * D + pos[:, None] * (H * D) + d[None, :]
    kv_mask = (pos < T)[:, None] & d_ok[None, :]
    k = tl.load(K + kv_ptr, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_ptr, mask=kv_mask, other=0.0)
    dk = tl.zeros([BS, BD], tl.float32)
    dv = tl.zeros([BS, BD], tl.float32)
    # Row r of a tile is head r % G of the (r // G)-th query of the QB queries handled per step.
    r_q, r_g, r_ok = r // G, r % G, r < QB * G
    for qs in range(start, end, QB):
        ok = r_ok & (qs + r_q < end)
        t = tl.load(QPOS + qs + r_q, mask=ok, other=0)
        rows = (b * T + t) * (H * G) + h * G + r_g
        qd_mask = ok[:, None] & d_ok[None, :]
        q, do, lse, delta = load_rows(Q, DO, LSE, DELTA, rows, ok, qd_mask, d, D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BR, BS]
        visible = ok[:, None] & (pos[None, :] <= t[:, None])
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    part = item * BS * D + u[:, None] * D + d[None, :]
    tl.store(DK_PART + part, dk * scale, mask=d_ok[None, :])
    tl.store(DV_PART + part, dv, mask=d_ok[None, :])


@triton.jit(do_not_specialize=["T", "N_BLK"])
def _bwd_reduce_kernel(DK_PART, DV_PART, SEG_ITEMS, DK, DV, T, N_BLK, H: tl.constexpr, D: tl.constexpr,
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
    out = b * T * H * D + h * D + pos[:, None] * (H * D) + d[None, :]
    mask = (pos < T)[:, None] & d_ok[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)


def _queries_per_tile(G: int) -> int:
    """Queries whose G heads share one forward / dQ tile: about _TILE_ROWS rows below G = 16, one query from there.

    Packing pays while it fills empty rows; at G >= 16 one query's heads already fill a 16-row tile, and each
    added query widens the union of blocks the tile visits (measured at 64k with random selections: 4 queries
    visit 50 blocks, not 16, and take 15% longer)."""
    return max(1, _TILE_ROWS // G) if G < 16 else 1


def _tile_blocks(block_indices: Tensor, n_blocks: int, QT: int) -> tuple[Tensor, Tensor]:
    """Per tile of QT consecutive queries of one (batch, KV head): the union of their chosen blocks, ascending and
    -1 padded [B, H, T / QT, L], and its size [B, H, T / QT] int32. One query per tile: its own list, as is."""
    B, H, T, n = block_indices.shape
    if QT == 1:
        return block_indices, block_indices.new_full((B, H, T), n, dtype=torch.int32)
    n_tiles = triton.cdiv(T, QT)
    idx = F.pad(block_indices, (0, 0, 0, n_tiles * QT - T), value=-1).view(B, H, n_tiles, QT * n)
    # Column n_blocks collects the padding; it is dropped.
    present = torch.zeros(B, H, n_tiles, n_blocks + 1, dtype=torch.bool, device=idx.device)
    present = present.scatter_(3, torch.where(idx < 0, n_blocks, idx), True)[..., :n_blocks]
    L = min(QT * n, n_blocks)
    slot = torch.where(present, torch.cumsum(present, -1) - 1, L)  # absent blocks go to the dropped slot L
    blocks = idx.new_full((B, H, n_tiles, L + 1), -1)
    blocks = blocks.scatter_(3, slot, torch.arange(n_blocks, device=idx.device).expand_as(slot))[..., :L]
    return blocks.contiguous(), present.sum(-1, dtype=torch.int32)


def _tile_args(q: Tensor, k: Tensor, block_indices: Tensor, block_size: int) -> tuple[tuple[int, int], dict]:
    """Grid and the keyword arguments the forward and dQ kernels share: the chosen blocks, the tiles' union
    lists and sizes, lengths, and meta-parameters."""
    B, T, HQ, D = q.shape
    H, n = k.shape[2], block_indices.shape[3]
    G = HQ // H
    QT = _queries_per_tile(G)
    blocks, counts = _tile_blocks(block_indices, triton.cdiv(T, block_size), QT)
    tile = dict(IDX=block_indices, TILE_BLOCKS=blocks, TILE_COUNTS=counts, T=T, N_SEL=n, L=blocks.shape[3], H=H,
                G=G, D=D, BS=block_size, QT=QT, BM=max(16, triton.next_power_of_2(QT * G)),
                NP=triton.next_power_of_2(n), BD=triton.next_power_of_2(D),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return (triton.cdiv(T, QT), B * H), tile


def _check(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int) -> None:
    B, T, HQ, D = q.shape
    H = k.shape[2]
    if k.shape != (B, T, H, D) or v.shape != k.shape or HQ % H:
        raise ValueError(f"selected attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} "
                         "must be [B, T, HQ, D] and [B, T, H, D] with H dividing HQ")
    if block_indices.shape[:3] != (B, H, T) or block_indices.dtype != torch.int64:
        raise ValueError(f"selected attention: block_indices must be int64 [B, H, T, n] = [{B}, {H}, {T}, n], "
                         f"got {block_indices.dtype} {tuple(block_indices.shape)}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"selected attention: block size {block_size} must be a power of two >= 16")


@torch.library.custom_op("nsa::selected_attention_fwd", mutates_args=())
def selected_attention_fwd(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int,
                           scale: float) -> tuple[Tensor, Tensor]:
    """Returns o [B, T, HQ, D] (dtype of q) and the natural-log lse [B, T, HQ] (fp32; -inf: no visible key)."""
    _check(q, k, v, block_indices, block_size)
    q, k, v, block_indices = q.contiguous(), k.contiguous(), v.contiguous(), block_indices.contiguous()
    grid, tile = _tile_args(q, k, block_indices, block_size)
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    _fwd_kernel[grid](q, k, v, O=o, LSE=lse, qk_scale=scale * _LOG2E, **tile)
    return o, lse


@selected_attention_fwd.register_fake
def _(q, k, v, block_indices, block_size, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _reverse_index(block_indices: Tensor, n_blocks: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Work items over (batch, KV head, key block) -> the queries that chose the block, in ascending order.

    Returns per item its segment (b * H + h) * n_blocks + j, its [start, end) range in `query_pos`, the query
    positions, and per segment the [first, last + 1) range of its items. Sorting unique keys is deterministic.
    """
    B, H, T, _ = block_indices.shape
    device = block_indices.device
    seg = torch.arange(B * H, device=device).view(B, H, 1, 1) * n_blocks + block_indices
    t = torch.arange(T, device=device).view(1, 1, T, 1)
    key = torch.where(block_indices >= 0, seg * T + t, torch.iinfo(torch.int64).max).flatten()
    key = torch.sort(key).values
    key = key[: int((block_indices >= 0).sum())]
    query_pos = key % T
    n_segs = B * H * n_blocks
    bounds = torch.searchsorted(key // T, torch.arange(n_segs + 1, device=device))  # [n_segs + 1]
    counts = bounds[1:] - bounds[:-1]
    n_items = (counts + _ITEM_QUERIES - 1) // _ITEM_QUERIES
    seg_items = torch.cat([n_items.new_zeros(1), torch.cumsum(n_items, 0)])
    n_total = int(seg_items[-1])
    item_seg = torch.repeat_interleave(torch.arange(n_segs, device=device), n_items, output_size=n_total)
    item_start = bounds[item_seg] + (torch.arange(n_total, device=device) - seg_items[item_seg]) * _ITEM_QUERIES
    item_end = torch.minimum(item_start + _ITEM_QUERIES, bounds[item_seg + 1])
    return item_seg, item_start, item_end, query_pos, seg_items


@torch.library.custom_op("nsa::selected_attention_bwd", mutates_args=())
def selected_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                           block_indices: Tensor, block_size: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv given do and delta = rowsum(o * do) - dlse [B, T, HQ] (fp32). Bitwise deterministic."""
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    lse, delta, block_indices = lse.contiguous(), delta.contiguous(), block_indices.contiguous()
    B, T, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    grid, tile = _tile_args(q, k, block_indices, block_size)
    dq = torch.empty_like(q)
    _bwd_dq_kernel[grid](q, k, v, do, lse, delta, DQ=dq, qk_scale=scale * _LOG2E, scale=scale, **tile)

    n_blocks = triton.cdiv(T, block_size)
    item_seg, item_start, item_end, query_pos, seg_items = _reverse_index(block_indices, n_blocks)
    n_items = item_seg.numel()
    dk_part = torch.empty(n_items, block_size, D, device=q.device, dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    rows = max(_ROWS_BWD, triton.next_power_of_2(G))
    if n_items:
        _bwd_dkdv_kernel[(n_items,)](q, k, v, do, lse, delta, item_seg, item_start, item_end, query_pos, dk_part,
                                     dv_part, T, n_blocks, scale * _LOG2E, scale, H=H, G=G, D=D, BS=block_size,
                                     BR=rows, QB=rows // G, BD=tile["BD"], PRECISION=tile["PRECISION"], num_warps=4,
                                     num_stages=2)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _bwd_reduce_kernel[(B * H * n_blocks,)](dk_part, dv_part, seg_items, dk, dv, T, n_blocks, H=H, D=D,
                                            BS=block_size, BD=tile["BD"], num_warps=4)
    return dq, dk, dv


@selected_attention_bwd.register_fake
def _(do, q, k, v, lse, delta, block_indices, block_size, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, block_indices, block_size, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, block_indices)
    ctx.block_size, ctx.scale = block_size, scale


def softmax_delta(o: Tensor, do: Tensor, dlse: Tensor | None) -> Tensor:
    """delta = rowsum(o * do) - dlse [B, T, HQ] fp32, the backward's per-row term (d lse / d scores = p, so an lse
    cotangent shifts it)."""
    delta = (o.float() * do.float()).sum(-1)
    return delta if dlse is None else delta - dlse


def _backward(ctx, do, dlse):
    q, k, v, o, lse, block_indices = ctx.saved_tensors
    dq, dk, dv = selected_attention_bwd(do, q, k, v, lse, softmax_delta(o, do, dlse), block_indices,
                                        ctx.block_size, ctx.scale)
    return dq, dk, dv, None, None, None


selected_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int,
                       scale: float | None = None) -> Tensor:
    """NSA selected-branch output [B, T, HQ, D]; scale defaults to 1 / sqrt(D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return selected_attention_fwd(q, k, v, block_indices, block_size, scale)[0]
