"""Triton compressed attention and top-n selection under the Triton interpreter (CPU), against the reference.

Kernels run in fp32 (the interpreter's bf16 tl.dot is wrong); the oracle is the reference in fp64. On a GPU,
tests/test_triton_gpu.py covers the compiled kernels at real shapes.
"""

import functools
import os

import pytest
import torch
import triton
import triton.language as tl

from nsa_models.args import NSAArgs
from nsa_models.nsa import triton_common, triton_compressed, triton_selection
from nsa_models.nsa.reference import compressed_branch, select_blocks
from nsa_models.nsa.triton_compressed import compressed_attention_fwd
from nsa_models.nsa.triton_selection import select_topn, selection_keys
from tests.helpers import ROWS, assert_valid_selection, pack, reference_scores, ungated_compressed
from tests.nsa_oracle import compressed_oracle

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests; with a GPU, test_triton_gpu.py runs instead")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def random_gate(B: int, T: int, HQ: int, gen: torch.Generator) -> torch.Tensor:
    """A compressed gate [B, T, HQ] (fp64, as sigmoids give: in [0, 1)), exactly 0 on about a quarter of the rows:
    their gated lse is +inf, yet the gate's own gradient rowsum(o dO) must still come."""
    gate = torch.rand(B, T, HQ, generator=gen, dtype=torch.float64)
    return gate.masked_fill(torch.rand(gate.shape, generator=gen) < 0.25, 0)


