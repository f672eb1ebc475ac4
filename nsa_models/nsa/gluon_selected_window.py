"""The fused selected + window kernels (`triton_selected_window`: forward, dQ, dK/dV) in Gluon for Hopper (sm_90):
the same inputs, outputs and arithmetic.

Forward and dQ: a query tile (QT queries x their G heads, 64 rows) walks its causal prefix 64 keys a step, as the
Triton kernels do, on one warpgroup. What they state instead of leaving to Triton's compiler:
- key and value steps arrive by TMA into a ring of shared-memory stages, signalled on mbarriers (no address
  arithmetic, no registers); the tile's query (and dO) rows stay in NVMMA-swizzled shared memory;
- every product runs on wgmma with fp32 accumulators. A step waits for its S (and dP) products together with the
  previous step's P V (dQ += dS k), runs the softmax (dS), and issues its own P V (dS k) from registers, left
  running into the next step's S: the accumulators cross steps as wgmma tokens. One barrier a step, after which
  the stage the previous step used takes a new step's keys.
  An earlier version issued step j + 1's S before step j's P V and passed P through shared memory (FlashAttention-3's
  order on one warpgroup): the round trip and its fence and barrier a step made it 1.05-1.7x slower than this.
The steps before the tile's window feed the selected branch alone, masked by a bit a row (every key precedes every
query there: no causal compare a key); the window's steps feed both, from one S.

dK/dV: one program per 64 keys walks the query tiles that see them (q and dO rows gathered by cp.async three tiles
deep), the next tile's S and dP issued before this tile's dV += P^T dO and dK += dS^T q, on two warpgroups that
split the columns; P and dS alternate between two shared buffers, so a tile's dV and dK products run on while the
next tile's P and dS are stored (one barrier a tile). The backward takes the gated output's dO and each branch's
gated lse (`triton_common.gated_lse`): one dP = dO v^T a step and, in dK/dV, one P = g_s P_s + g_w P_w per
tile for both branches.

Routed (docs/KERNELS.md has the figures): under `window_backend = "fused_with_selected"` with `selected_kernels =
"gluon_hopper"`, all three (at head dim 64 under register caps that fit one more program per multiprocessor:
`_MAX_REGISTERS`); all three without the selected branch as `window_backend = "gluon_hopper"`.
`bench/gluon_selected.py fused` times them against Triton's.

With packed documents a tile walks from its first query's document start, and a dK/dV program stops at the end of
its keys' documents (`document_query_ends`): the selection chooses blocks inside the query's document.

Supported: bf16, head dim 64 or 128, selection blocks of 64 keys, at most 64 query heads per KV head
(`supported`); the caller keeps the Triton kernels elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from nsa_models.nsa.gluon_selected import _mma_layout, _row_layout, cp_async_load, thread_barrier, tma_async_load
from nsa_models.nsa.triton_common import LOG2E, document_query_ends

_NUM_WARPS = 4  # one warpgroup: wgmma's 64-row tile is exactly a query tile's rows
_BM = 64  # rows (queries x heads) of a query tile
_BN = 64  # keys a step: one selection block
_STAGES = {64: 3, 128: 2}  # key / value steps in flight, by head dim: 2 CTAs per multiprocessor's shared memory
_HEAD_DIMS = (64, 128)
_DKDV_WARPS = 8  # the dK/dV kernel's: two warpgroups splitting the columns
# Registers per thread by kernel and head dim, where a cap lets one more program share a multiprocessor: at D = 64
# the forward and dQ (4 warps) take 3 programs under 168 instead of 2 (ptxas: 192 and 177 uncapped; 20 B and no
# spill capped), the dK/dV (8 warps) 2 under 128 instead of 1 (169; 48 B spilled). H200, nsa-125m 16 x 2k, ms
# uncapped -> capped: forward 0.571 -> 0.491, dQ 0.445 -> 0.412, dK/dV 1.061 -> 0.909 (docs/KERNELS.md). At D = 128
# the same caps spill 100-700 B and serialize the products: uncapped there.
_MAX_REGISTERS = {"fwd": {64: 168}, "dq": {64: 168}, "dkdv": {64: 128}}


@gluon.constexpr_function
def _column_split_layout(n, num_warps):
    """wgmma accumulator layout of a [64, n] tile on num_warps (4 or 8): one warpgroup's 64 rows, the columns split
    between warpgroups (no row reduction needs a whole row in one warp: the dK/dV kernel's)."""
    groups = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, n // groups, 16])


@gluon.jit
def _load_step(k_desc, v_desc, k_smem, v_smem, bars, step, n_steps, row0, col, STAGES: gl.constexpr,
               BN: gl.constexpr):
    """Issue the TMA loads of key / value step `step` (rows row0 + step * BN of the [B * T, H * D] views, from
    column col) into its stage, signalled on the stage's barrier; nothing past the last step."""
    slot = step % STAGES
    bar = bars.index(slot)
    ok = step < n_steps
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=ok)
    tma_async_load(k_desc, [row0 + step * BN, col], bar, k_smem.index(slot), pred=ok)
    tma_async_load(v_desc, [row0 + step * BN, col], bar, v_smem.index(slot), pred=ok)


