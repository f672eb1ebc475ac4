"""Packed documents as the variable-length sequences of the attention libraries (flash-attn 2 and FlashAttention-4
take `cu_seqlens` over the flattened batch, not per-token masks).

doc_start [B, T] (`Transformer.forward`) starts documents at multiples of the selection block, so a row holds at most
T / l' of them: that bound, with the unused slots as empty sequences at the end, keeps every shape static as the
documents change (no recompiles, no host sync), at the price of a mostly empty grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def document_starts(doc_start: Tensor, align: int) -> Tensor:
    """Where each packed document starts, as rows of the flattened [B * T] tokens, in order, then B * T for each
    unused slot: int32 [B * ceil(T / align)]. Documents start at multiples of `align`."""
    B, T = doc_start.shape
    slots = torch.arange(0, T, align, device=doc_start.device)
    row = torch.arange(B, device=doc_start.device)[:, None] * T
    starts = torch.where(doc_start[:, slots] == slots, row + slots, B * T)
    return starts.flatten().sort().values.to(torch.int32)


def document_cu_seqlens(doc_start: Tensor, align: int) -> Tensor:
    """`document_starts` closed by B * T: the libraries' cu_seqlens, one sequence per document (and per unused
    slot, empty), covering every token of the flattened batch."""
    B, T = doc_start.shape
    return F.pad(document_starts(doc_start, align), (0, 1), value=B * T)
