"""The library kernels' plumbing on CPU: how `nsa_models.nsa` packs queries, keys and documents into flash-attn 2's
and FlashAttention-4's calls, run with the libraries replaced by a plain-torch stand-in that keeps their contract
(dense or variable-length sequences from cu_seqlens / seqused, bottom-right causal alignment, a left window; FA4's
lse [HQ, total] when variable-length, and rows outside every sequence left unwritten: NaN here, so that a caller
which reads them fails). The results must equal the Triton compressed kernel (interpreter) and the masked-SDPA
window, with and without packed documents. The kernels themselves are tested on the GPU (tests/test_triton_gpu.py,
tests/test_triton_document_mask.py, tests/test_oracles.py).
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from nsa_models.args import NSAArgs
from nsa_models.nsa import fa4
from nsa_models.nsa.triton_backend import window_attention
from tests.helpers import ROWS, T_CPU, pack, real_tokens, rel_err, ungated_compressed

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter test; on a GPU the real FA4 kernels are tested")


def _sequences(q: Tensor, k: Tensor, cu_q, cu_k, seqused) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence, in FA4's reading of its arguments."""
    if cu_q is None:
        return [(slice(b, b + 1), slice(b, b + 1)) for b in range(q.shape[0])]
    spans = []
    for b in range(len(cu_q) - 1):
        n_q = int(seqused[b]) if seqused is not None else int(cu_q[b + 1] - cu_q[b])
        n_k = int(seqused[b]) if seqused is not None else int(cu_k[b + 1] - cu_k[b])
        spans.append((slice(int(cu_q[b]), int(cu_q[b]) + n_q), slice(int(cu_k[b]), int(cu_k[b]) + n_k)))
    return spans


def _probabilities(q: Tensor, k: Tensor, scale: float, window_left: int | None) -> tuple[Tensor, Tensor]:
    """Attention probabilities [HQ, Lq, Lk] (float64) of one sequence, q [Lq, HQ, D] over k [Lk, HQ, D], under FA's
    bottom-right causal mask, and the lse [HQ, Lq]; a query that sees no key gets p = 0 and lse -inf."""
    Lq, Lk = q.shape[0], k.shape[0]
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * scale
    i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
    seen = j <= i + Lk - Lq
    if window_left is not None:
        seen = seen & (j >= i + Lk - Lq - window_left)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int | None) -> tuple[Tensor, Tensor]:
    """One sequence [Lq, HQ, D] over [Lk, H, D]: o, lse [HQ, Lq] (0 and -inf where no key is seen, as FA4)."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    p, lse = _probabilities(q, k, scale, window_left)
    return torch.einsum("hij,jhd->ihd", p, v.double()).to(q.dtype), lse.float()


def _attend_grads(q, k, v, do, dlse, scale, window_left):
    """dq, dk, dv of one sequence for the cotangents do [Lq, HQ, D] and dlse [HQ, Lq] (or None)."""
    group = q.shape[1] // k.shape[1]
    ke, ve = (x.repeat_interleave(group, dim=1).double() for x in (k, v))
    p, _ = _probabilities(q, ke, scale, window_left)
    o = torch.einsum("hij,jhd->ihd", p, ve)
    dp = torch.einsum("ihd,jhd->hij", do.double(), ve)
    ds = p * (dp - (do.double() * o).sum(-1).T[..., None] + (0 if dlse is None else dlse.double()[..., None]))
    dq = torch.einsum("hij,jhd->ihd", ds, ke) * scale
    dk = (torch.einsum("hij,ihd->jhd", ds, q.double()) * scale).unflatten(1, (-1, group)).sum(2)
    dv = torch.einsum("hij,ihd->jhd", p, do.double()).unflatten(1, (-1, group)).sum(2)
    return dq, dk, dv


def _forward(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
             max_seqlen_k=None, softmax_scale=None, causal=True, window_size_left=None, window_size_right=0,
             return_lse=True):
    varlen = cu_seqlens_q is not None
    out = torch.full_like(q, float("nan"))
    HQ = q.shape[-2]
    lse = torch.full((HQ, q.shape[0]) if varlen else (q.shape[0], HQ, q.shape[1]), float("nan"))
    for rows_q, rows_k in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q):
        if varlen:
            o, l_ = _attend(q[rows_q], k[rows_k], v[rows_k], softmax_scale, window_size_left)
            out[rows_q], lse[:, rows_q] = o, l_
        else:
            o, l_ = _attend(q[rows_q][0], k[rows_k][0], v[rows_k][0], softmax_scale, window_size_left)
            out[rows_q], lse[rows_q] = o[None], l_[None]
    return out, lse


def _backward(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=None,
              window_size_right=0, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
              max_seqlen_q=None, max_seqlen_k=None, deterministic=True, dq=None, dk=None, dv=None, dlse=None):
    """Gradients of the sequences' rows, written into dq, dk, dv when given, else into NaN-filled tensors."""
    dq, dk, dv = (torch.full_like(x, float("nan")) if given is None else given
                  for x, given in ((q, dq), (k, dk), (v, dv)))
    varlen = cu_seqlens_q is not None
    for rows_q, rows_k in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q):
        if varlen:
            sq, sk, sv, sdo = q[rows_q], k[rows_k], v[rows_k], dout[rows_q]
            sdlse = None if dlse is None else dlse[:, rows_q]
        else:
            sq, sk, sv, sdo = q[rows_q][0], k[rows_k][0], v[rows_k][0], dout[rows_q][0]
            sdlse = None if dlse is None else dlse[rows_q][0]
        grads = _attend_grads(sq, sk, sv, sdo, sdlse, softmax_scale, window_size_left)
        for target, rows, g in zip((dq, dk, dv), (rows_q, rows_k, rows_k), grads):
            target[rows] = (g if varlen else g[None]).to(target.dtype)
    return dq, dk, dv