@gluon.jit
def _issue_scores(q_smem, k_smem, bars, step, start, STAGES: gl.constexpr, s_l: gl.constexpr, BM: gl.constexpr,
                  BN: gl.constexpr):
    """Wait for step `step`'s keys (the ring's loads began at step `start`) and issue S = q k^T on wgmma
    (asynchronous: the caller waits)."""
    slot = step % STAGES
    mbarrier.wait(bars.index(slot), ((step - start) // STAGES) & 1)
    return warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l),
                         use_acc=False, is_async=True)


@gluon.jit
def _softmax_step(s, m, l, visible):
    """`triton_common.online_softmax_update` without the product: scores s (log2 units) where visible, the running
    max m and sum l; returns bf16 P (S's layout), the new m and l, and the factor alpha that the output accumulated
    so far takes."""
    s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    return p.to(gl.bfloat16), m_new, l * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _chosen(word, step):
    """[rows, 1]: the row's query chose key step `step`'s block. Alone it is the selected branch's whole mask where
    every key of the step precedes every row's query (the steps before a tile's window, a dK/dV program's tiles
    after its keys' window): a bit a row, broadcast, instead of a compare a (row, key)."""
    return (((word >> step) & 1) != 0)[:, None]


@gluon.jit
def _selected_visible(word, step, pos, t):
    """[rows, keys]: the row's query chose key step `step`'s block, and the key does not follow the query."""
    return _chosen(word, step) & (pos[None, :] <= t[:, None])


@gluon.jit
def _window_visible(pos, t, doc, W, DOC_MASK: gl.constexpr):
    """[rows, keys]: the key lies in the row's window (causal, within W, not before its document's start)."""
    inside = (pos[None, :] <= t[:, None]) & (t[:, None] - pos[None, :] < W)
    if DOC_MASK:
        inside = inside & (pos[None, :] >= doc[:, None])
    return inside


