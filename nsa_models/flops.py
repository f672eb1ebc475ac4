"""Model FLOPs per token for MFU: matmuls plus the three NSA branches with their real key counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_models.args import ModelArgs


@dataclass
class FlopsPerToken:
    """Training FLOPs (forward + backward = 3 x forward) per token, by part."""

    matmul: float
    """Linear layers (projections, gates, phi, MLP, output head) amortised per token."""
    attention: dict[str, float]
    """Attention score and value products per branch (`cmp`, `slc`, `win`, or `dense`), causal-aware."""

    @property
    def total(self) -> float:
        return self.matmul + sum(self.attention.values())


def mean_keys_per_query(args: ModelArgs, seq_len: int) -> dict[str, float]:
    """Average number of keys each query attends to in each branch, averaged over positions 0..T-1."""
    t = torch.arange(seq_len, dtype=torch.float64)
    if args.attention == "dense":
        return {"dense": float((t + 1).mean())}
    a = args.nsa
    cmp_keys = torch.clamp(torch.div(t - a.cmp_block_size + 1, a.cmp_stride, rounding_mode="floor") + 1, min=0)
    current = torch.div(t, a.sel_block_size, rounding_mode="floor")
    # The current block is forced and partly causal; every other selected block lies wholly in the past.
    slc_keys = ((torch.clamp(current + 1, max=a.n_selected) - 1) * a.sel_block_size
                + (t - current * a.sel_block_size + 1))
    win_keys = torch.clamp(t + 1, max=a.window_size)
    return {"cmp": float(cmp_keys.mean()), "slc": float(slc_keys.mean()), "win": float(win_keys.mean())}


def flops_per_token(args: ModelArgs, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token of `args` at sequence length `seq_len` (embedding lookups excluded)."""
    d, hd, hq, hkv = args.dim, args.head_dim, args.n_heads, args.n_kv_heads
    per_layer = d * hq * hd * 2 + 2 * d * hkv * hd + 3 * d * args.ffn_dim  # q, o, k, v, SwiGLU
    if args.attention == "nsa":
        a = args.nsa
        per_layer += 2 * d * hkv * hd * (3 if a.separate_kv else 1) - 2 * d * hkv * hd + d * 3 * hq  # k/v sets, gate
        if a.compress == "mlp":
            n_cmp = a.num_cmp_blocks(seq_len)
            hidden = a.cmp_hidden(hd)
            phi = a.cmp_block_size * hd * hidden + hidden * hd  # per block, per KV head, for K or for V
            per_layer += 2 * hkv * phi * n_cmp / seq_len
    matmul = 6 * (args.n_layers * per_layer + d * args.vocab_size)
    # Per key: q.k and p.v, each 2*hd FLOPs per query head; x3 for forward + backward.
    attention = {name: 3 * 2 * 2 * hd * hq * keys * args.n_layers
                 for name, keys in mean_keys_per_query(args, seq_len).items()}
    return FlopsPerToken(matmul=matmul, attention=attention)
