"""Brute-force NSA oracle for the tests: per-query masks built with Python loops, dense float64 attention.

Written independently of `nsa_models.nsa.reference` (interval arithmetic, Python sorting, T x T masks) so that
the two can only agree by both following NSA_SPEC.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa_models.args import NSAArgs


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """q [B, T, HQ, D], k/v [B, S, H, D], mask [B, HQ, T, S] -> out [B, T, HQ, D], probs [B, HQ, T, S]."""
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    any_key = mask.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(any_key, scores, torch.zeros_like(scores)), dim=-1) * any_key
    return torch.einsum("bhts,bshd->bthd", probs, v), probs


def oracle_select(p_cmp: Tensor, T: int, args: NSAArgs, group: int) -> list:
    """Chosen blocks per [b][kv head][t] as ascending lists (Python), following the spec literally."""
    l, d, lp, n = args.cmp_block_size, args.cmp_stride, args.sel_block_size, args.n_selected
    B, HQ, _, n_cmp = p_cmp.shape
    n_sel = (T + lp - 1) // lp
    overlap = torch.zeros(n_cmp, n_sel, dtype=torch.float64)
    for i in range(n_cmp):
        for j in range(n_sel):
            overlap[i, j] = len(set(range(i * d, i * d + l)) & set(range(j * lp, (j + 1) * lp))) / d
    p_slc = p_cmp.detach().double() @ overlap  # [B, HQ, T, Ns]
    score = p_slc.view(B, HQ // group, group, T, n_sel).sum(2)
    chosen = []
    for b in range(B):
        chosen.append([])
        for h in range(HQ // group):
            chosen[b].append([])
            for t in range(T):
                current = t // lp
                forced = sorted({0, current, current - 1} & set(range(current + 1)))
                rest = sorted((j for j in range(current + 1) if j not in forced),
                              key=lambda j: (-score[b, h, t, j].item(), j))
                chosen[b][h].append(sorted(forced + rest[: n - len(forced)]))
    return chosen


def oracle_nsa(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, args: NSAArgs) -> tuple[Tensor, Tensor]:
    """NSA output [B, T, HQ, D] and block indices [B, H, T, n] (ascending, -1 padded)."""
    B, T, HQ, D = q.shape
    H = k_slc.shape[2]
    G = HQ // H
    l, d, lp, n, w = args.cmp_block_size, args.cmp_stride, args.sel_block_size, args.n_selected, args.window_size
    n_cmp = k_cmp.shape[1]

    cmp_mask = torch.tensor([[i * d + l - 1 <= t for i in range(n_cmp)] for t in range(T)], dtype=torch.bool)
    o_cmp, p_cmp = masked_attention(q, k_cmp, v_cmp, cmp_mask.expand(B, HQ, T, n_cmp), G)

    chosen = oracle_select(p_cmp, T, args, G)
    slc_mask = torch.zeros(B, HQ, T, T, dtype=torch.bool)
    indices = torch.full((B, H, T, n), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                blocks = chosen[b][h][t]
                indices[b, h, t, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
                for j in blocks:
                    slc_mask[b, h * G:(h + 1) * G, t, j * lp: min(t + 1, (j + 1) * lp)] = True
    o_slc, _ = masked_attention(q, k_slc, v_slc, slc_mask, G)

    win_mask = torch.tensor([[t - w < u <= t for u in range(T)] for t in range(T)], dtype=torch.bool)
    o_win, _ = masked_attention(q, k_win, v_win, win_mask.expand(B, HQ, T, T), G)

    out = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    return out, indices


# --- chunked fp32 oracles for sizes past 2^31 elements ----------------------------------------------------------
# The same attention as above, gathered per chunk of queries: no T x T mask, so the GPU tests can reach the sizes
# where a kernel's buffers pass 2^31 elements. Gradients by autograd, accumulated over the chunks.

def selected_chunked(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, block: int, cot: Tensor,
                     chunk: int = 2048) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 selected attention of q [B, T, HQ, D] over the blocks idx [B, H, T, n] (-1: none) of k, v [B, T, H, D]:
    out, and dq, dk, dv for the cotangent cot [B, T, HQ, D]. Query t sees the keys u <= t of its chosen blocks."""
    B, T, HQ, D = q.shape
    H, n = k.shape[2], idx.shape[3]
    G = HQ // H
    k32, v32 = (x.detach().float().requires_grad_() for x in (k, v))
    kh, vh = k32.transpose(1, 2), v32.transpose(1, 2)  # [B, H, T, D]
    out, dq = torch.empty(B, T, HQ, D, device=q.device), torch.empty(B, T, HQ, D, device=q.device)
    u = torch.arange(block, device=q.device)
    for t0 in range(0, T, chunk):
        c = min(T, t0 + chunk) - t0
        qc = q[:, t0:t0 + c].detach().float().requires_grad_()
        blocks = idx[:, :, t0:t0 + c]
        pos = (blocks[..., None] * block + u).flatten(-2)  # [B, H, c, n * block]
        t = torch.arange(t0, t0 + c, device=q.device)[:, None]
        visible = (blocks >= 0).repeat_interleave(block, -1) & (pos <= t)
        at = pos.clamp(0, T - 1).flatten(2)[..., None].expand(-1, -1, -1, D)
        kg, vg = (x.gather(2, at).view(B, H, c, n * block, D) for x in (kh, vh))
        qg = qc.view(B, c, H, G, D).permute(0, 2, 3, 1, 4)  # [B, H, G, c, D]
        scores = torch.einsum("bhgcd,bhckd->bhgck", qg, kg) * D ** -0.5
        probs = torch.softmax(scores.masked_fill(~visible[:, :, None], float("-inf")), -1)
        o = torch.einsum("bhgck,bhckd->bhgcd", probs, vg).permute(0, 3, 1, 2, 4).reshape(B, c, HQ, D)
        (o * cot[:, t0:t0 + c].float()).sum().backward()
        out[:, t0:t0 + c], dq[:, t0:t0 + c] = o.detach(), qc.grad
    return out, dq, k32.grad, v32.grad


def compressed_oracle(q: Tensor, k: Tensor, v: Tensor, block: int, stride: int) -> tuple[Tensor, Tensor]:
    """Compressed attention of q [B, T, HQ, D] over compressed k, v [B, Nc, H, D] (block i visible to query t iff
    i * stride + block - 1 <= t), differentiable, in the inputs' dtype: out and the natural-log lse [B, T, HQ]
    (-inf: no block visible; out 0 there)."""
    B, T, HQ, D = q.shape
    H, n_cmp = k.shape[2], k.shape[1]
    visible = torch.arange(n_cmp, device=q.device) * stride + block - 1 <= torch.arange(T, device=q.device)[:, None]
    scores = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(HQ // H, 2)) * D ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(lse == float("-inf"), 0, lse)[..., None])
    return torch.einsum("bhts,bshd->bthd", probs, v.repeat_interleave(HQ // H, 2)), lse.transpose(1, 2)


def compressed_exact(q: Tensor, k: Tensor, v: Tensor, block: int, stride: int,
                     cot: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`compressed_oracle` in fp32: out, lse, and dq, dk, dv for the cotangent cot."""
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, lse = compressed_oracle(q32, k32, v32, block, stride)
    grads = torch.autograd.grad((out * cot.float()).sum(), (q32, k32, v32))
    return out.detach(), lse.detach(), *grads