@gluon.jit
def _write_rows(O, LSE, acc, m, l, rows, ok, s_rows, s_ok, d, D: gl.constexpr, o_l: gl.constexpr,
                rows_l: gl.constexpr):
    """`triton_common.softmax_output` stored: o = acc / l (0 for a row that saw no key) from the gather layout, the
    natural-log lse (-inf there)."""
    l_safe = gl.where(l > 0, l, 1.0)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))[:, None]
    gl.store(O + rows[:, None] * D + d[None, :], gl.convert_layout(o.to(gl.bfloat16), rows_l),
             mask=ok[:, None])
    gl.store(LSE + s_rows, gl.where(l > 0, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")), mask=s_ok)


@gluon.jit
def _tile(k_desc, v_desc, DOC, T, W, H: gl.constexpr, D: gl.constexpr, QT: gl.constexpr, BN: gl.constexpr,
          DOC_MASK: gl.constexpr, SELECTED: gl.constexpr, STAGES: gl.constexpr):
    """This program's query tile (grid: query tiles x batch * KV heads): the batch row times H plus the KV head,
    batch, KV head, first query, key steps (to the tile's last query), the first step inside any row's window, the
    first step it walks (with SELECTED the first any row sees, its document's: the tile's first query has the
    earliest; else the window's), its keys' first row and column in the [B * T, H * D] views (TMA coordinates:
    int32), and the key / value ring with the loads of its first steps issued (`_kv_ring`). Positions and steps in
    int32: shared-memory stages take int32 indices."""
    # Last tiles first: they walk the longest prefixes, and launched last they would run alone at the end.
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1).to(gl.int64)
    b, h = bh // H, bh % H
    first = tile * QT
    n_steps = (gl.minimum(first + QT, T) - 1) // BN + 1
    doc_first = first * 0
    if DOC_MASK:
        doc_first = gl.load(DOC + b * T + first)
    win_step = gl.maximum(first - W + 1, doc_first) // BN
    start = win_step
    if SELECTED:
        start = doc_first // BN
    row0, col = (b * T).to(gl.int32), (h * D).to(gl.int32)
    k_smem, v_smem, bars = _kv_ring(k_desc, v_desc, start, n_steps, row0, col, STAGES, BN, D)
    return bh, b, h, first, n_steps, win_step, start, row0, col, k_smem, v_smem, bars


@gluon.jit
def _row_choices(BITS, DOC, bh, b, h, first, T, H: gl.constexpr, G: gl.constexpr, QT: gl.constexpr,
                 BM: gl.constexpr, DOC_MASK: gl.constexpr, SELECTED: gl.constexpr, layout: gl.constexpr):
    """The tile's rows in S's row layout: positions, which exist, offsets (`_tile_rows`), each query's chosen blocks
    (0 without SELECTED) and its document's start (its position without DOC_MASK)."""
    st, s_ok, s_rows = _tile_rows(first, b, h, T, H, G, QT, BM, layout)
    word = gl.zeros([BM], gl.int64, layout)
    if SELECTED:
        word = gl.load(BITS + bh * T + st, mask=s_ok, other=0)
    if DOC_MASK:
        doc = gl.load(DOC + b * T + st, mask=s_ok, other=0)
    else:
        doc = st
    return st, s_ok, s_rows, word, doc


@gluon.jit
def _kv_ring(k_desc, v_desc, start, n_steps, row0, col, STAGES: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):
    """The key / value stages and their barriers, with the loads of STAGES steps from `start` issued."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        _load_step(k_desc, v_desc, k_smem, v_smem, bars, start + i, n_steps, row0, col, STAGES, BN)
    return k_smem, v_smem, bars


@gluon.jit
def _rows_to_shared(X, rows, ok, d, D: gl.constexpr, BM: gl.constexpr):
    """A [BM, D] tile of rows of X (q or dO; 0 where not ok) in NVMMA-swizzled shared memory, once per program."""
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D],
                                                                                                  gl.bfloat16))
    x_smem.store(gl.load(X + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0.0))
    return x_smem


@gluon.jit
def _tile_rows(first, b, h, T, H: gl.constexpr, G: gl.constexpr, QT: gl.constexpr, BM: gl.constexpr,
               layout: gl.constexpr):
    """Row r of the tile (head r % G of query first + r // G): its query's position, whether it exists, and its
    offset in [B * T * HQ] rows (int64)."""
    r = gl.arange(0, BM, layout=layout)
    t = first + r // G
    return t, (r < QT * G) & (t < T), (b * T + t) * (H * G) + h * G + r % G


@gluon.jit
def _issue_dp(do_smem, v_smem, step, STAGES: gl.constexpr, s_l: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr):
    """dP = dO v^T of key step `step` on wgmma (asynchronous; its values have arrived with its keys)."""
    return warpgroup_mma(do_smem, v_smem.index(step % STAGES).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l),
                         use_acc=False, is_async=True)


@gluon.jit
def _row_stats(LSE, DELTA, s_rows, s_ok):
    """One branch's per-row backward inputs in S's layout: lse in log2 units and delta."""
    lse = gl.load(LSE + s_rows, mask=s_ok, other=0.0) * 1.4426950408889634
    return lse, gl.load(DELTA + s_rows, mask=s_ok, other=0.0)


@gluon.jit
def _ds_term(s, dp, lse, delta, visible):
    """One branch's part of dS = P (dP - delta), P recomputed from the forward's lse where visible."""
    return gl.where(visible, gl.exp2(s - lse[:, None]), 0.0) * (dp - delta[:, None])


@gluon.jit
def _refill(k_desc, v_desc, k_smem, v_smem, bars, j, start, n_steps, row0, col, STAGES: gl.constexpr,
            BN: gl.constexpr):
    """At step j, after the wait that ended step j - 1's products: once every warp is there, step j - 1's stage
    takes step j - 1 + STAGES (the ring's first STAGES loads were issued before the walk)."""
    thread_barrier()
    if j > start:
        _load_step(k_desc, v_desc, k_smem, v_smem, bars, j - 1 + STAGES, n_steps, row0, col, STAGES, BN)


@gluon.jit(do_not_specialize=["T", "W"])
def _fwd_kernel(Q, k_desc, v_desc, BITS, DOC, O_SLC, O_WIN, LSE_SLC, LSE_WIN, T, W, qk_scale, H: gl.constexpr,
                G: gl.constexpr, D: gl.constexpr, QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                DOC_MASK: gl.constexpr, SELECTED: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Grid: query tiles x batch * KV heads. Row r of a tile is head r % G of query tile * QT + r // G; BM rows,
    BN keys a step (one selection block). Step j waits for its S together with step j - 1's P V, then runs the
    softmax and issues its P V from registers (P in wgmma's operand layout). Without SELECTED the window alone
    (O_WIN, LSE_WIN): the tile walks only the steps of its rows' windows, and BITS and the selected outputs are not
    touched."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)
    s_l: gl.constexpr = _mma_layout(BN, NUM_WARPS)
    srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
    o_l: gl.constexpr = _mma_layout(D, NUM_WARPS)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)

    bh, b, h, first, n_steps, win_step, start, row0, col, k_smem, v_smem, bars = _tile(
        k_desc, v_desc, DOC, T, W, H, D, QT, BN, DOC_MASK, SELECTED, STAGES)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))
    t, ok, rows = _tile_rows(first, b, h, T, H, G, QT, BM, row_l)
    q_smem = _rows_to_shared(Q, rows, ok, d, D, BM)
    fence_async_shared()
    thread_barrier()

    st, s_ok, s_rows, word, doc = _row_choices(BITS, DOC, bh, b, h, first, T, H, G, QT, BM, DOC_MASK, SELECTED,
                                               srow_l)
    u = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    m_s = gl.full([BM], float("-inf"), gl.float32, srow_l)
    l_s = gl.zeros([BM], gl.float32, srow_l)
    m_w, l_w = m_s, l_s
    # the P V products' accumulators, carried between steps as wgmma tokens (waited at the next step's S)
    acc_s = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, o_l))
    acc_w = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, o_l))

    if SELECTED:  # steps before the window: the selected branch alone
        for j in range(start, win_step):
            s = _issue_scores(q_smem, k_smem, bars, j, start, STAGES, s_l, BM, BN)
            s, acc_s = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc_s))
            _refill(k_desc, v_desc, k_smem, v_smem, bars, j, start, n_steps, row0, col, STAGES, BN)
            p, m_s, l_s, alpha_s = _softmax_step(s * qk_scale, m_s, l_s, _chosen(word, j))
            acc_s = acc_s * gl.convert_layout(alpha_s, orow_l)[:, None]
            acc_s = warpgroup_mma(gl.convert_layout(p, p_l), v_smem.index(j % STAGES), acc_s, is_async=True)
        # The last P V done before the window's steps: the compiler places the window accumulator's zeros there,
        # and a register write while a product runs makes ptxas serialize every wgmma of the kernel (C7515).
        acc_s = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, )))

    for j in range(win_step, n_steps):  # the window's steps: two products from one S
        s = _issue_scores(q_smem, k_smem, bars, j, start, STAGES, s_l, BM, BN)
        if SELECTED:
            s, acc_s, acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc_s, acc_w))
        else:
            s, acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc_w))
        _refill(k_desc, v_desc, k_smem, v_smem, bars, j, start, n_steps, row0, col, STAGES, BN)
        s = s * qk_scale
        pos = j * BN + u
        # The window's softmax first, both rescales before either product: 875 SASS instructions a step at D = 64
        # against 921 in the other order (the same at D = 128).
        p_w, m_w, l_w, alpha_w = _softmax_step(s, m_w, l_w, _window_visible(pos, st, doc, W, DOC_MASK))
        acc_w = acc_w * gl.convert_layout(alpha_w, orow_l)[:, None]
        if SELECTED:
            p, m_s, l_s, alpha_s = _softmax_step(s, m_s, l_s, _selected_visible(word, j, pos, st))
            acc_s = acc_s * gl.convert_layout(alpha_s, orow_l)[:, None]
            acc_s = warpgroup_mma(gl.convert_layout(p, p_l), v_smem.index(j % STAGES), acc_s, is_async=True)
        acc_w = warpgroup_mma(gl.convert_layout(p_w, p_l), v_smem.index(j % STAGES), acc_w, is_async=True)

    if SELECTED:
        acc_s, acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, acc_w))
    else:
        acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if SELECTED:
        _write_rows(O_SLC, LSE_SLC, acc_s, m_s, l_s, rows, ok, s_rows, s_ok, d, D, o_l, rows_l)
    _write_rows(O_WIN, LSE_WIN, acc_w, m_w, l_w, rows, ok, s_rows, s_ok, d, D, o_l, rows_l)