def reference(q, k, v, args):
    """The reference's compressed output [B, T, HQ, D], probabilities [B, H, G, T, Nc] and entropy [B, T, HQ]."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    o, p = compressed_branch(q.view(B, T, H, HQ // H, D).permute(0, 2, 3, 1, 4), k.transpose(1, 2),
                             v.transpose(1, 2), 0, args)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return (o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D), p,
            entropy.permute(0, 3, 1, 2).reshape(B, T, HQ))


# (B, T, H, G, D, l/d/l', n, keys per tile): T < l, T not a multiple of any block, G of 1, 2, 3 (forward and dQ
# tiles of 21 positions x 3 heads; dK/dV and the selection in head slices of 2 + 1 rows a position), 4 and 7 (slices
# of 4 + 3 heads, the second padded to 4 rows a position), both overlap patterns (l = 2d and l = d = l'), n above the
# candidate count (padding), D not a power of two, and small tiles so that loops run over several key tiles (the
# selection's overlap carried across them) and reach the unmasked tiles (whose unused rows and rows past T must add
# nothing).
CASES = [(1, 20, 1, 2, 16, (32, 16, 64), 3, 64, True),
         (2, 37, 1, 1, 16, (16, 16, 16), 4, 64, False),
         (1, 70, 2, 3, 16, (32, 16, 16), 3, 64, True),
         (1, 130, 2, 4, 24, (32, 16, 64), 2, 64, True),
         (1, 200, 1, 2, 16, (16, 8, 32), 5, 64, False),
         (1, 300, 2, 2, 16, (16, 8, 16), 6, 16, True),
         (1, 200, 2, 3, 16, (32, 16, 64), 4, 16, False),
         (1, 90, 1, 7, 16, (32, 16, 16), 3, 16, True)]


# tma: keys and values through the kernels' device-side TMA descriptors (at these head dims, only when told to), or
# pointer loads.
@pytest.mark.parametrize("B,T,H,G,D,blocks,n,keys,tma", CASES)
def test_compressed_attention_and_selection_match_reference(B, T, H, G, D, blocks, n, keys, tma, monkeypatch):
    monkeypatch.setattr(triton_common, "TMA_MIN_ROW_BYTES", 0 if tma else 1 << 30)
    monkeypatch.setattr(triton_compressed, "_KEYS", keys)
    monkeypatch.setattr(triton_selection, "_KEYS", keys)
    monkeypatch.setattr(triton_compressed, "_KEYS_BWD", keys)
    if keys < 64:  # several query chunks per block tile
        monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MIN", 64)
        monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MAX", 64)
    l, d, lp = blocks
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=lp, n_selected=n)
    gen = torch.Generator().manual_seed(T * 7 + G)
    n_cmp = args.num_cmp_blocks(T)
    q = (torch.randn(B, T, H * G, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    k, v = (torch.randn(B, n_cmp, H, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    gate = random_gate(B, T, H * G, gen).requires_grad_()
    want_o, p_cmp, want_entropy = reference(q, k, v, args)
    want_o = gate[..., None] * want_o

    q32, k32, v32, gate32 = (x.detach().float().requires_grad_() for x in (q, k, v, gate))
    o, lse, _ = compressed_attention_fwd(q32, k32, v32, gate32, l, d, D ** -0.5)
    assert rel_err(o, want_o) <= 1e-5
    # lse (ungated: the selection's) is -inf exactly where the query sees no block (t < l - 1), finite elsewhere.
    assert torch.equal(torch.isinf(lse), (torch.arange(T) < l - 1).view(1, T, 1).expand_as(lse))

    # The gated output's gradients: the kernels take dO as it is and the gate through the gated lse.
    cot = torch.randn_like(want_o)
    want = torch.autograd.grad((want_o * cot).sum(), (q, k, v, gate))
    got = torch.autograd.grad((o * cot.float()).sum(), (q32, k32, v32, gate32))
    for name, g, w in zip(["q", "k", "v", "gate"], got, want):
        assert rel_err(g, w) <= 1e-5, f"d{name}: rel err {rel_err(g, w):.2e}"

    idx, entropy = select_topn(q32.detach(), k32.detach(), lse, l, d, lp, n, D ** -0.5)
    want_scores = reference_scores(q, k, args)
    assert_valid_selection(idx, want_scores, n, tol=1e-5)
    keys = selection_keys(q32.detach(), k32.detach(), lse, l, d, lp, D ** -0.5)
    scores = (keys >> 32).to(torch.int32).view(torch.float32)  # candidates' scores
    finite = torch.isfinite(want_scores)
    assert torch.equal(keys < 0, want_scores == float("-inf"))
    assert torch.equal(scores.isinf() & (keys >= 0), want_scores == float("inf"))
    assert rel_err(scores[finite], want_scores[finite]) <= 1e-5
    assert torch.equal(idx, select_blocks(p_cmp.float(), 0, T, l, d, lp, n))  # no near-ties at these sizes
    assert rel_err(entropy, want_entropy) <= 1e-5 if n_cmp else torch.equal(entropy, torch.zeros_like(entropy))
    # The selection's other paths pick the same blocks: 32-bit sort keys (taken for bf16 inputs; no scores here are
    # within 2^-18 of each other), pointer loads of the keys (taken when a tile's blocks exceed one TMA box) and
    # the loop that skips unseen tiles (taken from G = 16, beyond these cases' groups). One call runs all three: a
    # selection call is the costliest step of these cases in the interpreter.
    monkeypatch.setattr(triton_selection, "_wide_keys", lambda dtype, n_sel: False)
    monkeypatch.setattr(triton_selection, "_TMA_BOX_ROWS", 0)
    monkeypatch.setattr(triton_selection, "_PIPELINE_MAX_GP", 0)
    assert torch.equal(select_topn(q32.detach(), k32.detach(), lse, l, d, lp, n, D ** -0.5)[0], idx)


# (G, l', n, documents' lengths per row or None, q_start): query tiles of 32 positions (G = 2; G = 3 in head slices
# of 2 + 1). Each case has tiles whose every query has at most n candidates (written directly), tiles whose every
# query has more (ranked) and tiles mixing both (ranked). With l' = 8 the last document of row 1 starts past the
# first key tile of 16 selection blocks: its tiles' loops start at the second.
ALL_CHOSEN_CASES = [(2, 16, 3, ROWS, 0), (3, 8, 4, [[20, 90, 29], [5, 128, 20]], 0), (3, 16, 3, None, 8)]


@pytest.mark.parametrize("G,lp,n,rows,q_start", ALL_CHOSEN_CASES)
def test_selection_where_tiles_choose_all_candidates(G: int, lp: int, n: int, rows: list | None, q_start: int,
                                                      monkeypatch):
    """The selection's indices equal the reference's and its entropy matches, whether a query tile chooses every
    query's candidates or ranks them (or mixes queries of both kinds), with documents or a query offset."""
    monkeypatch.setattr(triton_selection, "_KEYS", 16)  # 16 selection blocks a key tile: several in a row
    l, d = 16, 8
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=lp, n_selected=n)
    B, T, H, D = 2, 157, 2, 16
    doc_start = None if rows is None else pack(rows, T, lp)[0]
    first = 0 if rows is None else doc_start // lp
    count = (q_start + torch.arange(T)) // lp - first + 1  # each query's candidates
    tiles = count.expand(B, T).split(64 // triton.next_power_of_2(G), dim=1)
    assert {((c <= n).all().item(), (c > n).all().item()) for c in tiles} == {(True, False), (False, True),
                                                                             (False, False)}
    gen = torch.Generator().manual_seed(lp * 7 + G)
    q = torch.randn(B, T, H * G, D, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(B, args.num_cmp_blocks(q_start + T), H, D, generator=gen, dtype=torch.float64)
    _, p_cmp = compressed_branch(q.view(B, T, H, G, D).permute(0, 2, 3, 1, 4), k.transpose(1, 2),
                                 k.transpose(1, 2), q_start, args, doc_start)
    want_entropy = torch.special.entr(p_cmp).sum(-1).permute(0, 3, 1, 2).reshape(B, T, H * G)
    _, lse = ungated_compressed(q.float(), k.float(), k.float(), l, d, D ** -0.5, doc_start, q_start)
    idx, entropy = select_topn(q.float(), k.float(), lse, l, d, lp, n, D ** -0.5, doc_start, q_start)
    assert torch.equal(idx, select_blocks(p_cmp.float(), q_start, q_start + T, l, d, lp, n, doc_start))
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide_keys", [True, False], ids=["64-bit-keys", "32-bit-keys"])
def test_many_queries_share_one_block_and_ties_break_low(wide_keys: bool, monkeypatch):
    """Identical compressed keys give every block the same score: the lowest indices win, as the reference."""
    monkeypatch.setattr(triton_selection, "_wide_keys", lambda dtype, n_sel: wide_keys)
    args = NSAArgs(cmp_block_size=16, cmp_stride=16, sel_block_size=16, n_selected=4)
    B, T, H, G, D = 1, 160, 1, 2, 16
    q = torch.randn(B, T, H * G, D)
    k = torch.randn(1, 1, 1, D).expand(B, args.num_cmp_blocks(T), H, D).contiguous()
    _, lse = ungated_compressed(q, k, k, 16, 16, D ** -0.5)
    idx, _ = select_topn(q, k, lse, 16, 16, 16, 4, D ** -0.5)
    _, p_cmp, _ = reference(q.double(), k.double(), k.double(), args)
    assert torch.equal(idx, select_blocks(p_cmp.float(), 0, T, 16, 16, 16, 4))
    assert idx[0, 0, 100].tolist() == [0, 1, 5, 6]  # forced 0, 5, 6; the tie among 1..4 goes to block 1


@pytest.mark.parametrize("loss", ["out+lse", "lse"])
def test_lse_gradient_with_a_gate(loss: str):
    """An lse cotangent (with or without the gated output's): dS gains dlse P, which the gated probabilities g P
    cannot carry where g = 0, so the op takes the ungated lse against g dO. q, k, v and gate gradients, the gate's
    zeros included, against the fp64 oracle."""
    B, T, H, G, D, l, d = 1, 70, 2, 3, 16, 32, 16
    gen = torch.Generator().manual_seed(3)
    n_cmp = NSAArgs(cmp_block_size=l, cmp_stride=d).num_cmp_blocks(T)
    q = (torch.randn(B, T, H * G, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    k, v = (torch.randn(B, n_cmp, H, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    gate = random_gate(B, T, H * G, gen).requires_grad_()
    cot = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    cot_lse = torch.randn(gate.shape, generator=gen, dtype=torch.float64)

    def objective(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        lse_term = (torch.where(lse.isinf(), 0, lse) * cot_lse.to(lse.dtype)).sum()  # -inf rows: no gradient
        return lse_term + (o * cot.to(o.dtype)).sum() if loss == "out+lse" else lse_term

    want_o, want_lse = compressed_oracle(q, k, v, l, d)
    want = torch.autograd.grad(objective(gate[..., None] * want_o, want_lse), (q, k, v, gate),
                               materialize_grads=True)  # lse alone: no gradient of the gate (the op's: exact 0)
    q32, k32, v32, gate32 = (x.detach().float().requires_grad_() for x in (q, k, v, gate))
    got = torch.autograd.grad(objective(*compressed_attention_fwd(q32, k32, v32, gate32, l, d, D ** -0.5)[:2]),
                              (q32, k32, v32, gate32))
    for name, g, w in zip(["q", "k", "v", "gate"], got, want):
        assert rel_err(g, w) <= 1e-5, f"d{name}: rel err {rel_err(g, w):.2e}"


def test_rejects_unsupported_shapes():
    q, k = torch.zeros(1, 8, 2, 16), torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        compressed_attention_fwd(q, k, k, torch.ones(1, 8, 2), 36, 12, 0.25)
    with pytest.raises(ValueError, match=r"gate \(1, 8\) must be \[B, T, HQ\]"):
        compressed_attention_fwd(q, k, k, torch.ones(1, 8), 32, 16, 0.25)
    with pytest.raises(ValueError, match="at most"):
        select_topn(q, k, torch.zeros(1, 8, 2), 128, 16, 64, 2, 0.25)


@triton.jit
def _xor_sum_and_sort_kernel(X, XOR0, XOR1, SORTED, M: tl.constexpr, N: tl.constexpr):
    rows, cols = tl.arange(0, M)[:, None], tl.arange(0, N)[None, :]
    x = tl.load(X + rows * N + cols)
    tl.store(XOR0 + cols, tl.xor_sum(x, 0, keep_dims=True))
    tl.store(XOR1 + tl.arange(0, M), tl.xor_sum(x, 1))
    tl.store(SORTED + rows * N + cols, tl.sort(x, dim=1, descending=True))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_interpreter_xor_sum_and_sort_match_torch(dtype):
    """tests/conftest.py gives the interpreter a numpy path for XOR reductions (the sort's compare-and-swap uses
    them): along either axis, with and without keep_dims, they equal torch's XOR of the slices, and the sort built
    on them equals torch's (negative keys included, as the selection's -1 padding)."""
    M, N = 8, 16
    x = torch.randint(torch.iinfo(dtype).min, torch.iinfo(dtype).max, (M, N), dtype=dtype,
                      generator=torch.Generator().manual_seed(0))
    xor0, xor1, got_sorted = torch.empty(N, dtype=dtype), torch.empty(M, dtype=dtype), torch.empty_like(x)
    _xor_sum_and_sort_kernel[(1,)](x, xor0, xor1, got_sorted, M=M, N=N)
    assert torch.equal(xor0, functools.reduce(torch.bitwise_xor, x.unbind(0)))
    assert torch.equal(xor1, functools.reduce(torch.bitwise_xor, x.unbind(1)))
    assert torch.equal(got_sorted, x.sort(dim=1, descending=True).values)
