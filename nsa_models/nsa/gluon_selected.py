"""Key-block-major selected-attention forward in Gluon (Triton's explicit-layout dialect), for Hopper (sm_90).

The same work as `triton_selected._fwd_item_kernel` (inputs, outputs and the arithmetic of each (query row, chosen
block) pair), written so that what Triton's compiler would have to infer is stated: the item's key and value block
sit in NVMMA-swizzled shared memory for the whole program, each step's gathered query rows arrive by cp.async into
one of two shared buffers while the previous step computes, and both products run on warpgroup MMA (wgmma) with
fp32 accumulators, the probabilities fed from registers. One warpgroup (4 warps) runs 64 rows a step.

Supported: bf16 inputs, head dim 64 or 128, selection blocks of 64 keys, 64 rows a step (`gluon_fwd_items` raises
otherwise); the caller routes other shapes to the Triton kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_NUM_WARPS = 4  # one warpgroup: wgmma's 64-row tile is exactly a step's rows
_BS = 64  # keys per selection block
_BR = 64  # rows (queries x heads) per step
_HEAD_DIMS = (64, 128)


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
def _step_rows(QSLOT, qs, end, b, h, T, N_SEL: gl.constexpr, H: gl.constexpr, G: gl.constexpr,
               BR: gl.constexpr, QB: gl.constexpr, layout: gl.constexpr):
    """As `triton_selected._item_rows`: row r of the step starting at entry qs is head r % G of the item's
    (qs + r // G)-th (query, slot) entry. Returns which rows exist, their queries t, their rows of [B * T * HQ]
    and the block's slot in the query's list; rows past `end` (or past QB * G) are not used."""
    r = gl.arange(0, BR, layout=layout)
    ok = (r < QB * G) & (qs + r // G < end)
    entry = gl.load(QSLOT + qs + r // G, mask=ok, other=0)  # t * N_SEL + slot
    t = entry // N_SEL
    return ok, t, (b * T + t) * (H * G) + h * G + r % G, entry % N_SEL


@gluon.jit(do_not_specialize=["T", "TK", "Q0", "Q0_ODD", "N_BLK"])
def _fwd_item_kernel(Q, K, V, ITEM_SEG, ITEM_START, ITEM_END, QSLOT, O_PART, LSE_PART, T, TK, Q0, Q0_ODD, N_BLK,
                     qk_scale, N_SEL: gl.constexpr, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                     BS: gl.constexpr, BR: gl.constexpr, QB: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Each (query row, chosen block) pair's softmax over that block alone, normalised, and its log-sum-exp (log2
    units), into the pair's slot (grid: the reverse index's items). Rows that see no key give 0 and -inf."""
    rows_l: gl.constexpr = _row_layout(D, NUM_WARPS)
    row_l: gl.constexpr = gl.SliceLayout(1, rows_l)  # per-row values of a gathered tile
    s_l: gl.constexpr = _mma_layout(BS, NUM_WARPS)
    o_l: gl.constexpr = _mma_layout(D, NUM_WARPS)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)  # bf16 P from registers
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, D], gl.bfloat16)
    block_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], gl.bfloat16)

    item = gl.program_id(0).to(gl.int64)
    seg = gl.load(ITEM_SEG + item)  # (batch * H + head) * N_BLK + key block
    start = gl.load(ITEM_START + item)
    end = gl.load(ITEM_END + item)
    bh, j = seg // N_BLK, seg % N_BLK
    b, h = bh // H, bh % H
    q0 = Q0 + (b % 2) * (Q0_ODD - Q0)  # `triton_common.row_offset`
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_l))

    # The key and value block (rows past TK read as zeros, as the Triton kernel's masked loads), loaded once, and
    # the first step's query rows: one cp.async group.
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], block_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BR, D], tile_sl)
    key = j * BS + gl.arange(0, BS, layout=row_l)
    kv = ((b * TK + key) * H + h) * D
    kv_ok = (key < TK)[:, None]
    async_copy.async_copy_global_to_shared(k_smem, K + kv[:, None] + d[None, :], mask=kv_ok)
    async_copy.async_copy_global_to_shared(v_smem, V + kv[:, None] + d[None, :], mask=kv_ok)
    ok, t, rows, slot = _step_rows(QSLOT, start, end, b, h, T, N_SEL, H, G, BR, QB, row_l)
    async_copy.async_copy_global_to_shared(q_smem.index(0), Q + rows[:, None] * D + d[None, :], mask=ok[:, None])
    async_copy.commit_group()

    pos = j * BS + gl.arange(0, BS, layout=gl.SliceLayout(0, s_l))
    buf = 0
    for qs in range(start, end, QB):
        # This step's rows have landed (the only group in flight) and every thread is past the previous step, whose
        # MMAs read the buffer the next gather overwrites. cp.async writes through the generic proxy, wgmma reads
        # through the async one: the fence orders them.
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        n_ok, n_t, n_rows, n_slot = _step_rows(QSLOT, qs + QB, end, b, h, T, N_SEL, H, G, BR, QB, row_l)
        async_copy.async_copy_global_to_shared(q_smem.index(buf ^ 1), Q + n_rows[:, None] * D + d[None, :],
                                               mask=n_ok[:, None])
        async_copy.commit_group()

        s = warpgroup_mma(q_smem.index(buf), k_smem.permute((1, 0)), gl.zeros([BR, BS], gl.float32, s_l),
                          use_acc=False, is_async=True)
        seen = gl.convert_layout(q0 + t, gl.SliceLayout(1, s_l))  # the last key position each row may see
        used = gl.convert_layout(ok, gl.SliceLayout(1, s_l))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(used[:, None] & (pos[None, :] <= seen[:, None]), s * qk_scale, float("-inf"))  # log2 units
        m = gl.max(s, 1)
        p = gl.exp2(s - gl.where(m == float("-inf"), 0.0, m)[:, None])  # a row that sees no key: all 0
        l = gl.sum(p, 1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_l), v_smem, gl.zeros([BR, D], gl.float32, o_l),
                          use_acc=False)

        # `triton_common.softmax_output`, then the natural-log lse back to log2 units, as the Triton kernel stores it.
        l_safe = gl.where(l > 0, l, 1.0)
        lse = gl.where(l > 0, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")) * 1.4426950408889634
        o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))[:, None]
        part = rows * N_SEL + slot
        gl.store(O_PART + part[:, None] * D + d[None, :], gl.convert_layout(o.to(gl.bfloat16), rows_l),
                 mask=ok[:, None])
        gl.store(LSE_PART + part, gl.convert_layout(lse, row_l), mask=ok)
        ok, t, rows, slot = n_ok, n_t, n_rows, n_slot
        buf ^= 1
    async_copy.wait_group(0)  # the last, empty gather (or, for an item past the real count, the first group)


def supported(q: Tensor, k: Tensor, v: Tensor, block_size: int, rows: int) -> bool:
    """Whether the Gluon kernel covers this call: bf16 q, k, v at 16-byte aligned addresses (the cp.async copies move
    16 bytes; compiled for an unaligned base they would not lower), head dim 64 or 128, blocks of 64 keys, 64 rows a
    step (what `_item_args` gives the forward)."""
    return (all(x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0 for x in (q, k, v)) and q.shape[-1] in _HEAD_DIMS
            and block_size == _BS and rows == _BR)


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
                                           QB=QB, NUM_WARPS=_NUM_WARPS, num_warps=_NUM_WARPS)
