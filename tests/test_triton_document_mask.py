"""Document masking in the `triton` backend: with doc_start, every packed document gets the outputs, log-sum-exp,
selected blocks and gradients that it gets alone (doc_start None), kernel by kernel and through the whole backend.

The oracle cuts each document out (its real tokens, and the compressed blocks from its start on) and runs it alone
through the same function. CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1 without a GPU) at tiny
shapes in fp32. GPU (`gpu` marker): real shapes, each window and compressed backend, and a 64k row of many
documents. The libraries take documents as variable-length sequences (`varlen`; their plumbing:
tests/test_library_plumbing.py).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from nsa_models.args import NSAArgs
from nsa_models.nsa import fa4, triton_compressed, triton_selection, varlen
from nsa_models.nsa.triton_backend import nsa_triton
from nsa_models.nsa.triton_compressed import _document_ends
from nsa_models.nsa.triton_selection import select_topn
from tests.helpers import (
    ROWS,
    T_CPU,
    assert_valid_selection,
    needs_flash_attn_4,
    pack,
    real_tokens,
    reference_scores,
    rel_err,
    ungated_compressed,
)

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU interpreter tests; with a GPU, the gpu tests below run instead")
NAMES = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]


def cut(x: Tensor, b: int, start: int, length: int, args: NSAArgs, compressed: bool) -> Tensor:
    """Document (b, start, length)'s part of x, as a fresh leaf: its tokens [1, length, ...], or with `compressed`
    its compressed blocks, the global blocks from its start on that fit inside it."""
    first, n = (start // args.cmp_stride, args.num_cmp_blocks(length)) if compressed else (start, length)
    return x.detach()[b:b + 1, first:first + n].clone().requires_grad_()


def assert_zero_outside_documents(grads: list[Tensor], names: list[str], spans: list, args: NSAArgs) -> None:
    """The gradient rows that no document's own run covers are exactly zero: padding tokens (their outputs have a
    zero cotangent) and the compressed blocks that end past their document's last token (no real query sees one).
    A kernel that leaves them unwritten fails here."""
    for name, g in zip(names, grads):
        compressed = name in ("k_cmp", "v_cmp")
        outside = torch.ones(g.shape[:2], dtype=torch.bool, device=g.device)
        for b, row in enumerate(spans):
            for start, length in row:
                first = start // args.cmp_stride if compressed else start
                outside[b, first:first + (args.num_cmp_blocks(length) if compressed else length)] = False
        assert (g[outside] == 0).all(), f"grad of {name}: nonzero rows outside every document"


def alone_indices(idx: Tensor, start: int, sel_block: int) -> Tensor:
    """Block indices of a document run alone, numbered as in the packed row."""
    return torch.where(idx >= 0, idx + start // sel_block, idx)


# --- CPU: the Triton interpreter -------------------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("G,keys,blocks", [(2, 16, (8, 4, 16)), (3, 32, (16, 8, 16))], ids=["G2-d4", "G3-d8"])
def test_compressed_attention_and_selection_per_document(G: int, keys: int, blocks: tuple, monkeypatch):
    """Compressed attention (o, lse, dq, dk, dv) and the top-n selection (indices, entropy) of each packed document
    equal its own run. Small tiles put several key tiles and dK/dV query chunks in each document, so that the masked,
    unmasked and skipped ranges of every kernel all run (with d = 4, dK/dV's first key tile has unmasked query steps
    in the third document of row 0)."""
    monkeypatch.setattr(triton_compressed, "_KEYS", keys)
    monkeypatch.setattr(triton_selection, "_KEYS", keys)
    monkeypatch.setattr(triton_compressed, "_KEYS_BWD", keys)
    monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MIN", 32)
    monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MAX", 32)
    (l, d, lp), n = blocks, 3
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=lp, n_selected=n)
    B, T, H, D = 2, T_CPU, 2, 16
    doc_start, spans = pack(ROWS, T, lp)
    gen = torch.Generator().manual_seed(G)
    q = (torch.randn(B, T, H * G, D, generator=gen) * 2).requires_grad_()
    k, v = (torch.randn(B, args.num_cmp_blocks(T), H, D, generator=gen).requires_grad_() for _ in range(2))
    cot = torch.randn(q.shape, generator=gen) * real_tokens(spans, T)
    o, lse = ungated_compressed(q, k, v, l, d, D ** -0.5, doc_start)
    grads = torch.autograd.grad((o * cot).sum(), (q, k, v))
    idx, entropy = select_topn(q.detach(), k.detach(), lse, l, d, lp, n, D ** -0.5, doc_start)
    assert torch.isfinite(o).all()
    for b, row in enumerate(spans):
        for start, length in row:
            rows = slice(start, start + length)
            qa = cut(q, b, start, length, args, False)
            ka, va = (cut(x, b, start, length, args, True) for x in (k, v))
            oa, lse_a = ungated_compressed(qa, ka, va, l, d, D ** -0.5)
            want = torch.autograd.grad((oa * cot[b:b + 1, rows]).sum(), (qa, ka, va))
            idx_a, entropy_a = select_topn(qa.detach(), ka.detach(), lse_a, l, d, lp, n, D ** -0.5)
            doc = f"document ({b}, {start}, {length})"
            assert rel_err(o[b:b + 1, rows], oa) <= 1e-5, doc
            assert torch.equal(lse[b:b + 1, rows].isinf(), lse_a.isinf()), doc  # -inf: no block visible yet
            assert rel_err(lse[b:b + 1, rows].nan_to_num(0, 0, 0), lse_a.nan_to_num(0, 0, 0)) <= 1e-5, doc
            blocks = slice(start // d, start // d + ka.shape[1])
            for name, got, w in zip("qkv", (grads[0][b:b + 1, rows], grads[1][b:b + 1, blocks],
                                            grads[2][b:b + 1, blocks]), want):
                assert rel_err(got, w) <= 1e-5, f"{doc}: d{name} rel err {rel_err(got, w):.2e}"
            assert torch.equal(idx[b:b + 1, :, rows], alone_indices(idx_a, start, lp)), doc
            assert rel_err(entropy[b:b + 1, rows], entropy_a) <= 1e-5, doc


@interpreter
def test_backend_per_document():
    """The whole backend (compressed, selection, selected branch, masked-SDPA window; separate K/V per branch): each
    document's output, selected blocks and the gradients of all eight inputs equal its own run. The selected
    branch has no document mask: a block chosen within a document lies inside it."""
    args = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=3, window_size=24,
                   window_backend="sdpa")
    B, T, H, G, D = 2, T_CPU, 1, 2, 16
    doc_start, spans = pack(ROWS, T, args.sel_block_size)
    gen = torch.Generator().manual_seed(0)
    n_cmp = args.num_cmp_blocks(T)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, n_cmp, H, D)] * 2
    leaves = [torch.randn(s, generator=gen) * (2.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    leaves = [x.requires_grad_() for x in leaves + [torch.rand(B, T, H * G, 3, generator=gen)]]
    out, idx, _ = nsa_triton(*leaves, args, doc_start=doc_start)
    cot = torch.randn(out.shape, generator=gen) * real_tokens(spans, T)
    grads = torch.autograd.grad((out * cot).sum(), leaves)
    assert torch.isfinite(out).all()
    assert_zero_outside_documents(grads, NAMES, spans, args)
    for b, row in enumerate(spans):
        for start, length in row:
            rows = slice(start, start + length)
            alone = [cut(x, b, start, length, args, name in ("k_cmp", "v_cmp"))
                     for name, x in zip(NAMES, leaves)]
            want, idx_a, _ = nsa_triton(*alone, args)
            want_grads = torch.autograd.grad((want * cot[b:b + 1, rows]).sum(), alone)
            doc = f"document ({b}, {start}, {length})"
            assert torch.equal(idx[b:b + 1, :, rows], alone_indices(idx_a, start, args.sel_block_size)), doc
            assert rel_err(out[b:b + 1, rows], want) <= 1e-5, doc
            for name, g, w in zip(NAMES, grads, want_grads):
                first = start // args.cmp_stride if name in ("k_cmp", "v_cmp") else start
                got = g[b:b + 1, first:first + w.shape[1]]
                assert rel_err(got, w) <= 1e-5, f"{doc}: grad of {name} rel err {rel_err(got, w):.2e}"


def test_document_ends():
    """Each position's document end (exclusive): the next document's first position, or T."""
    doc_start, _ = pack(ROWS, T_CPU, 16)
    ends = _document_ends(doc_start)
    assert ends.dtype == torch.int32
    assert torch.equal(ends[0], torch.tensor([32] * 32 + [128] * 96 + [T_CPU] * (T_CPU - 128), dtype=torch.int32))
    assert torch.equal(ends[1], torch.tensor([16] * 16 + [128] * 112 + [T_CPU] * (T_CPU - 128), dtype=torch.int32))


def test_library_document_sequences():
    """The libraries' view of packed documents, against the spans `pack` placed: `varlen.document_starts` gives
    each document's first token in the flattened batch, then B * T per unused slot (one slot per `align`
    positions); FA4's `_document_runs` each document's row and runs [first, last) of d positions, and each run's
    document's first."""
    align, d = 16, 8
    doc_start, spans = pack(ROWS, T_CPU, align)
    B, slots = len(ROWS), T_CPU // align
    firsts = [b * T_CPU + start for b, row in enumerate(spans) for start, _ in row]
    want = torch.tensor(firsts + [B * T_CPU] * (B * slots - len(firsts)), dtype=torch.int32)
    assert torch.equal(varlen.document_starts(doc_start, align), want)
    assert torch.equal(varlen.document_cu_seqlens(doc_start, align), torch.cat([want, want.new_tensor([B * T_CPU])]))
    row, first, last, run_first = fa4._document_runs(doc_start, align, d)
    spans_out = [(b, start // d, -(-end // d)) for b, r in enumerate(spans)
                 for (start, _), end in zip(r, [s for s, _ in r[1:]] + [T_CPU])]
    pad = B * slots - len(spans_out)
    assert list(zip(row.tolist(), first.tolist(), last.tolist())) == spans_out + [(B, 0, 0)] * pad
    assert torch.equal(run_first, doc_start[:, ::d].long() // d)
    # T not a multiple of d: the last run of a row, partly padding, is its last document's.
    _, _, last, _ = fa4._document_runs(doc_start[:, :T_CPU - 3], align, d)
    assert last[len(spans[0]) - 1] == -(-(T_CPU - 3) // d)


# --- GPU: real shapes ------------------------------------------------------------------------------------------

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
GPU_HYPER = dict(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512)


def check_documents(rows: list[list[int]], T: int, H: int, G: int, D: int, args: NSAArgs, dtype: torch.dtype,
                    docs: int | None = None) -> None:
    """The packed backend against each document alone (the first `docs` of each row and its last; all by default),
    on the GPU; alone, the window runs through masked SDPA (exact, and no FlexAttention compile per document
    length) and the compressed branch through the Triton kernel.
    Sums in another order may rank near-equal selection scores differently: the packed choice must be a valid
    top-n of the document's own scores, and the document alone then attends to the blocks the packed run chose."""
    B = len(rows)
    doc_start, spans = pack(rows, T, args.sel_block_size, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(T + G)
    n_cmp = args.num_cmp_blocks(T)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 2 + [(B, n_cmp, H, D)] * 2
    leaves = [torch.randn(s, generator=gen, device="cuda") * (2.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    leaves = [x.to(dtype).requires_grad_() for x in leaves + [torch.rand(B, T, H * G, 3, generator=gen,
                                                                          device="cuda")]]

    def call(q, k, v, k_cmp, v_cmp, gates, args, **kwargs):  # one K/V for the selected and window branches
        return nsa_triton(q, k, v, k, v, k_cmp, v_cmp, gates, args, **kwargs)

    out, idx, _ = call(*leaves, args, doc_start=doc_start)
    cot = torch.randn(out.shape, generator=gen, device="cuda") * real_tokens(spans, T, "cuda")
    grads = torch.autograd.grad((out.float() * cot).sum(), leaves)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    names = ["q", "k", "v", "k_cmp", "v_cmp", "gates"]
    assert_zero_outside_documents(grads, names, spans, args)
    # A document's gradient may be zero up to rounding: a 40-token document's one compressed block is the only block
    # its queries see, so softmax gives it weight 1 and its dK is 0 but for each kernel's own rounding (entries near
    # 1e-6 in bf16, where the whole dK's RMS is near 6). Below 1% of that RMS, a slice is measured against it.
    floors = [0.01 * g.float().pow(2).mean().sqrt().item() for g in grads]
    for b, row in enumerate(spans):
        for start, length in row if docs is None else row[:docs] + row[-1:]:
            rows_ = slice(start, start + length)
            alone = [cut(x, b, start, length, args, name in ("k_cmp", "v_cmp"))
                     for name, x in zip(names, leaves)]
            own_idx = alone_indices(idx[b:b + 1, :, rows_], -start, args.sel_block_size)  # numbered from its start
            assert_valid_selection(own_idx, reference_scores(alone[0], alone[3], args), args.n_selected, tol=1e-3)
            want, _, _ = call(*alone, replace(args, window_backend="sdpa", cmp_backend="triton"),
                              block_indices=own_idx)
            want_grads = torch.autograd.grad((want.float() * cot[b:b + 1, rows_]).sum(), alone)
            doc = f"document ({b}, {start}, {length})"
            assert rel_err(out[b:b + 1, rows_], want) <= TOL[dtype], doc
            for name, g, w, floor in zip(names, grads, want_grads, floors):
                first = start // args.cmp_stride if name in ("k_cmp", "v_cmp") else start
                got = g[b:b + 1, first:first + w.shape[1]]
                err = rel_err(got, w, floor)
                assert err <= TOL[dtype], f"{doc}: grad of {name} rel err {err:.2e}"


# (window, compressed, dtype): FlashAttention-4 runs bf16 only. fp32 runs through the SDPA window: FlexAttention's
# fp32 compile at these shapes took 140-370 s, most of the GPU suite's wall time, and masks as its bf16 does.
BACKEND_CASES = [("flex", "triton", torch.bfloat16),
                 ("sdpa", "triton", torch.float32), ("sdpa", "triton", torch.bfloat16),
                 ("flash_attn_4", "triton", torch.bfloat16), ("flex", "flash_attn_4", torch.bfloat16),
                 ("flash_attn_4", "flash_attn_4", torch.bfloat16), ("flash_attn", "triton", torch.bfloat16),
                 ("fused_with_selected", "triton", torch.float32), ("fused_with_selected", "triton", torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("window_backend,cmp_backend,dtype", BACKEND_CASES,
                         ids=[f"{w}-{c}-{str(t)[6:]}" for w, c, t in BACKEND_CASES])
@pytest.mark.parametrize("G,D", [(3, 64), (16, 128)])
def test_backend_per_document_gpu(G: int, D: int, window_backend: str, cmp_backend: str, dtype: torch.dtype):
    """Documents shorter than a block, longer than the window, odd lengths, one row a single document."""
    if "flash_attn_4" in (window_backend, cmp_backend):
        needs_flash_attn_4()
    if window_backend == "flash_attn":
        pytest.importorskip("flash_attn.flash_attn_interface", reason="flash-attn 2 is not installed")
    args = NSAArgs(**GPU_HYPER, window_backend=window_backend, cmp_backend=cmp_backend)
    if window_backend == "fused_with_selected":  # at most 64 blocks of 64
        check_documents([[40, 700, 1501, 777], [4000]], 4096, 2, G, D, args, dtype)
    else:
        check_documents([[40, 700, 1501, 1000, 777], [4113]], 4160, 2, G, D, args, dtype)


@pytest.mark.gpu
def test_64k_micro_batch_of_many_documents():
    """One 64k row of about 70 documents (lengths 1 to 1500, and one of 20,000): every output and gradient finite,
    and the first 40 documents (the long one among them) and the last one as if run alone, in bf16."""
    gen = torch.Generator().manual_seed(0)
    lengths, end = [], 0
    while True:  # as many as fit, each from a multiple of 64
        n = 20_000 if len(lengths) == 30 else int(torch.randint(1, 1500, (), generator=gen))
        if -(-end // 64) * 64 + n > 65536:
            break
        lengths.append(n)
        end = -(-end // 64) * 64 + n
    assert len(lengths) > 41
    check_documents([lengths], 65536, 1, 3, 64, NSAArgs(**GPU_HYPER, window_backend="flex"), torch.bfloat16,
                    docs=40)


@pytest.mark.gpu
@pytest.mark.parametrize("fa4_backends", [False, True], ids=["flex-triton", "flash_attn_4"])
def test_compiled_backend_takes_new_documents_without_recompiling(fa4_backends: bool):
    """torch.compile(fullgraph=True) of the backend with documents (FlexAttention window, its BlockMask built from
    doc_start inside the graph; or FlashAttention-4's window and compressed branch, documents as sequences): no
    graph break, and other document boundaries of the same shape run the same graph."""
    if fa4_backends:
        needs_flash_attn_4()
    args = NSAArgs(**GPU_HYPER, **({"window_backend": "flash_attn_4", "cmp_backend": "flash_attn_4"} if fa4_backends
                                   else {"window_backend": "flex"}))
    B, T, H, G, D = 1, 2048, 2, 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_cmp = args.num_cmp_blocks(T)
    q, k, v = (torch.randn(B, T, h, D, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (H * G, H, H))
    k_cmp, v_cmp = (torch.randn(B, n_cmp, H, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gates = torch.rand(B, T, H * G, 3, generator=gen, device="cuda")

    def run(doc_start):
        return nsa_triton(q, k, v, k, v, k_cmp, v_cmp, gates, args, doc_start=doc_start)[0]

    compiled = torch.compile(run, fullgraph=True)
    for i, rows in enumerate([[[100, 900, 900]], [[2048]], [[1, 64, 300, 1500]]]):  # each fits in T once aligned
        doc_start = pack(rows, T, args.sel_block_size, "cuda")[0]
        want = run(doc_start)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(doc_start)
        assert rel_err(got, want) <= 1e-2
