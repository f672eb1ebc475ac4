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
