"""Vectorised PyTorch NSA core: the `reference` backend and the oracle for every faster kernel.

Layout: q [B, T, HQ, D]; k, v [B, T, H, D]; compressed k/v [B, Nc, H, D]; gates [B, T, HQ, 3] (cmp, slc, win).
Query head i belongs to KV head i // G (as SDPA's enable_gqa). Queries are processed in chunks of
`query_chunk` tokens (a handful of iterations, never one per token) so that the selected branch needs
O(T * n * l') memory, not O(T^2).

Packed documents: `doc_start` int32 [B, T] gives each query t the first position s of its document (a multiple of
l', so the document's compressed and selection blocks are the global ones starting at or after s). Every branch
then sees only keys >= s: compressed block i iff i*d >= s, selection candidates j*l' >= s with block s / l' forced
instead of block 0, the window from max(s, t-w+1). None: one document per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from nsa_models.args import NSAArgs


def selection_scores(p_cmp: Tensor, seq_len: int, args: NSAArgs) -> Tensor:
    """Spec step 2: p_slc[j] = sum_i p_cmp[i] * |cmp block i ∩ selection block j| / d, summed over the group.

    p_cmp [B, H, G, C, Nc] -> [B, H, C, Ns]. Blocks start at multiples of d and l' is a multiple of d, so the
    overlap is d times the number of stride segments [m*d, (m+1)*d) the two blocks share: segment m collects
    p_cmp[m-l/d+1 .. m] (a sliding sum), selection block j the l'/d segments it covers (a sum-pool). O(T*Nc)
    work, where the dense [Nc, Ns] overlap matrix product costs O(T*Nc*Ns).
    """
    p = p_cmp.sum(2)  # the GQA group shares one selection (linear: sum first)
    per_block, per_sel = args.cmp_block_size // args.cmp_stride, args.sel_block_size // args.cmp_stride
    n_sel = args.num_sel_blocks(seq_len)
    segments = sum(F.pad(p, (shift, per_block - 1 - shift)) for shift in range(per_block))  # [.., Nc + l/d - 1]
    segments = F.pad(segments, (0, n_sel * per_sel - segments.shape[-1]))  # the cmp blocks end before T
    return segments.unflatten(-1, (n_sel, per_sel)).sum(-1)


@torch.library.custom_op("nsa::select_blocks", mutates_args=())
def select_blocks(p_cmp: Tensor, q_start: int, seq_len: int, block: int, stride: int, sel_block: int,
                  n_selected: int, doc_start: Tensor | None = None) -> Tensor:
    """Top-n selection blocks per (batch, KV head, query), shared by the GQA group.

    p_cmp: [B, H, G, C, Nc] compressed-attention probabilities of queries q_start .. q_start+C-1; doc_start
    [B, C]: their documents' first positions (None: 0). Candidates are the blocks from the document's first to the
    query's own; forced are the first, the query's own and the one before it (if in the document).
    Returns int64 [B, H, C, n]: chosen block indices in ascending order, -1 padding at the end.
    A custom op so that activation checkpointing can always save it (recomputation selects the same blocks).
    """
    C = p_cmp.shape[3]
    args = NSAArgs(cmp_block_size=block, cmp_stride=stride, sel_block_size=sel_block)
    n_sel = args.num_sel_blocks(seq_len)
    score = selection_scores(p_cmp, seq_len, args)  # [B, H, C, Ns]
    t = torch.arange(q_start, q_start + C, device=p_cmp.device)[:, None]
    j = torch.arange(n_sel, device=p_cmp.device)[None, :]
    current = t // sel_block
    first = 0 if doc_start is None else doc_start[:, None, :, None] // sel_block  # [B, 1, C, 1]
    forced = (j == first) | (j == current) | ((j == current - 1) & (j >= first))
    score = score.masked_fill(forced, float("inf")).masked_fill((j > current) | (j < first), float("-inf"))
    if n_sel < n_selected:  # fewer candidates than n: pad with impossible blocks, reported as -1
        score = F.pad(score, (0, n_selected - n_sel), value=float("-inf"))
    # Stable descending sort: equal scores keep index order, so ties break to the lower block index.
    ranked, order = torch.sort(score, dim=-1, descending=True, stable=True)
    chosen = torch.where(ranked[..., :n_selected] == float("-inf"), -1, order[..., :n_selected])
    big = torch.iinfo(torch.int64).max
    ascending = torch.sort(torch.where(chosen < 0, big, chosen), dim=-1).values
    return torch.where(ascending == big, -1, ascending)


@select_blocks.register_fake
def _(p_cmp, q_start, seq_len, block, stride, sel_block, n_selected, doc_start=None):
    B, H, G, C, _ = p_cmp.shape
    return p_cmp.new_empty((B, H, C, n_selected), dtype=torch.int64)


def _masked_softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over the last dim of the visible entries; rows with no visible key give all zeros (no NaN in
    forward or backward). Computed in at least fp32 (bf16 inputs), in fp64 for fp64 inputs (the oracle's)."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~visible, float("-inf"))
    if scores.shape[-1] == 0:  # no key at all (static shape): callers' products give zeros, grads stay defined
        return scores
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def compressed_branch(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, start: int, args: NSAArgs,
                      doc_start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Spec step 1 for queries start .. start+C-1: o_cmp [B, H, G, C, D] and the probabilities p_cmp
    [B, H, G, C, Nc]. q [B, H, G, C, D]; k_cmp, v_cmp [B, H, Nc, D]; doc_start [B, C] or None. Block i is
    visible to query t iff i*d + l - 1 <= t (and i*d >= doc_start[t])."""
    t = torch.arange(start, start + q.shape[3], device=q.device)
    cmp_start = torch.arange(k_cmp.shape[2], device=q.device) * args.cmp_stride
    visible = cmp_start + args.cmp_block_size - 1 <= t[:, None]  # [C, Nc]
    if doc_start is not None:
        visible = visible & (cmp_start >= doc_start[:, None, None, :, None])  # [B, 1, 1, C, Nc]
    p_cmp = _masked_softmax(q @ k_cmp.transpose(-1, -2).unsqueeze(2) * q.shape[-1] ** -0.5, visible)
    return p_cmp.to(v_cmp.dtype) @ v_cmp.unsqueeze(2), p_cmp


