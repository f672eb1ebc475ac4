"""FlexAttention as the model's attention code calls it, from compiled and eager code alike."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention


@functools.cache
def _compiled_flex_attention():
    """flex_attention is only fused (and memory-lean) when compiled; compile it once, on first use."""
    return torch.compile(flex_attention, dynamic=False)


def flex(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """flex_attention(q, k, v, **kwargs): traced into the caller's graph inside torch.compile; eager callers (an
    uncompiled model or benchmark) take the compiled one, as the unfused one materialises the T x T scores."""
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return attend(q, k, v, **kwargs)