@gluon.jit(do_not_specialize=["T", "W"])
def _bwd_dq_kernel(Q, k_desc, v_desc, BITS, DOC, DO, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, DQ, T, W, qk_scale, scale,
                   H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, QT: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, DOC_MASK: gl.constexpr, SELECTED: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS: gl.constexpr):
    """As `triton_selected_window._bwd_dq_kernel` (grid: query tiles x batch * KV heads): dQ of a tile's rows over
    its causal prefix, both branches' gated P recomputed from their gated lse, one dP = dO v^T a step for both
    (without SELECTED the window's alone, over the window's steps). As `_fwd_kernel`: step j waits for its S and dP
    products together with step j - 1's dQ += dS k, computes dS, and issues its own dS k from registers."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)
    s_l: gl.constexpr = _mma_layout(BN, NUM_WARPS)
    srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
    o_l: gl.constexpr = _mma_layout(D, NUM_WARPS)
    ds_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)

    bh, b, h, first, n_steps, win_step, start, row0, col, k_smem, v_smem, bars = _tile(
        k_desc, v_desc, DOC, T, W, H, D, QT, BN, DOC_MASK, SELECTED, STAGES)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))
    t, ok, rows = _tile_rows(first, b, h, T, H, G, QT, BM, row_l)
    q_smem = _rows_to_shared(Q, rows, ok, d, D, BM)
    do_smem = _rows_to_shared(DO, rows, ok, d, D, BM)
    fence_async_shared()
    thread_barrier()

    st, s_ok, s_rows, word, doc = _row_choices(BITS, DOC, bh, b, h, first, T, H, G, QT, BM, DOC_MASK, SELECTED,
                                               srow_l)
    lse_s = gl.zeros([BM], gl.float32, srow_l)
    delta_s = lse_s
    if SELECTED:
        lse_s, delta_s = _row_stats(LSE_SLC, DELTA_SLC, s_rows, s_ok)
    lse_w, delta_w = _row_stats(LSE_WIN, DELTA_WIN, s_rows, s_ok)
    u = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    dq = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, o_l))  # a wgmma token between steps

    if SELECTED:  # steps before the window: the selected branch alone
        for j in range(start, win_step):
            s = _issue_scores(q_smem, k_smem, bars, j, start, STAGES, s_l, BM, BN)
            dp = _issue_dp(do_smem, v_smem, j, STAGES, s_l, BM, BN)
            s, dp, dq = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp, dq))
            _refill(k_desc, v_desc, k_smem, v_smem, bars, j, start, n_steps, row0, col, STAGES, BN)
            ds = _ds_term(s * qk_scale, dp, lse_s, delta_s, _chosen(word, j))
            dq = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), ds_l), k_smem.index(j % STAGES), dq,
                               is_async=True)

    for j in range(win_step, n_steps):  # the window's steps: one dS from both branches
        s = _issue_scores(q_smem, k_smem, bars, j, start, STAGES, s_l, BM, BN)
        dp = _issue_dp(do_smem, v_smem, j, STAGES, s_l, BM, BN)
        pos = j * BN + u
        s, dp, dq = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp, dq))
        s = s * qk_scale
        _refill(k_desc, v_desc, k_smem, v_smem, bars, j, start, n_steps, row0, col, STAGES, BN)
        ds = _ds_term(s, dp, lse_w, delta_w, _window_visible(pos, st, doc, W, DOC_MASK))
        if SELECTED:
            ds = ds + _ds_term(s, dp, lse_s, delta_s, _selected_visible(word, j, pos, st))
        dq = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), ds_l), k_smem.index(j % STAGES), dq,
                           is_async=True)

    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    gl.store(DQ + rows[:, None] * D + d[None, :], gl.convert_layout((dq * scale).to(gl.bfloat16), rows_l),
             mask=ok[:, None])


@gluon.jit
def _gather_tile(Q, DO, q_buf, do_buf, tile, b, h, T, d, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                 QT: gl.constexpr, BM: gl.constexpr, row_l: gl.constexpr):
    """One cp.async group: query tile `tile`'s q and dO rows into a stage (zeros for rows past T)."""
    t, ok, rows = _tile_rows(tile * QT, b, h, T, H, G, QT, BM, row_l)
    offsets = rows[:, None] * D + d[None, :]
    cp_async_load(q_buf, Q + offsets, mask=ok[:, None])
    cp_async_load(do_buf, DO + offsets, mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _gather_ahead(Q, DO, q_bufs, do_bufs, tile, i, b, h, T, d, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                  QT: gl.constexpr, BM: gl.constexpr, row_l: gl.constexpr, STAGES: gl.constexpr):
    """Iteration i of the dK/dV walk (at query tile `tile`): gather tile + STAGES - 1 into the stage iteration
    i - 1 freed, then wait until tile + 1's rows have landed, visible to every warp's products."""
    nxt = (i + STAGES - 1) % STAGES
    _gather_tile(Q, DO, q_bufs.index(nxt), do_bufs.index(nxt), tile + STAGES - 1, b, h, T, d, H, G, D, QT, BM, row_l)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _issue_tile_products(q_smem, do_smem, k_smem, v_smem, s_l: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """A query tile against the key step: S = q k^T and dP = dO v^T on wgmma, asynchronous."""
    zeros = gl.zeros([BM, BN], gl.float32, s_l)
    s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_smem, v_smem.permute((1, 0)), zeros, use_acc=False, is_async=True)
    return s, dp


@gluon.jit
def _tile_ds(s, dp, tile, kb, b, h, bh, T, W, qk_scale, BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN,
             H: gl.constexpr, G: gl.constexpr, QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             DOC_MASK: gl.constexpr, s_l: gl.constexpr, LATER: gl.constexpr, SELECTED: gl.constexpr,
             WINDOW: gl.constexpr):
    """Query tile `tile`'s gated P = g_s P_s + g_w P_w of the wanted branches (each recomputed from its gated lse;
    0 outside the branch's mask and for rows past T) and dS = g_s P_s (dP - delta_s) + g_w P_w (dP - delta_w),
    [rows, keys], bf16, from its issued S and dP products, waited for with the LATER products issued after them
    still running (the rows' values load meanwhile)."""
    srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
    st, s_ok, s_rows = _tile_rows(tile * QT, b, h, T, H, G, QT, BM, srow_l)
    pos = kb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    if SELECTED:
        word = gl.load(BITS + bh * T + st, mask=s_ok, other=0)
        lse_s, delta_s = _row_stats(LSE_SLC, DELTA_SLC, s_rows, s_ok)
    if WINDOW:
        if DOC_MASK:
            doc = gl.load(DOC + b * T + st, mask=s_ok, other=0)
        else:
            doc = st
        lse_w, delta_w = _row_stats(LSE_WIN, DELTA_WIN, s_rows, s_ok)
    s, dp = warpgroup_mma_wait(num_outstanding=LATER, deps=(s, dp))
    s = s * qk_scale
    p = gl.zeros([BM, BN], gl.float32, s_l)
    ds = p
    if SELECTED:
        if WINDOW:
            visible = _selected_visible(word, kb, pos, st)
        else:  # the tiles after the keys' window: every query follows every key
            visible = _chosen(word, kb)
        p = gl.where(visible, gl.exp2(s - lse_s[:, None]), 0.0)
        ds = p * (dp - delta_s[:, None])
    if WINDOW:
        p_w = gl.where(_window_visible(pos, st, doc, W, DOC_MASK) & s_ok[:, None], gl.exp2(s - lse_w[:, None]), 0.0)
        p = p + p_w
        ds = ds + p_w * (dp - delta_w[:, None])
    return p.to(gl.bfloat16), ds.to(gl.bfloat16)


@gluon.jit
def _dkdv_step(Q, DO, q_bufs, do_bufs, p_smem, k_smem, v_smem, dv, dk, tile, i, kb, b, h, bh, T, W, qk_scale, d,
               BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
               QT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DOC_MASK: gl.constexpr, s_l: gl.constexpr,
               row_l: gl.constexpr, STAGES: gl.constexpr, SELECTED: gl.constexpr, WINDOW: gl.constexpr):
    """Iteration i of the dK/dV walk (query tile `tile`, whose P and dS wait in buffer i % 2): retire tile i - 1's
    dV and dK products (they read the stage the gather refills and the P buffer this step refills), gather ahead,
    issue tile i + 1's S and dP and tile i's dV += P^T dO, dK += dS^T q, and compute tile i + 1's P and dS into the
    other buffer while those run. The next step's barrier (in `_gather_ahead`) publishes the stores."""
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    _gather_ahead(Q, DO, q_bufs, do_bufs, tile, i, b, h, T, d, H, G, D, QT, BM, row_l, STAGES)
    cur, nx, pb = i % STAGES, (i + 1) % STAGES, i % 2
    s, dp = _issue_tile_products(q_bufs.index(nx), do_bufs.index(nx), k_smem, v_smem, s_l, BM, BN)
    dv = warpgroup_mma(p_smem.index(2 * pb).permute((1, 0)), do_bufs.index(cur), dv, is_async=True)
    dk = warpgroup_mma(p_smem.index(2 * pb + 1).permute((1, 0)), q_bufs.index(cur), dk, is_async=True)
    p, ds = _tile_ds(s, dp, tile + 1, kb, b, h, bh, T, W, qk_scale, BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN,
                     H, G, QT, BM, BN, DOC_MASK, s_l, 2, SELECTED, WINDOW)
    p_smem.index(2 - 2 * pb).store(p)
    p_smem.index(3 - 2 * pb).store(ds)
    fence_async_shared()
    return dv, dk


@gluon.jit(do_not_specialize=["T", "W"])
def _bwd_dkdv_kernel(Q, k_desc, v_desc, BITS, DOC, QEND, DO, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, DK, DV, T, W,
                     qk_scale, scale, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, QT: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, DOC_MASK: gl.constexpr, SELECTED: gl.constexpr,
                     STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """As `triton_selected_window._bwd_dkdv_kernel` (grid: key steps x batch * KV heads): dK and dV of one step of
    BN keys from the query tiles that see them, written once (without SELECTED the window's tiles alone). The
    tiles' q and dO rows arrive by cp.async three tiles deep; each iteration issues the next tile's S and dP
    products before this tile's dV += P^T dO and dK += dS^T q (P and dS of both branches summed: two products a
    tile), and computes the next tile's P and dS into the other of two buffers while those run (`_dkdv_step`). S
    is [rows, keys] (per-row values cost two registers a thread), and P^T, dS^T are transposed views of shared
    memory. On 8 warps the two warpgroups split the columns of S, dP, dK and dV (4 warps spilled 152-188 B at
    D = 64)."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)
    s_l: gl.constexpr = _column_split_layout(BN, NUM_WARPS)
    o_l: gl.constexpr = _column_split_layout(D, NUM_WARPS)
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)

    kb = gl.program_id(0)
    bh = gl.program_id(1).to(gl.int64)
    b, h = bh // H, bh % H
    first = kb * BN // QT
    # The tiles up to the last query whose window holds one of the keys see them through both branches; the later
    # ones through the selected branch alone, up to the end of the keys' documents (QEND: `document_query_ends`).
    if DOC_MASK:
        n_tiles = gl.cdiv(gl.load(QEND + b * gl.cdiv(T, BN) + kb), QT)
    else:
        n_tiles = gl.cdiv(T, QT)
    win_last = gl.minimum(gl.minimum(kb * BN + BN + W - 2, T - 1) // QT, n_tiles - 1)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    row0 = (b * T).to(gl.int32) + kb * BN
    tma_async_load(k_desc, [row0, (h * D).to(gl.int32)], bar, k_smem)
    tma_async_load(v_desc, [row0, (h * D).to(gl.int32)], bar, v_smem)

    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D], tile_sl)
    do_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, D], tile_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BM, BN], p_sl)  # P and dS of two tiles: 2 j, 2 j + 1
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))
    for stage in gl.static_range(STAGES - 1):
        _gather_tile(Q, DO, q_bufs.index(stage), do_bufs.index(stage), first + stage, b, h, T, d, H, G, D, QT, BM,
                     row_l)
    mbarrier.wait(bar, 0)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    thread_barrier()
    s, dp = _issue_tile_products(q_bufs.index(0), do_bufs.index(0), k_smem, v_smem, s_l, BM, BN)
    p, ds = _tile_ds(s, dp, first, kb, b, h, bh, T, W, qk_scale, BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN,
                     H, G, QT, BM, BN, DOC_MASK, s_l, 0, SELECTED, True)
    p_smem.index(0).store(p)
    p_smem.index(1).store(ds)
    fence_async_shared()

    dk = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, o_l))
    dv = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, o_l))
    # The window's tiles, then the later ones (the selected branch alone). (Tile i + 1 past the window or past T:
    # P and dS 0.)
    for tile in range(first, win_last + 1):
        dv, dk = _dkdv_step(Q, DO, q_bufs, do_bufs, p_smem, k_smem, v_smem, dv, dk, tile, tile - first, kb, b, h, bh,
                            T, W, qk_scale, d, BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, H, G, D, QT, BM,
                            BN, DOC_MASK, s_l, row_l, STAGES, SELECTED, True)
    if SELECTED:
        for tile in range(win_last + 1, n_tiles):
            dv, dk = _dkdv_step(Q, DO, q_bufs, do_bufs, p_smem, k_smem, v_smem, dv, dk, tile, tile - first, kb, b,
                                h, bh, T, W, qk_scale, d, BITS, DOC, LSE_SLC, LSE_WIN, DELTA_SLC, DELTA_WIN, H, G, D,
                                QT, BM, BN, DOC_MASK, s_l, row_l, STAGES, True, False)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    async_copy.wait_group(0)  # the gathers past the last tile
    mbarrier.invalidate(bar)

    pos = kb * BN + gl.arange(0, BN, layout=row_l)
    out = ((b * T + pos) * (H * D) + h * D)[:, None] + d[None, :]
    kd_ok = (pos < T)[:, None]
    gl.store(DK + out, gl.convert_layout((dk * scale).to(gl.bfloat16), rows_l), mask=kd_ok)
    gl.store(DV + out, gl.convert_layout(dv.to(gl.bfloat16), rows_l), mask=kd_ok)


def supported(q: Tensor, k: Tensor, v: Tensor, block_size: int) -> bool:
    """Whether the Gluon forward runs these inputs: bf16, 16-byte aligned, head dim 64 or 128, blocks of 64 keys."""
    return (all(x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0 for x in (q, k, v))
            and q.shape[-1] in _HEAD_DIMS and block_size == _BN)


def _launch_args(q: Tensor, k: Tensor, bits: Tensor | None, doc_start: Tensor | None,
                 kernel: str) -> tuple[tuple[int, int], dict]:
    """The grid and the keyword arguments kernel ("fwd", "dq" or "dkdv") takes for these inputs (ValueError where
    they do not run); bits None: the window alone."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    if not supported(q, k, q, _BN) or G > _BM:
        raise ValueError(f"gluon_selected_window: needs 16-byte aligned bf16, head dim in {_HEAD_DIMS} and at most "
                         f"{_BM} query heads per KV head; got {q.dtype}, D = {D}, G = {G}")
    QT = _BM // G
    warps = _DKDV_WARPS if kernel == "dkdv" else _NUM_WARPS
    meta = dict(H=H, G=G, D=D, QT=QT, BM=_BM, BN=_BN, DOC_MASK=doc_start is not None, SELECTED=bits is not None,
                STAGES=_STAGES[D], NUM_WARPS=warps, num_warps=warps)
    if D in _MAX_REGISTERS[kernel]:
        meta["maxnreg"] = _MAX_REGISTERS[kernel][D]
    return (-(-T // QT), B * H), meta


def _step_descriptor(x: Tensor) -> TensorDescriptor:
    """TMA descriptor of one key step of one KV head: [BN, D] boxes of x [B, T, H, D] viewed as [B * T, H * D].
    A step past a batch row's T reads the next row's keys (or zeros past the tensor): only keys no query of the row
    can see, as the masks make them."""
    B, T, H, D = x.shape
    layout = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.bfloat16)
    return TensorDescriptor.from_tensor(x.view(B * T, H * D), [_BN, D], layout)


def _or(x: Tensor | None, placeholder: Tensor) -> Tensor:
    """x, or a pointer of the right kind for a kernel argument its launch never reads or writes."""
    return x if x is not None else placeholder


def gluon_fwd(q: Tensor, k: Tensor, v: Tensor, bits: Tensor | None, doc_start: Tensor | None, window: int,
              scale: float, o_slc: Tensor | None, o_win: Tensor, lse_slc: Tensor | None, lse_win: Tensor) -> None:
    """Launch the Gluon forward into o_slc, o_win [B, T, HQ, D] and lse_slc, lse_win [B, T, HQ] (natural log), as
    `selected_window_fwd` launches the Triton kernel: q [B, T, HQ, D], k, v [B, T, H, D] contiguous, bits
    (`chosen_bits`) [B, H, T] int64, doc_start [B, T] int32 or None. bits None: the window alone (o_slc, lse_slc
    None)."""
    grid, meta = _launch_args(q, k, bits, doc_start, "fwd")
    _fwd_kernel[grid](q, _step_descriptor(k), _step_descriptor(v), _or(bits, lse_win), _or(doc_start, lse_win),
                      _or(o_slc, o_win), o_win, _or(lse_slc, lse_win), lse_win, q.shape[1], window, scale * LOG2E,
                      **meta)


def gluon_bwd_dq(q: Tensor, k: Tensor, v: Tensor, bits: Tensor | None, doc_start: Tensor | None, window: int,
                 scale: float, do: Tensor, lse_slc: Tensor | None, lse_win: Tensor, delta_slc: Tensor | None,
                 delta_win: Tensor, dq: Tensor) -> None:
    """Launch the Gluon dQ kernel into dq [B, T, HQ, D], as `selected_window_bwd` launches the Triton one: the
    forward's inputs, the gated output's dO (contiguous), each branch's gated lse (`triton_common.gated_lse`) and
    delta [B, T, HQ] (fp32); the selected branch's None with bits None (the window alone)."""
    grid, meta = _launch_args(q, k, bits, doc_start, "dq")
    _bwd_dq_kernel[grid](q, _step_descriptor(k), _step_descriptor(v), _or(bits, lse_win), _or(doc_start, lse_win),
                         do, _or(lse_slc, lse_win), lse_win, _or(delta_slc, delta_win), delta_win, dq, q.shape[1],
                         window, scale * LOG2E, scale, **meta)


def gluon_bwd_dkdv(q: Tensor, k: Tensor, v: Tensor, bits: Tensor | None, doc_start: Tensor | None, window: int,
                   scale: float, do: Tensor, lse_slc: Tensor | None, lse_win: Tensor, delta_slc: Tensor | None,
                   delta_win: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Launch the Gluon dK/dV kernel into dk, dv [B, T, H, D] (as `gluon_bwd_dq`; one program per 64 keys and KV
    head)."""
    (_, bh), meta = _launch_args(q, k, bits, doc_start, "dkdv")
    query_ends = None if doc_start is None else document_query_ends(doc_start, _BN)
    _bwd_dkdv_kernel[(-(-q.shape[1] // _BN), bh)](
        q, _step_descriptor(k), _step_descriptor(v), _or(bits, lse_win), _or(doc_start, lse_win),
        _or(query_ends, lse_win), do, _or(lse_slc, lse_win), lse_win, _or(delta_slc, delta_win), delta_win, dk,
        dv, q.shape[1], window, scale * LOG2E, scale, **meta)
