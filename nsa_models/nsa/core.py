"""The functional NSA core with an explicit backend choice (no silent fallback)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from nsa_models.args import NSAArgs
from nsa_models.nsa.reference import nsa_reference

BACKENDS = {"reference": nsa_reference}
try:  # triton ships with CUDA builds of torch; a CPU-only install may lack it, then "triton" is not offered
    from nsa_models.nsa.triton_backend import nsa_triton

    BACKENDS["triton"] = nsa_triton
except ImportError:
    pass


def nsa_attention(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
                  v_cmp: Tensor, gates: Tensor, args: NSAArgs, block_indices: Tensor | None = None,
                  window_mask: BlockMask | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """NSA output [B, T, HQ, D], selected block indices [B, H, T, n] (int64, -1 = padding) and the entropy
    [B, T, HQ] (fp32, detached, nats) of each query head's compressed-attention distribution, 0 for a query that
    sees no compressed block (telemetry: `nsa_models.model.nsa_stats`).

    q: [B, T, HQ, D] rotated queries; k_*/v_*: [B, T, H, D] per-branch keys/values (the same tensors when the
    projection is shared); k_cmp/v_cmp: [B, Nc, H, D] compressed keys/values; gates: [B, T, HQ, 3] sigmoid
    gates for (cmp, slc, win). Pass block_indices to attend to given blocks instead of selecting, and the
    `window_mask` of this length to reuse it (built inside otherwise).
    """
    if args.backend not in BACKENDS:
        raise ValueError(f"model.nsa.backend = {args.backend!r} is not available; built backends: "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[args.backend](q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, args, block_indices,
                                  window_mask)


def window_mask(seq_len: int, args: NSAArgs, device: torch.device) -> BlockMask | None:
    """The FlexAttention BlockMask of the window when the triton backend runs it through FlexAttention on a GPU,
    else None. Build it once per forward outside activation-checkpointed regions (building it inside a
    checkpointed compiled block fails in Dynamo: "HOP: unsafe side effect") and pass it to every layer."""
    if args.backend != "triton" or args.window_backend != "flex" or device.type != "cuda":
        return None
    from nsa_models.nsa.triton_backend import window_block_mask

    return window_block_mask(seq_len, args.window_size, device)
