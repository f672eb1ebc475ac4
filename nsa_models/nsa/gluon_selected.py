"""Key-block-major selected attention in Gluon (Triton's explicit-layout dialect), for Hopper (sm_90): the forward
item kernel and the backward's dK/dV kernel.

Forward: the same work as `triton_selected._fwd_item_kernel` (inputs, outputs and the arithmetic of each (query row,
chosen block) pair), written so that what Triton's compiler would have to infer is stated: the item's key and value
block sit in NVMMA-swizzled shared memory for the whole program, each step's gathered query rows arrive by cp.async
into one of two shared buffers while the previous step computes, and both products run on warpgroup MMA (wgmma)
with fp32 accumulators, the probabilities fed from registers. One warpgroup (4 warps) runs 64 rows a step. The
work list's entries (which rows a step gathers) are read a step before the gather that uses them: read just before
it, their latency stalled every step, and this kernel ran at 0.82-0.97x Triton's instead of 1.2-1.4x.

Backward (`_bwd_dkdv_kernel`, as `triton_selected._bwd_dkdv_kernel`): the same item structure with q and dO
gathered double-buffered, the five products on wgmma (P^T and dS^T read transposed from shared memory), dK and dV
accumulated in fp32 registers over the item, and with WITH_DQ each pair's dQ term stored per (row, slot). Rows per
step and warps: `bwd_launch_shape`.

Supported: bf16 inputs, head dim 64 or 128, selection blocks of 64 keys, 64 rows a step for the forward
(`gluon_fwd_items` / `gluon_bwd_dkdv_items` raise otherwise); the caller routes other shapes to the Triton kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Gluon's names that Triton changed after 3.6 (the GPU image's): the asynchronous copies became `async_load` (in
# cp.async's module and in TMA's; 3.9 keeps the old names only to raise) and `thread_barrier` became `barrier`.
# The kernels call these, which run on either (tests/gluon_compile.py builds them with the installed Triton).
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
tma_async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

_NUM_WARPS = 4  # one warpgroup: wgmma's 64-row tile is exactly a step's rows
_BS = 64  # keys per selection block
_BR = 64  # rows (queries x heads) per step
_HEAD_DIMS = (64, 128)
_BWD_ROWS = (64, 128)  # rows per step of the dK/dV kernel
# The forward's registers per thread: 168 fit 3 programs per multiprocessor instead of 2, without spilling at either
# head dim (ptxas would take 168 at D = 64, 200 at D = 128). H200, bench/gluon_selected.py fwd, Gluon ms uncapped ->
# capped at D = 128: nsa-1b 2 x 8k 0.696 -> 0.691, 1 x 32k 1.347 -> 1.326.
_FWD_MAX_REGISTERS = 168


@gluon.constexpr_function
def _row_layout(cols, num_warps):
    """Registers of a [rows, cols] bf16 tile for global memory: 8 consecutive elements (16 bytes, one cp.async or
    vector store) per thread, a warp's lanes across whole rows, so a gathered row is read in full 16-byte pieces."""
    lanes = cols // 8
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    """wgmma accumulator layout of a [64, n] tile: warps stacked along the rows, one instruction covering all n."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _step_ok(qs, end, G: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr, layout: gl.constexpr):
    """Which rows of the step starting at entry qs exist (see `_step_entries`): computed, never carried."""
    r = gl.arange(0, BR, layout=layout)
    return (r < QB * G) & (qs + r // G < end)


@gluon.jit
def _step_entries(QSLOT, qs, end, G: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr, layout: gl.constexpr):
    """Which rows of the step starting at entry qs exist, and their (query, slot) entries t * N_SEL + slot (int32):
    row r of the step is head r % G of the item's (qs + r // G)-th entry; rows past `end` (or past QB * G) are not
    used. What a step carries ahead of its use: half the registers of `_entry_rows`' 64-bit rows."""
    ok = _step_ok(qs, end, G, BR, QB, layout)
    return ok, gl.load(QSLOT + qs + gl.arange(0, BR, layout=layout) // G, mask=ok, other=0)


@gluon.jit
def _entries(QSLOT, qs, end, G: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr, layout: gl.constexpr):
    """`_step_entries`' entries alone (0 for rows that do not exist)."""
    ok, entry = _step_entries(QSLOT, qs, end, G, BR, QB, layout)
    return entry


@gluon.jit
def _entry_rows(entry, b, h, T, N_SEL: gl.constexpr, H: gl.constexpr, G: gl.constexpr, BR: gl.constexpr,
                layout: gl.constexpr):
    """As `triton_selected._item_rows`: the rows of [B * T * HQ] of a step's entries (query t = entry // N_SEL,
    the block's slot in its list entry % N_SEL)."""
    r = gl.arange(0, BR, layout=layout)
    return (b * T + entry // N_SEL) * (H * G) + h * G + r % G


@gluon.jit
def _work_item(ITEM_SEG, ITEM_START, ITEM_END, Q0, Q0_ODD, N_BLK, H: gl.constexpr):
    """This program's work item (grid: the reverse index's items), as `triton_selected._item_block`: its entries
    [start, end) in the reverse index, batch b, KV head h, key block j, and the first query's position in row b."""
    item = gl.program_id(0).to(gl.int64)
    seg = gl.load(ITEM_SEG + item)  # (batch * H + head) * N_BLK + key block
    start = gl.load(ITEM_START + item)
    end = gl.load(ITEM_END + item)
    bh, j = seg // N_BLK, seg % N_BLK
    b, h = bh // H, bh % H
    return item, start, end, b, h, j, Q0 + (b % 2) * (Q0_ODD - Q0)  # `triton_common.row_offset`


@gluon.jit
def _block_rows(K, V, k_buf, v_buf, blk, b, h, TK, u, d, H: gl.constexpr, D: gl.constexpr, BS: gl.constexpr):
    """Gather key block `blk` of KV head h of batch b (K and V rows, u: the block's row lanes) into shared buffers
    by cp.async; keys past TK read as zeros, as the Triton kernels' masked loads."""
    key = blk * BS + u
    kv = ((b * TK + key) * H + h) * D
    ok = (key < TK)[:, None]
    cp_async_load(k_buf, K + kv[:, None] + d[None, :], mask=ok)
    cp_async_load(v_buf, V + kv[:, None] + d[None, :], mask=ok)


@gluon.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_BLK"])
def _fwd_item_kernel(Q, K, V, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, O_PART, LSE_PART, T, TK, Q0, Q0_ODD, N_BLK,
                     qk_scale, N_SEL: gl.constexpr, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                     BS: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Each (query row, chosen block) pair's softmax over that block alone, normalised, and its log-sum-exp (log2
    units), into the pair's slot (grid: the reverse index's items). Rows that see no key give 0 and -inf."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)  # per-row values of a gathered tile
    s_l: gl.constexpr = _mma_layout(BS, NUM_WARPS)
    srow_l: gl.constexpr = gl.SliceLayout(1, s_l)  # per-row values of S
    # Entries carried from one step to the next in one register a thread (the gather layout replicates each row's
    # across a row's lanes), converted where they are used.
    ent_l: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    o_l: gl.constexpr = _mma_layout(D, NUM_WARPS)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)  # bf16 P from registers
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, D], gl.bfloat16)
    block_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], gl.bfloat16)

    item, start, end, b, h, j, q0 = _work_item(ITEM_SEG, ITEM_START, ITEM_END, Q0, Q0_ODD, N_BLK, H)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))

    # The key and value block (rows past TK read as zeros, as the Triton kernel's masked loads), loaded once, and
    # the first step's query rows: one cp.async group.
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BR, D], tile_sl)
    _block_rows(K, V, k_smem, v_smem, j, b, h, TK, gl.arange(0, BS, layout=row_l), d, H, D, BS)
    ok, entry = _step_entries(QSLOT, start, end, G, BR, QB, row_l)
    rows = _entry_rows(entry, b, h, T, N_SEL, H, G, BR, row_l)
    cp_async_load(q_smem.index(0), Q + rows[:, None] * D + d[None, :], mask=ok[:, None])
    async_copy.commit_group()
    entry = gl.convert_layout(entry, ent_l)
    # The next step's entries, read now: a step's gather is issued from entries loaded one step earlier, so the read
    # of QSLOT never stalls the loop (its value is first used a whole step later).
    n_entry = _entries(QSLOT, start + QB, end, G, BR, QB, ent_l)

    pos = j * BS + gl.arange(0, BS, layout=gl.SliceLayout(0, s_l))
    buf = 0
    for qs in range(start, end, QB):
        # This step's rows have landed (the only group in flight) and every thread is past the previous step, whose
        # MMAs read the buffer the next gather overwrites. cp.async writes through the generic proxy, wgmma reads
        # through the async one: the fence orders them.
        async_copy.wait_group(0)
        fence_async_shared()
        thread_barrier()
        n_rows = _entry_rows(gl.convert_layout(n_entry, row_l), b, h, T, N_SEL, H, G, BR, row_l)
        cp_async_load(q_smem.index(buf ^ 1), Q + n_rows[:, None] * D + d[None, :],
                      mask=_step_ok(qs + QB, end, G, BR, QB, row_l)[:, None])
        async_copy.commit_group()
        s = warpgroup_mma(q_smem.index(buf), k_smem.permute((1, 0)), gl.zeros([BR, BS], gl.float32, s_l),
                          use_acc=False, is_async=True)
        # Entries two steps ahead, loaded while the MMA runs; this step's rows in S's row layout: which exist, and
        # the last key position each may see.
        nn_entry = _entries(QSLOT, qs + 2 * QB, end, G, BR, QB, ent_l)
        s_ok = _step_ok(qs, end, G, BR, QB, srow_l)
        seen = q0 + gl.convert_layout(entry, srow_l) // N_SEL
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(s_ok[:, None] & (pos[None, :] <= seen[:, None]), s * qk_scale, float("-inf"))  # log2 units
        m = gl.max(s, 1)
        p = gl.exp2(s - gl.where(m == float("-inf"), 0.0, m)[:, None])  # a row that sees no key: all 0
        l = gl.sum(p, 1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_l), v_smem, gl.zeros([BR, D], gl.float32, o_l),
                          use_acc=False, is_async=True)
        # `triton_common.softmax_output`, then the natural-log lse back to log2 units, as the Triton kernel stores it
        # (computed while P V runs).
        l_safe = gl.where(l > 0, l, 1.0)
        lse = gl.where(l > 0, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")) * 1.4426950408889634
        ok = _step_ok(qs, end, G, BR, QB, row_l)
        row_entry = gl.convert_layout(entry, row_l)
        part = _entry_rows(row_entry, b, h, T, N_SEL, H, G, BR, row_l) * N_SEL + row_entry % N_SEL
        gl.store(LSE_PART + part, gl.convert_layout(lse, row_l), mask=ok)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))[:, None]
        gl.store(O_PART + part[:, None] * D + d[None, :], gl.convert_layout(o.to(gl.bfloat16), rows_l),
                 mask=ok[:, None])
        entry, n_entry = n_entry, nn_entry
        buf ^= 1
    async_copy.wait_group(0)  # the last, empty gather (or, for an item past the real count, the first group)


