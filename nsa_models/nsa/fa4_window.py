"""Sliding-window attention (NSA branch 5) through FlashAttention-4 (package flash-attn-4, module
`flash_attn.cute`: Hopper/Blackwell kernels written in the CUTLASS CuTe DSL), as torch custom ops.

`flash_attn.cute.flash_attn_func` is an autograd.Function that compiles its kernels on first use, which Dynamo
cannot trace; the forward and backward are wrapped here as ops with fake implementations, so a compiled NSA block
keeps 0 graph breaks. The backward runs FA4's deterministic mode (its dQ/dK/dV accumulation serialised in a fixed
order), as every other NSA kernel here: bitwise repeatable, measured up to 17% slower than its atomic mode and
still faster than FlexAttention (docs/PERFORMANCE.md, session 18); `model.nsa.float_atomics` opts in to the atomic
mode. Written against flash-attn-4 4.0.0b36, whose `_flash_attn_fwd` / `_flash_attn_bwd` are the functions its
autograd.Function calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa_models.args import missing_window_package


def _kernels():
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise ImportError(missing_window_package("flash_attn_4")) from e
    return interface


@torch.library.custom_op("nsa::fa4_window_fwd", mutates_args=())
def fa4_window_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float,
                   deterministic: bool) -> tuple[Tensor, Tensor]:
    """o [B, T, HQ, D] over keys t-window+1 .. t, and the natural-log lse [B, HQ, T] (fp32) the backward needs;
    deterministic: the mode of the backward."""
    out, lse, *_ = _kernels()._flash_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale=scale,
                                              causal=True, window_size_left=window - 1, window_size_right=0,
                                              return_lse=True)
    return out, lse


@fa4_window_fwd.register_fake
def _(q, k, v, window, scale, deterministic):
    B, T, HQ, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, HQ, T, dtype=torch.float32)


@torch.library.custom_op("nsa::fa4_window_bwd", mutates_args=())
def fa4_window_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, window: int,
                   scale: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv; bitwise repeatable when deterministic, else accumulated with float atomics (faster)."""
    return tuple(_kernels()._flash_attn_bwd(q.contiguous(), k.contiguous(), v.contiguous(), o, do.contiguous(), lse,
                                            scale, True, 0.0, window_size_left=window - 1, window_size_right=0,
                                            deterministic=deterministic))


@fa4_window_bwd.register_fake
def _(do, q, k, v, o, lse, window, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.window, ctx.scale, ctx.deterministic = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, do, _dlse):  # the lse is the backward's input only: callers take o
    q, k, v, o, lse = ctx.saved_tensors
    return *fa4_window_bwd(do, q, k, v, o, lse, ctx.window, ctx.scale, ctx.deterministic), None, None, None


fa4_window_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, deterministic: bool = True) -> Tensor:
    """Attention of q [B, T, HQ, D] over keys t-window+1 .. t of k, v [B, T, H, D] (H dividing HQ); [B, T, HQ, D].
    deterministic=False: a backward with float atomics (faster, not bitwise repeatable)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"model.nsa.window_backend = 'flash_attn_4' needs bf16 or fp16 inputs on a CUDA GPU (Hopper "
                         f"or newer), got {q.dtype} on {q.device.type}: train with bf16 autocast, or set it to 'flex'")
    # Contiguous once here: the op saves its inputs for the backward, which then needs no copies of its own.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return fa4_window_fwd(q, k, v, window, q.shape[-1] ** -0.5, deterministic)[0]