def compressed_entropy(p_cmp: Tensor) -> Tensor:
    """Entropy (nats, fp32, detached) of each query's compressed-attention distribution p_cmp [..., Nc] -> [...];
    0 for a query that sees no compressed block (its row is all zeros)."""
    return torch.special.entr(p_cmp.detach()).sum(-1).float()


def _chunk(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor, v_cmp: Tensor,
           start: int, args: NSAArgs, block_indices: Tensor | None,
           doc_start: Tensor | None) -> tuple[list[Tensor], Tensor, Tensor]:
    """Branch outputs (cmp, slc, win), each [B, H, G, C, D], block indices [B, H, C, n] and the compressed
    entropy [B, H, G, C] for queries start .. start+C-1 (documents: doc_start [B, C] or None). Head-major layouts
    throughout: q [B, H, G, C, D], keys/values [B, H, T or Nc, D], so every product is a batched matmul with no
    layout copies."""
    B, H, G, C, D = q.shape
    seq_len = k_slc.shape[2]
    scale = D ** -0.5
    device = q.device
    t = torch.arange(start, start + C, device=device)  # absolute query positions
    l, d, lp, n, w = (args.cmp_block_size, args.cmp_stride, args.sel_block_size, args.n_selected,
                      args.window_size)

    o_cmp, p_cmp = compressed_branch(q, k_cmp, v_cmp, start, args, doc_start)

    # 2-3. Selection scores and top-n, shared by the GQA group.
    if block_indices is None:
        block_indices = select_blocks(p_cmp.detach(), start, seq_len, l, d, lp, n, doc_start)

    # 4. Selected branch: gather the tokens of the chosen blocks, causal inside the current block. Chosen blocks
    # lie inside the query's document (they start at or after its first position): no document mask needed.
    pos = (block_indices.clamp_min(0)[..., None] * lp + torch.arange(lp, device=device)).flatten(-2)  # [B,H,C,n*l']
    visible = (block_indices[..., None] >= 0).expand(-1, -1, -1, -1, lp).flatten(-2) & (pos <= t[:, None])
    # A row lookup (embedding) rather than `gather`: its backward sums the many queries that share a block in
    # fp32 (bf16 atomics in gather's scatter-add lose precision and contend), deterministically on CUDA.
    rows = torch.arange(B * H, device=device).view(B, H, 1, 1) * seq_len + pos.clamp_max(seq_len - 1)
    k_sel = F.embedding(rows, k_slc.reshape(-1, D))  # [B, H, C, n*l', D]
    v_sel = F.embedding(rows, v_slc.reshape(-1, D))
    q_by_pos = q.transpose(2, 3)  # [B, H, C, G, D]: the group's heads share the gathered keys
    p_slc = _masked_softmax(q_by_pos @ k_sel.transpose(-1, -2) * scale, visible.unsqueeze(3))
    o_slc = (p_slc.to(v_sel.dtype) @ v_sel).transpose(2, 3)

    # 5. Sliding window: keys u with t - w < u <= t (and u >= doc_start[t]).
    k0 = max(0, start - w + 1)
    u = torch.arange(k0, start + C, device=device)
    visible = (u <= t[:, None]) & (u > t[:, None] - w)  # [C, K]
    if doc_start is not None:
        visible = visible & (u >= doc_start[:, None, None, :, None])  # [B, 1, 1, C, K]
    p_win = _masked_softmax(q @ k_win[:, :, k0:start + C].transpose(-1, -2).unsqueeze(2) * scale, visible)
    o_win = p_win.to(v_win.dtype) @ v_win[:, :, k0:start + C].unsqueeze(2)
    return [o_cmp, o_slc, o_win], block_indices, compressed_entropy(p_cmp)