@gluon.constexpr_function
def _acc_layout(m, n, num_warps):
    """wgmma accumulator layout of an [m, n] tile on num_warps warps (4 or 8): each warp 16 rows at a time, the
    warps stacked along the rows as far as m allows (8 warps on 64 rows: two warpgroups, each half the columns)."""
    along_m = min(num_warps, m // 16)
    along_n = num_warps // along_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_m, along_n],
                                     instr_shape=[16, n // along_n, 16])


@gluon.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_BLK"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, DK_PART, DV_PART, DQ_PART, T,
                     TK, Q0, Q0_ODD, N_BLK, qk_scale, scale, N_SEL: gl.constexpr, H: gl.constexpr,
                     G: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr,
                     WITH_DQ: gl.constexpr, NUM_WARPS: gl.constexpr):
    """dK/dV partial sums of one item (grid: the reverse index's items), as `triton_selected._bwd_dkdv_kernel`;
    with WITH_DQ also each (query row, chosen block) pair's dQ term, into the pair's slot of DQ_PART.

    A step: S = q k^T and dP = dO v^T on wgmma from the gathered rows in shared memory (the next step's rows
    already on their way into the other buffers); P in registers (the accumulators' layout) as soon as S is done,
    written to shared memory, and dV += P^T dO issued from its transposed view (wgmma reads a 16-bit A operand in
    either major order) while dS = P (dP - delta) is computed; dS likewise for dK += dS^T q, and dQ = dS k with dS
    read back into registers as the A operand. dK and dV stay in fp32 registers across the item's steps. Integer
    positions are 32-bit (keys < 2^31), row offsets 64-bit as in the Triton kernel."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)
    # Entries carried from one step to the next in one register a thread (the gather layout replicates each row's
    # across a row's lanes: four registers a thread at D = 64), converted where they are used.
    ent_l: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    s_l: gl.constexpr = _acc_layout(BR, BS, NUM_WARPS)  # S, dP, P, dS [BR, BS]
    srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
    kv_l: gl.constexpr = _acc_layout(BS, D, NUM_WARPS)  # dK, dV [BS, D]
    dq_l: gl.constexpr = _acc_layout(BR, D, NUM_WARPS)  # dQ [BR, D]
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, D], gl.bfloat16)
    block_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, BS], gl.bfloat16)

    item, start, end, b, h, j, q0 = _work_item(ITEM_SEG, ITEM_START, ITEM_END, Q0, Q0_ODD, N_BLK, H)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))

    # The key and value block (rows past TK zero-filled) and the first step's q and dO rows: one cp.async group.
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BR, D], tile_sl)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BR, D], tile_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BR, BS], p_sl)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BR, BS], p_sl)
    _block_rows(K, V, k_smem, v_smem, j, b, h, TK, gl.arange(0, BS, layout=row_l), d, H, D, BS)
    ok, entry = _step_entries(QSLOT, start, end, G, BR, QB, row_l)
    rows = _entry_rows(entry, b, h, T, N_SEL, H, G, BR, row_l)
    cp_async_load(q_smem.index(0), Q + rows[:, None] * D + d[None, :], mask=ok[:, None])
    cp_async_load(do_smem.index(0), DO + rows[:, None] * D + d[None, :], mask=ok[:, None])
    async_copy.commit_group()
    entry = gl.convert_layout(entry, ent_l)
    # The next step's entries, read now, so that its gather never waits for QSLOT (as in the forward).
    n_entry = _entries(QSLOT, start + QB, end, G, BR, QB, ent_l)

    pos = (j * BS).to(gl.int32) + gl.arange(0, BS, layout=gl.SliceLayout(0, s_l))  # key positions (< 2^31)
    dk = gl.zeros([BS, D], gl.float32, kv_l)
    dv = gl.zeros([BS, D], gl.float32, kv_l)
    buf = 0
    for qs in range(start, end, QB):
        # This step's rows have landed and every thread is past the previous step (whose MMAs read the buffers the
        # next gather and this step's P / dS writes overwrite); the fence orders cp.async's writes (generic proxy)
        # before wgmma's reads (async proxy).
        async_copy.wait_group(0)
        fence_async_shared()
        thread_barrier()
        n_ok = _step_ok(qs + QB, end, G, BR, QB, row_l)
        n_rows = _entry_rows(gl.convert_layout(n_entry, row_l), b, h, T, N_SEL, H, G, BR, row_l)
        cp_async_load(q_smem.index(buf ^ 1), Q + n_rows[:, None] * D + d[None, :], mask=n_ok[:, None])
        cp_async_load(do_smem.index(buf ^ 1), DO + n_rows[:, None] * D + d[None, :], mask=n_ok[:, None])
        async_copy.commit_group()

        q_buf = q_smem.index(buf)
        do_buf = do_smem.index(buf)
        s = warpgroup_mma(q_buf, k_smem.permute((1, 0)), gl.zeros([BR, BS], gl.float32, s_l), use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_buf, v_smem.permute((1, 0)), gl.zeros([BR, BS], gl.float32, s_l), use_acc=False,
                           is_async=True)
        # Entries two steps ahead, and this step's rows in the accumulators' row layout: which exist, the last key
        # position each may see (positions < 2^31), lse (log2 units, as `triton_common.load_rows`: 0 for rows that
        # do not exist, whose P is masked to 0 anyway) and delta, loaded while the MMAs run.
        nn_entry = _entries(QSLOT, qs + 2 * QB, end, G, BR, QB, ent_l)
        s_ok = _step_ok(qs, end, G, BR, QB, srow_l)
        s_entry = gl.convert_layout(entry, srow_l)
        s_rows = _entry_rows(s_entry, b, h, T, N_SEL, H, G, BR, srow_l)
        seen = (q0 + s_entry // N_SEL).to(gl.int32)
        lse = gl.load(LSE + s_rows, mask=s_ok, other=0.0) * 1.4426950408889634
        delta = gl.load(DELTA + s_rows, mask=s_ok, other=0.0)
        # P as soon as S is done (dP still running), and P^T dO issued as soon as P is in shared memory, so that
        # the tensor cores run it while dS is computed.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        visible = s_ok[:, None] & (pos[None, :] <= seen[:, None])
        p = gl.where(visible, gl.exp2(s * qk_scale - lse[:, None]), 0.0)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        thread_barrier()  # every warp's rows of P are written before a warpgroup's MMA reads them all
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_buf, dv, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp, ))  # dP done; P^T dO may still run
        ds_smem.store((p * (dp - delta[:, None])).to(gl.bfloat16))
        fence_async_shared()
        thread_barrier()
        if WITH_DQ:
            # dQ = dS k issued before dK += dS^T q, with dS as the A operand straight from its shared copy: the dQ
            # term is converted and stored while dK's MMA runs.
            dq = warpgroup_mma(ds_smem, k_smem, gl.zeros([BR, D], gl.float32, dq_l), use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q_buf, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))
            # Stored from the gather layout: 16-byte stores, four addresses a thread.
            ok = _step_ok(qs, end, G, BR, QB, row_l)
            row_entry = gl.convert_layout(entry, row_l)
            dq_row = _entry_rows(row_entry, b, h, T, N_SEL, H, G, BR, row_l) * N_SEL + row_entry % N_SEL
            gl.store(DQ_PART + dq_row[:, None] * D + d[None, :],
                     gl.convert_layout((dq * scale).to(DQ_PART.dtype.element_ty), rows_l), mask=ok[:, None])
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
        else:
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q_buf, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        entry, n_entry = n_entry, nn_entry
        buf ^= 1
    async_copy.wait_group(0)  # the last, empty gather (or, for an item past the real count, the first group)

    # An item past the real count (empty range) stores nothing, as the Triton kernel.
    u = gl.arange(0, BS, layout=gl.SliceLayout(1, kv_l))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, kv_l))
    used = (u < gl.where(start < end, BS, 0))[:, None] & (dd < D)[None, :]
    part = item * BS * D + u[:, None] * D + dd[None, :]
    gl.store(DK_PART + part, dk * scale, mask=used)
    gl.store(DV_PART + part, dv, mask=used)


def supported(q: Tensor, k: Tensor, v: Tensor, block_size: int, rows: int, do: Tensor | None = None) -> bool:
    """Whether the Gluon kernels cover this call: bf16 q, k, v (and the backward's dO) at 16-byte aligned addresses
    (the cp.async copies move 16 bytes; compiled for an unaligned base they would not lower), head dim 64 or 128,
    blocks of 64 keys, and 64 rows a step (what `_item_args` gives the forward), or with `do` (the dK/dV kernel)
    64 or 128 (`selected_attention_bwd` gives 128 with the dQ term at D > 64 and G >= 3)."""
    tensors = (q, k, v) if do is None else (q, k, v, do)
    return (all(x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0 for x in tensors) and q.shape[-1] in _HEAD_DIMS
            and block_size == _BS and rows in ((_BR,) if do is None else _BWD_ROWS))


def gluon_fwd_items(q: Tensor, k: Tensor, v: Tensor, *, O_PART: Tensor, LSE_PART: Tensor, qk_scale: float,
                    ITEM_SEG: Tensor, ITEM_START: Tensor, ITEM_END: Tensor, QSLOT: Tensor, T: int, TK: int, Q0: int,
                    Q0_ODD: int, N_BLK: int, N_SEL: int, H: int, G: int, D: int, BS: int, BR: int, QB: int, BD: int,
                    PRECISION: str, num_stages: int) -> None:
    """Launch the Gluon key-block-major forward with the arguments `selected_attention_fwd` gives
    `_fwd_item_kernel` (`_item_args` plus the outputs and qk_scale), so that a switch can route the launch here.
    PRECISION (bf16 products are exact under either) and num_stages (the pipeline here is explicit) are the Triton
    kernel's meta-parameters and do not apply; BD must equal D (a power of two head dim)."""
    if not supported(q, k, v, BS, BR) or BD != D:
        raise ValueError(f"gluon_fwd_items: needs 16-byte aligned bf16, head dim in {_HEAD_DIMS}, {_BS}-key blocks "
                         f"and {_BR} rows a step; got {q.dtype}, D = {D}, BS = {BS}, BR = {BR}")
    _fwd_item_kernel[(ITEM_SEG.shape[0],)](q, k, v, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, O_PART, LSE_PART, T, TK,
                                           Q0, Q0_ODD, N_BLK, qk_scale, N_SEL=N_SEL, H=H, G=G, D=D, BS=BS, BR=BR,
                                           QB=QB, NUM_WARPS=_NUM_WARPS, num_warps=_NUM_WARPS,
                                           maxnreg=_FWD_MAX_REGISTERS)


def bwd_launch_shape(G: int, D: int, with_dq: bool) -> tuple[int, int]:
    """(rows per step, warps) of the Gluon dK/dV kernel by default, whatever the Triton launch's: the fastest of
    64 rows on 4 warps, 64 on 8 and 128 on 8 in bench/gluon_selected.py (H200, nsa-125m's and nsa-1b's heads at
    2 x 8k and 1 x 32k; ms against Triton's), at least the next power of two of G. 128 rows on 8 warps at D = 128
    with the dQ term (nsa-1b 2 x 8k 1.039 against 1.277; 64 rows on 8 warps 1.336, on 4 2.211), else 64 rows on 4
    warps (D = 64 with the term 0.455 against 0.541; without it 0.339 against 0.509; D = 128 without it 0.720
    against 0.958, 128 rows on 8 warps 0.732)."""
    rows, warps = (128, 8) if D > 64 and with_dq else (_BR, 4)
    return max(rows, 1 << max(0, G - 1).bit_length()), warps


def gluon_bwd_dkdv_items(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, *, DK_PART: Tensor,
                         DV_PART: Tensor, DQ_PART: Tensor, qk_scale: float, scale: float, WITH_DQ: bool,
                         num_warps: int, ITEM_SEG: Tensor, ITEM_START: Tensor, ITEM_END: Tensor, QSLOT: Tensor,
                         T: int, TK: int, Q0: int, Q0_ODD: int, N_BLK: int, N_SEL: int, H: int, G: int, D: int,
                         BS: int, BR: int, QB: int, BD: int, PRECISION: str, num_stages: int,
                         rows: int | None = None, warps: int | None = None) -> None:
    """Launch the Gluon dK/dV (and dQ term) kernel with the arguments `selected_attention_bwd` gives
    `_bwd_dkdv_kernel` (outputs, scales, WITH_DQ, num_warps and `_item_args`), so that a switch can route the launch
    here. The rows per step and warps are this kernel's own (`bwd_launch_shape`, or `rows` / `warps` given):
    the work items do not depend on them, so BR, QB, num_warps, PRECISION and num_stages (bf16 products; the
    pipeline is explicit) of the Triton launch are not used. BD must equal D. lse is the natural-log lse
    [B, T, HQ], delta fp32 [B, T, HQ], as there. On 8 warps with 128 rows each warpgroup takes 64 rows of a step;
    with 64 the two warpgroups split the columns of S / dP, dK / dV and dQ."""
    default_rows, default_warps = bwd_launch_shape(G, D, WITH_DQ)
    rows, warps = rows or default_rows, warps or default_warps
    if not supported(q, k, v, BS, rows, do) or BD != D or warps not in (4, 8) or rows < G:
        raise ValueError(f"gluon_bwd_dkdv_items: needs 16-byte aligned bf16, head dim in {_HEAD_DIMS}, {_BS}-key "
                         f"blocks, {_BWD_ROWS} rows a step (G at most) and 4 or 8 warps; got {q.dtype}, D = {D}, "
                         f"BS = {BS}, rows = {rows}, G = {G}, warps = {warps}")
    _bwd_dkdv_kernel[(ITEM_SEG.shape[0],)](q, k, v, do, lse, delta, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, DK_PART,
                                           DV_PART, DQ_PART, T, TK, Q0, Q0_ODD, N_BLK, qk_scale, scale, N_SEL=N_SEL,
                                           H=H, G=G, D=D, BS=BS, BR=rows, QB=rows // G, WITH_DQ=WITH_DQ,
                                           NUM_WARPS=warps, num_warps=warps)
