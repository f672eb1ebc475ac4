"""The top-n block selection (NSA branches 2-3) in Triton, as the torch op `nsa::select_topn` (`kernel_op`).

It reruns the compressed attention's scores (`triton_compressed`: layouts, block visibility and query tiles as
there, the heads in two power-of-two slices) from the log-sum-exp `compressed_attention_fwd` returns. With packed
documents (doc_start [B, T] int32, multiples of l'), a query's candidates are the blocks of its document. Query row
r sits at position q_start + r (a runtime argument; q_start_odd in odd batch rows, as in `triton_compressed`): its
candidates and forced blocks are those of that position.

One pass per query tile recomputes the probabilities from the log-sum-exp, sums them over the group, maps compressed
blocks to selection blocks by their overlap (a small matmul with the overlap-count matrix, plus a carry of the
overlap that spills into the next tile), forces block 0 (with documents, the document's first) and the two most
recent blocks, and makes one sort key per candidate block: the fp32 score's bits above the complement of the block
index, so that ranking the keys orders by score and breaks ties towards the lower index, as the reference's stable
sort (64-bit keys, or 32-bit ones with the score's lowest bits dropped: `_wide_keys`). Each query keeps its top-n
keys in registers, merged with one tile of candidates at a time (a bitonic merge). The same pass gives each query
head's compressed-attention entropy (telemetry). A tile whose every query has at most n candidates chooses them all:
it writes them directly and its loop sums only the entropy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_models.nsa import triton_common
from nsa_models.nsa.triton_common import LOG2E, head_rows_descriptor, load_head_rows, query_offsets, row_offset
from nsa_models.nsa.triton_compressed import (
    _KEYS,
    _contiguous,
    _first_block,
    _n_visible,
    _query_tile,
    _tile_rows,
    _tiling,
)

_TMA_BOX_ROWS = 256  # the most rows one TMA box holds
# Groups of up to this many rows a position (both head slices) run the selection's loop branch-free, so that the
# compiler prefetches the key tiles (3 stages); larger ones keep the branch: pipelined, the kernel takes 184 registers
# instead of 128 at G = 16 (by arithmetic, 2 programs of 4 warps fit an SM instead of 4). Selection op, branch and 2
# stages -> branch-free and 3 stages (H200, outputs equal): 32k G = 1 4.73 -> 4.21 ms, G = 8 4.36 -> 4.29, G = 2 and
# 4 even; nsa-125m (G = 3, D = 64) 1 x 32k 1.00 -> 0.96, 16 x 2k 0.134 -> 0.130; G = 16 64k 11.63 -> 13.69, 8k 0.240
# -> 0.288.
_PIPELINE_MAX_GP = 8


@triton.jit
def _slice_rows(Q, LSE, DOC, t, rows, row_ok, b, T, NC, Q0, d, d_ok, D: tl.constexpr, L: tl.constexpr,
                S: tl.constexpr, DOC_MASK: tl.constexpr):
    """What the selection reads of one slice's rows (`_tile_rows`: positions t, rows and their validity): q [BM, BD];
    the probabilities' lse (log2 units; +inf where a row sees no block or does not exist, whose p is then 0 in every
    tile) and the entropy's (0 there); each row's visible compressed blocks [first_cmp, seen) (first_cmp: 0 without
    documents). The rows come from the caller, not from here: inductor counts a store whose addresses derive from a
    call that takes an input's pointer as writing that input, and copies it before each launch."""
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    lse_p = tl.where(row_ok & (lse != float("-inf")), lse, float("inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    seen = _n_visible(Q0 + t, NC, L, S).to(tl.int32)
    first_cmp = 0
    if DOC_MASK:
        first_cmp = _first_block(DOC, b, t, T, S)[:, None]  # [BM, 1]: per row, as `visible`
    return q, lse_p, lse, seen, first_cmp


@triton.jit
def _probabilities(q, k, lse, n0, seen, first_cmp, qk_scale, BN: tl.constexpr, PRECISION: tl.constexpr,
                   DOC_MASK: tl.constexpr):
    """A slice's compressed-attention probabilities p [BM, BN] of the key tile k of blocks [n0, n0 + BN) (0 where
    not visible) and their scores s (log2 units, finite everywhere). Row r sees the blocks below seen[r] (from
    first_cmp[r] on, with documents); lse is +inf on rows that see no block or do not exist, whose p is then 0
    without a test."""
    n = tl.cast(n0, tl.int32) + tl.arange(0, BN)  # 32-bit compares: half the instructions of 64-bit ones
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = n[None, :] < seen[:, None]
    if DOC_MASK:
        visible &= n[None, :] >= first_cmp
    return tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), s


@triton.jit
def _slice_scores(q, k, lse, n0, seen, first_cmp, overlap, spill, qk_scale, QB: tl.constexpr, GP: tl.constexpr,
                  BJ: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, DOC_MASK: tl.constexpr):
    """A slice's share of the key tile of blocks [n0, n0 + BN): its rows' sums of p * s (the entropy's), the
    selection blocks' scores [QB, BJ] summed over its heads and the overlap carried into the next tile [QB]."""
    p, s = _probabilities(q, k, lse, n0, seen, first_cmp, qk_scale, BN, PRECISION, DOC_MASK)
    # The group's heads share one selection: sum their rows (linear, so after the overlap product). At the kernel's
    # precision (tf32 for bf16 inputs): tf32x3 here held 3 more tiles live, spilled registers and took 3x as long at
    # 64k, and rounding p to tf32 (2^-11 relative) only reorders blocks whose scores tie to within that (measured:
    # 0.4% of rows at 64k).
    per_row = tl.dot(p, overlap, input_precision=PRECISION)
    return (tl.sum(p * s, 1), tl.sum(tl.reshape(per_row, (QB, GP, BJ)), 1),
            tl.sum(tl.reshape(tl.sum(p * spill[None, :], 1), (QB, GP)), 1))


@triton.jit(do_not_specialize=["T", "NC", "Q0", "Q0_ODD", "NS", "N_SEL", "IDX_BITS"])
def _select_kernel(Q, K, LSE, DOC, IDX, ENT, KEYS, T, NC, Q0, Q0_ODD, NS, N_SEL, IDX_BITS, qk_scale, H: tl.constexpr,
                   G: tl.constexpr, GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                   S: tl.constexpr, SEL: tl.constexpr, BM: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr,
                   PRECISION: tl.constexpr, WIDE_KEYS: tl.constexpr, STORE_KEYS: tl.constexpr, TMA: tl.constexpr,
                   PIPELINED: tl.constexpr, DOC_MASK: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 when inductor launches it (`triton_common.kernel_op`)
    QB: tl.constexpr = BM // GP  # query positions a tile
    BMB: tl.constexpr = QB * GB  # rows of the group's second slice of heads (`_head_slices`)
    PS: tl.constexpr = SEL // S  # compressed-block starts per selection block
    PB: tl.constexpr = L // S  # stride segments per compressed block
    BN: tl.constexpr = BJ * PS
    bh = tl.program_id(1).to(tl.int64)
    # The group's heads in two slices: [0, GP) in the tile's BM rows, [GP, G) in BMB more (GB > 0).
    t0, t, rows, row_ok, d, d_ok, _, b, h = _query_tile(T, H, G, GP, D, BM, BD)
    Q0 = row_offset(Q0, Q0_ODD, b)
    K = head_rows_descriptor(K, tl.num_programs(1) // H, NC, H, D, BN, BD, TMA)
    q, lse_p, lse, seen, first_cmp = _slice_rows(Q, LSE, DOC, t, rows, row_ok, b, T, NC, Q0, d, d_ok, D, L, S, DOC_MASK)
    plogp_sum = tl.zeros([BM], tl.float32)  # sum of p * s (log2 units): entropy = lse - that, as p sums to 1
    if GB > 0:
        t_b, rows_b, row_ok_b = _tile_rows(t0, b, h, T, H, G, GB, BMB, GP)
        q_b, lse_p_b, lse_b, seen_b, first_cmp_b = _slice_rows(Q, LSE, DOC, t_b, rows_b, row_ok_b, b, T, NC, Q0, d,
                                                               d_ok, D, L, S, DOC_MASK)
        plogp_sum_b = tl.zeros([BMB], tl.float32)
    tq = t0 + tl.arange(0, QB)  # the tile's query rows (at positions Q0 + tq)
    current = (Q0 + tq) // SEL
    t_last = Q0 + tl.minimum(t0 + QB, T) - 1  # the tile's last position
    n_vis = _n_visible(t_last, NC, L, S)
    rank = tl.arange(0, BJ)[None, :]
    j_lo = 0
    first = 0  # each query's first candidate: its document's first block
    tile_first = 0  # the tile's first query's document's first block (documents only start later along the tile)
    if DOC_MASK:
        first = (tl.load(DOC + b * T + tq, mask=tq < T, other=0) // SEL)[:, None]
        tile_first = tl.load(DOC + b * T + t0) // SEL
        if not STORE_KEYS:  # the tiles before the tile's first document hold no candidate (and no overlap carry)
            j_lo = tile_first // BJ * BJ
    # A query with at most n candidates (its document's blocks up to its own) chooses them all, whatever the
    # scores. The tile's last block minus tile_first bounds every query's count: when that is below n, the tile
    # writes the candidates directly and its loop sums only the entropy's p * s.
    if not STORE_KEYS and t_last // SEL - tile_first < N_SEL:
        for n0 in range(j_lo * PS, n_vis, BN):
            k = load_head_rows(K, b, h, n0, NC, d, d_ok, BN, H, D, BD, TMA)
            p, s = _probabilities(q, k, lse_p, n0, seen, first_cmp, qk_scale, BN, PRECISION, DOC_MASK)
            plogp_sum += tl.sum(p * s, 1)  # p = 0 where not visible, and s is finite there
            if GB > 0:
                p, s = _probabilities(q_b, k, lse_p_b, n0, seen_b, first_cmp_b, qk_scale, BN, PRECISION, DOC_MASK)
                plogp_sum_b += tl.sum(p * s, 1)
        chosen = first + rank  # ascending, -1 padding last (past the query's own block), as the ranked path
        chosen = tl.where(chosen <= current[:, None], chosen, -1).to(tl.int64)
    else:
        # overlap[i, j]: stride segments shared by compressed block i and selection block j of a tile (local
        # indices; the tile's first block starts both), and spill[i]: those shared with the next tile's first.
        i_loc = tl.arange(0, BN)[:, None]
        j_loc = tl.arange(0, BJ)[None, :]
        overlap = tl.maximum(tl.minimum(j_loc * PS + PS, i_loc + PB) - tl.maximum(j_loc * PS, i_loc), 0)
        overlap = overlap.to(tl.float32)
        spill = tl.maximum(tl.arange(0, BN) + PB - BN, 0).to(tl.float32)
        carry = tl.zeros([QB], tl.float32)
        # The running top-BJ keys of each query, descending; the initial ones decode as padding (-1).
        KEY: tl.constexpr = tl.int64 if WIDE_KEYS else tl.int32
        top = tl.full([QB, BJ], -1, KEY)
        idx_mask = (tl.full([], 1, KEY) << IDX_BITS) - 1  # a key's IDX_BITS low bits: the block index's complement
        drop = 0 if WIDE_KEYS else IDX_BITS  # 32-bit keys give up the score's lowest bits to the index
        n_cols = tl.cdiv(NS, BJ) * BJ if STORE_KEYS else t_last // SEL + 1  # later blocks are all in the future
        for j0 in range(j_lo, n_cols, BJ):
            j = j0 + tl.arange(0, BJ)
            score = tl.where(j_loc == 0, carry[:, None], 0.0)
            carry = tl.zeros([QB], tl.float32)
            # A tile none of whose blocks the queries see adds nothing; skipping it puts a branch around the key
            # loads, which the pipeliner does not prefetch into (`_PIPELINE_MAX_GP`).
            if PIPELINED or j0 * PS < n_vis:
                k = load_head_rows(K, b, h, j0 * PS, NC, d, d_ok, BN, H, D, BD, TMA)
                plogp, part, spilled = _slice_scores(q, k, lse_p, j0 * PS, seen, first_cmp, overlap, spill,
                                                     qk_scale, QB, GP, BJ, BN, PRECISION, DOC_MASK)
                plogp_sum += plogp  # p = 0 where not visible, and s is finite there
                score += part
                carry = spilled
                if GB > 0:
                    plogp, part, spilled = _slice_scores(q_b, k, lse_p_b, j0 * PS, seen_b, first_cmp_b, overlap,
                                                         spill, qk_scale, QB, GB, BJ, BN, PRECISION, DOC_MASK)
                    plogp_sum_b += plogp
                    score += part
                    carry += spilled
            forced = (j[None, :] == first) | (j[None, :] == current[:, None]) | (j[None, :] == current[:, None] - 1)
            score = tl.where(forced, float("inf"), score)
            score = tl.where((j[None, :] > current[:, None]) | (j[None, :] >= NS), float("-inf"), score)
            if DOC_MASK:
                score = tl.where(j[None, :] < first, float("-inf"), score)
            # Non-negative fp32 scores order as their int32 bits; -inf becomes -1, below every other key.
            bits = tl.where(score == float("-inf"), -1, score.to(tl.int32, bitcast=True))
            key = ((bits >> drop).to(KEY) << IDX_BITS) | (idx_mask - j[None, :]).to(KEY)  # j: 64-bit, as the bound
            if STORE_KEYS:
                tl.store(KEYS + (bh * T + tq[:, None]) * NS + j[None, :], key,
                         mask=(tq < T)[:, None] & (j < NS)[None, :])
            # Bitonic top-k: with `top` descending and the tile's keys ascending, the element-wise maximum holds the
            # BJ largest of both as a bitonic sequence, which one merge (log2 BJ rounds) sorts descending again.
            top = tl.bitonic_merge(tl.maximum(top, tl.sort(key, dim=1)), dim=1, descending=True)
        chosen = tl.where((top >= 0) & (rank < N_SEL), idx_mask - (top & idx_mask), NS)  # NS: none
        chosen = tl.sort(chosen, dim=1)  # ascending, the padding last
        chosen = tl.where(chosen == NS, -1, chosen).to(tl.int64)
    idx_ptr = (bh * T + tq[:, None]) * N_SEL + rank
    tl.store(IDX + idx_ptr, chosen, mask=(tq < T)[:, None] & (rank < N_SEL))
    tl.store(ENT + rows, (lse - plogp_sum) * 0.6931471805599453, mask=row_ok)
    if GB > 0:
        tl.store(ENT + rows_b, (lse_b - plogp_sum_b) * 0.6931471805599453, mask=row_ok_b)


def _wide_keys(dtype: torch.dtype, n_sel: int) -> bool:
    """Whether the selection ranks by 64-bit sort keys (the whole fp32 score above the block index) rather than
    32-bit ones, which keep the score's top 31 - b bits beside a b-bit index and halve the sort's and merge's work.

    fp32 inputs (an exact `ieee` product) keep the exact ranking. Lower precisions take 32-bit keys while the
    index needs at most 11 bits (up to 2048 selection blocks): scores then tie only within 2^-12 of each other
    (and go to the lower index, as exact ties do), finer than the tf32 rounding (2^-11) their probabilities
    already get in the overlap product."""
    return dtype == torch.float32 or (n_sel - 1).bit_length() > 11


def _select(q: Tensor, k: Tensor, lse: Tensor, block: int, stride: int, sel_block: int, n_selected: int,
            scale: float, store_keys: bool, doc_start: Tensor | None = None, q_start: int = 0,
            q_start_odd: int | None = None, launch: Callable = triton_common.direct_launch
            ) -> tuple[Tensor, Tensor, Tensor | None]:
    B, T, HQ, D = q.shape
    H, NC = k.shape[2], k.shape[1]
    triton_common.check_batch_heads(B, H, "selection")
    if sel_block % stride or block > sel_block + stride:
        raise ValueError(f"selection: l' = {sel_block} must be a multiple of d = {stride}, and l = {block} at most "
                         "l' + d (a compressed block overlaps at most two selection blocks)")
    q, k, lse, doc_start = q.contiguous(), k.contiguous(), lse.contiguous(), _contiguous(doc_start)
    tiles = _tiling(HQ // H, D, q.dtype, sliced=True)
    q_start, q_start_odd = query_offsets(q_start, q_start_odd)
    # Blocks up to the last query's: later ones are never candidates (the keys may run on past it).
    n_sel = triton.cdiv(max(q_start, q_start_odd) + T, sel_block)
    idx = torch.empty(B, H, T, n_selected, device=q.device, dtype=torch.int64)
    entropy = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    keys = torch.empty(B, H, T, n_sel, device=q.device, dtype=torch.int64) if store_keys else None
    # Selection blocks per tile: at least n (the running top-n is merged with one tile at a time).
    per_tile = max(16, triton.next_power_of_2(n_selected), _KEYS * stride // sel_block)
    wide = store_keys or _wide_keys(q.dtype, n_sel)
    grid = (triton.cdiv(T, tiles["BM"] // tiles["GP"]), B * H)
    # The keys through TMA (measured: `triton_common.kv_sources`) where `triton_common.kv_tma` says so and a
    # tile's compressed blocks fit in one box.
    tile_keys = per_tile * sel_block // stride
    tma = tile_keys <= _TMA_BOX_ROWS and triton_common.kv_tma(k)
    pipelined = tiles["GP"] + tiles["GB"] <= _PIPELINE_MAX_GP  # rows a position, both slices
    launch(_select_kernel)[grid](q, triton_common.tma_source(k) if tma else k, lse, doc_start, idx, entropy, keys,
                                 T, NC, q_start, q_start_odd, n_sel, n_selected,
                                 32 if wide else (n_sel - 1).bit_length(), scale * LOG2E, H=H, L=block, S=stride,
                                 SEL=sel_block, BJ=per_tile, WIDE_KEYS=wide, STORE_KEYS=store_keys, TMA=tma,
                                 PIPELINED=pipelined, DOC_MASK=doc_start is not None, **tiles, num_warps=4,
                                 num_stages=3 if pipelined else 2)
    return idx, entropy, keys


def selection_keys(q: Tensor, k: Tensor, lse: Tensor, block: int, stride: int, sel_block: int, scale: float,
                   doc_start: Tensor | None = None, q_start: int = 0) -> Tensor:
    """For tests: the int64 sort key [B, H, T, Ns] the selection ranks each block by (the fp32 score's bits above
    the complement of the block index; negative: a future block, or one before the query's document); Ns: the
    blocks up to the last query's."""
    return _select(q, k, lse, block, stride, sel_block, 1, scale, True, doc_start, q_start)[2]


def _select_fake(q, k, lse, block, stride, sel_block, n_selected, scale, doc_start=None, q_start=0, q_start_odd=None):
    B, T, HQ, _ = q.shape
    return q.new_empty((B, k.shape[2], T, n_selected), dtype=torch.int64), q.new_empty((B, T, HQ),
                                                                                      dtype=torch.float32)


@triton_common.kernel_op("nsa::select_topn", _select_fake)
def select_topn(q: Tensor, k: Tensor, lse: Tensor, block: int, stride: int, sel_block: int, n_selected: int,
                scale: float, doc_start: Tensor | None = None, q_start: int = 0,
                q_start_odd: int | None = None) -> tuple[Tensor, Tensor]:
    """Top-n selection blocks per (batch, KV head, query), shared by the GQA group, and the entropy (nats) of
    each query head's compressed-attention distribution.

    q [B, T, HQ, D], compressed k [B, Nc, H, D], lse [B, T, HQ] from `compressed_attention_fwd`. Returns int64
    [B, H, T, n] (ascending, -1 padding at the end, as the reference's `select_blocks`) and fp32 [B, T, HQ].
    Nothing of size T x Ns is written: each query keeps its running top-n in registers. With doc_start [B, T]
    (multiples of l'), a query's candidates are the blocks of its document, whose first block is forced.
    q_start: the first query's position (its candidates, forced blocks and visible compressed blocks follow it);
    q_start_odd: in odd batch rows, if it differs.
    """
    idx, entropy, _ = _select(q, k, lse, block, stride, sel_block, n_selected, scale, False, doc_start, q_start,
                              q_start_odd, launch=triton_common.op_launch)
    return idx, entropy
