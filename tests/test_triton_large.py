"""The Triton kernels past 2^31 elements (GPU): every buffer a kernel addresses, and the work lists built around
it, at a size where offsets no longer fit 32 bits, against chunked fp32 oracles (`tests.nsa_oracle`).

- the selected branch key-block-major (nsa-125m: G = 3, D = 64) at one sequence of 196,608 tokens, compiled as
  the model runs it: its per-slot partial outputs and dQ terms [B, T, HQ, n, D] pass 2^31 (2.4e9 elements), and
  so does segment * T of its reverse index (where Inductor's code for the former 64-bit sort keys gave NaN);
- the selected branch on query tiles, the compressed branch, the selection and the window at 257 x 4,096 tokens of
  16 heads of 128: q, o, dO and dQ pass 2^31 (2.16e9 elements); the oracle checks the first and the last sequence
  of the batch, whose rows start past 2^31.
"""

import pytest
import torch
import torch.nn.functional as F

from bench.attention import random_block_indices
from nsa_models.args import NSAArgs
from nsa_models.nsa.triton_backend import window_attention
from nsa_models.nsa.triton_selected import selected_attention
from nsa_models.nsa.triton_selection import select_topn
from tests.helpers import assert_valid_selection, reference_scores, rel_err, ungated_compressed
from tests.nsa_oracle import compressed_exact, selected_chunked

pytestmark = pytest.mark.gpu

INT32_ELEMENTS = 2 ** 31
BF16_TOL = 1e-2
# Many short sequences of 16 query heads of 128 (G = 16, one KV head): q passes 2^31 elements.
WIDE = dict(B=257, T=4096, H=1, G=16, D=128)


def leaves(B: int, T: int, H: int, G: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, T, h, D, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
                 for h in (H * G, H, H))


def assert_close(got: list, want: list, names: str) -> None:
    for name, g, w in zip(names.split(), got, want):
        assert torch.isfinite(g).all(), f"{name}: not finite"
        assert rel_err(g, w) <= BF16_TOL, f"{name}: rel err {rel_err(g, w):.2e}"


def test_selected_key_block_major_compiled_past_2_31():
    """nsa-125m's selected branch at one sequence of 196,608 tokens under torch.compile(fullgraph=True): output
    and every gradient against the chunked oracle over the whole sequence."""
    B, T, H, G, D, block, n = 1, 196608, 4, 3, 64, 64, 16
    assert B * T * H * G * n * D > INT32_ELEMENTS  # the per-slot partials
    q, k, v = leaves(B, T, H, G, D, seed=0)
    idx = random_block_indices(B, H, T, n, block, "cuda")
    out = torch.compile(selected_attention, fullgraph=True)(q, k, v, idx, block)
    cot = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), cot)]
    del out
    assert_close(got, selected_chunked(q, k, v, idx, block, cot), "out dq dk dv")


def test_selected_query_tiles_past_2_31():
    """G = 16 (query tiles, TMA key loads) at 257 x 4,096 tokens: output and gradients of the first and the last
    sequence against the oracle (each sequence's gradients depend on its own rows alone)."""
    B, T, H, G, D = WIDE.values()
    block, n = 64, 16
    q, k, v = leaves(B, T, H, G, D, seed=1)
    assert q.numel() > INT32_ELEMENTS
    idx = random_block_indices(B, H, T, n, block, "cuda")
    out = selected_attention(q, k, v, idx, block)
    cot = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), cot)]
    for b in (0, B - 1):
        one = slice(b, b + 1)
        assert_close([x[one] for x in got], selected_chunked(q[one], k[one], v[one], idx[one], block, cot[one]),
                     "out dq dk dv")


def test_compressed_and_selection_past_2_31():
    """Compressed attention (forward, lse, backward) and the top-n selection at 257 x 4,096 tokens, the first and the
    last sequence against the oracle and the reference's selection scores."""
    B, T, H, G, D = WIDE.values()
    args = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16)
    q = leaves(B, T, H, G, D, seed=2)[0]
    assert q.numel() > INT32_ELEMENTS
    k, v = (x[:, :args.num_cmp_blocks(T)].detach().clone().requires_grad_() for x in leaves(B, T, H, 1, D, 3)[1:])
    out, lse = ungated_compressed(q, k, v, args.cmp_block_size, args.cmp_stride, D ** -0.5)
    cot = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), cot)]
    idx, entropy = select_topn(q.detach(), k.detach(), lse, args.cmp_block_size, args.cmp_stride,
                               args.sel_block_size, args.n_selected, D ** -0.5)
    assert torch.isfinite(entropy).all()
    seen = slice(args.cmp_block_size - 1, None)  # queries that see a compressed block
    for b in (0, B - 1):
        one = slice(b, b + 1)
        want_out, want_lse, *want_grads = compressed_exact(q[one], k[one], v[one], args.cmp_block_size,
                                                           args.cmp_stride, cot[one])
        assert_close([x[one] for x in got], [want_out, *want_grads], "out dq dk dv")
        assert rel_err(lse[one, seen], want_lse[:, seen]) <= 1e-3
        assert (lse[one, :seen.start] == float("-inf")).all()
        assert_valid_selection(idx[one], reference_scores(q[one], k[one], args), args.n_selected, tol=1e-3)


def test_flex_window_past_2_31():
    """The FlexAttention window as the backend calls it, at 257 x 4,096 tokens: the first and the last sequence
    against fp32 SDPA with the window mask."""
    B, T, H, G, D = WIDE.values()
    args = NSAArgs(window_size=512, window_backend="flex")
    q, k, v = leaves(B, T, H, G, D, seed=4)
    assert q.numel() > INT32_ELEMENTS
    out = window_attention(q, k, v, args)
    cot = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), cot)]
    t = torch.arange(T, device="cuda")
    mask = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < args.window_size)
    for b in (0, B - 1):
        q32, k32, v32 = (x[b:b + 1].detach().float().requires_grad_() for x in (q, k, v))
        want = F.scaled_dot_product_attention(q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=True).transpose(1, 2)
        want_grads = torch.autograd.grad(want, (q32, k32, v32), cot[b:b + 1].float())
        assert_close([x[b:b + 1] for x in got], [want, *want_grads], "out dq dk dv")