def nsa_reference(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
                  v_cmp: Tensor, gates: Tensor, args: NSAArgs, block_indices: Tensor | None = None,
                  window_mask: BlockMask | None = None, doc_start: Tensor | None = None,
                  q_start: int | tuple[int, int] = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gated sum of the three NSA branches. Returns (out [B, T, HQ, D], block indices [B, H, T, n], compressed
    entropy [B, T, HQ]). doc_start: int32 [B, T] first position of each query's document (module docstring), or
    None. window_mask is not used: this backend masks the window itself.

    q_start: the position of the first query. The T queries (and their gates, block indices and doc_start) are
    positions q_start .. q_start+T-1 of the sequence that the keys and values span whole (context parallelism:
    one chunk of a shard's queries against the gathered sequence); 0: queries and keys are the same positions. A
    pair (even, odd): the even batch rows' first position and the odd rows' (a shard's two chunks in one call)."""
    if not isinstance(q_start, int):  # each parity of rows on its own, then the rows back in their order
        B = q.shape[0]
        parities = [torch.arange(first, B, 2, device=q.device) for first in (0, 1)]

        def rows(x: Tensor | None, parity: Tensor) -> Tensor | None:
            return None if x is None else x[parity]

        parts = [nsa_reference(*(x[parity] for x in (q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates)), args,
                               rows(block_indices, parity), None, rows(doc_start, parity), start)
                 for parity, start in zip(parities, q_start)]
        order = torch.cat(parities).argsort()
        return tuple(torch.cat(pieces)[order] for pieces in zip(*parts))
    B, T, HQ, D = q.shape
    H = k_slc.shape[2]
    G = HQ // H
    qh = q.view(B, T, H, G, D).permute(0, 2, 3, 1, 4)  # [B, H, G, T, D]
    kv = [x.transpose(1, 2) for x in (k_slc, v_slc, k_win, v_win, k_cmp, v_cmp)]  # [B, H, T or Nc, D]
    kv[:2] = [x.contiguous() for x in kv[:2]]  # the selected branch looks rows up in these: one copy, not one per chunk
    gh = gates.view(B, T, H, G, 3).permute(0, 2, 3, 1, 4)  # [B, H, G, T, 3]
    outs, indices, entropies = [], [], []
    for start in range(0, T, args.query_chunk):
        end = min(T, start + args.query_chunk)
        chunk_idx = None if block_indices is None else block_indices[:, :, start:end]
        chunk_doc = None if doc_start is None else doc_start[:, start:end]
        branches, idx, entropy = _chunk(qh[:, :, :, start:end], *kv, q_start + start, args, chunk_idx, chunk_doc)
        g = gh[:, :, :, start:end].to(branches[0].dtype)
        outs.append(sum(g[..., i:i + 1] * o for i, o in enumerate(branches)))
        indices.append(idx)
        entropies.append(entropy)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    idx = torch.cat(indices, dim=2) if len(indices) > 1 else indices[0]
    entropy = torch.cat(entropies, dim=3) if len(entropies) > 1 else entropies[0]
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D), idx, entropy.permute(0, 3, 1, 2).reshape(B, T, HQ)