@pytest.fixture
def fa4_stand_in(monkeypatch):
    monkeypatch.setattr(fa4, "_kernels", lambda: types.SimpleNamespace(_flash_attn_fwd=lambda *a, **kw: (
        *_forward(*a, **kw), None), _flash_attn_bwd=_backward))


@pytest.mark.parametrize("blocks", [(16, 8, 16), (8, 4, 16)], ids=["l16-d8", "l8-d4"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_fa4_compressed_plumbing_matches_triton(fa4_stand_in, blocks: tuple, documents: bool):
    """`fa4_compressed_attention`: o, lse and dq, dk, dv equal the Triton compressed kernel's, every row (the rows
    FA4 leaves unwritten must come out 0 / -inf, their gradients 0)."""
    (l, d, lp), G, H, D, B = blocks, 2, 2, 16, 2
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=lp)
    doc_start, spans = pack(ROWS, T_CPU, lp)
    gen = torch.Generator().manual_seed(l + d)
    q = (torch.randn(B, T_CPU, H * G, D, generator=gen) * 2).requires_grad_()
    k, v = (torch.randn(B, args.num_cmp_blocks(T_CPU), H, D, generator=gen).requires_grad_() for _ in range(2))
    cot = torch.randn(q.shape, generator=gen) * (real_tokens(spans, T_CPU) if documents else 1)
    docs = doc_start if documents else None
    results = []
    for run in (lambda: ungated_compressed(q, k, v, l, d, D ** -0.5, docs),
                lambda: fa4.fa4_compressed_attention(q, k, v, l, d, D ** -0.5, True, docs, lp)):
        o, lse = run()
        results.append((o, lse, *torch.autograd.grad((o * cot).sum() + lse.nan_to_num(0, 0, 0).sum(), (q, k, v))))
    want, got = results
    assert torch.equal(got[1].isinf(), want[1].isinf())
    for name, g, w in zip(["o", "lse", "dq", "dk", "dv"], got, want):
        assert not g.isnan().any(), name
        assert rel_err(g.nan_to_num(0, 0, 0), w.nan_to_num(0, 0, 0)) <= 1e-5, name


@pytest.fixture
def flash_attn_stand_in(monkeypatch):
    """flash-attn 2's `flash_attn_func` and `flash_attn_varlen_func` (differentiable: plain torch)."""
    def dense(q, k, v, causal=True, window_size=(-1, -1), deterministic=False):
        assert causal and window_size[1] == 0
        return torch.stack([_attend(q[b], k[b], v[b], q.shape[-1] ** -0.5, window_size[0])[0]
                            for b in range(q.shape[0])])

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, window_size=(-1, -1),
               deterministic=False):
        assert causal and window_size[1] == 0 and cu_seqlens_q[-1] == q.shape[0]
        spans = _sequences(q, k, cu_seqlens_q, cu_seqlens_k, None)
        assert max(s.stop - s.start for s, _ in spans) <= max_seqlen_q
        return torch.cat([_attend(q[s], k[t], v[t], q.shape[-1] ** -0.5, window_size[0])[0] for s, t in spans])

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=dense,
                                                                          flash_attn_varlen_func=varlen))


@pytest.mark.parametrize("window_backend", ["flash_attn", "flash_attn_4"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_library_window_plumbing_matches_sdpa(fa4_stand_in, flash_attn_stand_in, window_backend: str,
                                               documents: bool):
    """flash-attn 2's and FA4's window (`window_attention`): outputs and gradients equal the masked-SDPA window's."""
    args = NSAArgs(sel_block_size=16, window_size=24, window_backend="sdpa")
    B, H, G, D = 2, 2, 2, 16
    doc_start = pack(ROWS, T_CPU, args.sel_block_size)[0] if documents else None
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, T_CPU, h, D, generator=gen).requires_grad_() for h in (H * G, H, H))
    cot = torch.randn(B, T_CPU, H * G, D, generator=gen)
    results = []
    for run_args in (args, replace(args, window_backend=window_backend)):
        o = window_attention(q, k, v, run_args, doc_start=doc_start)
        results.append((o, *torch.autograd.grad((o * cot).sum(), (q, k, v))))
    for name, g, w in zip(["o", "dq", "dk", "dv"], *results[::-1]):
        assert rel_err(g, w) <= 1e-5, name
