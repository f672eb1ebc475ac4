"""bench/attention.py's arithmetic on CPU: the CUDA occupancy calculator's counts for an H100 / H200 SM, the
documents its masking rows time, that its --fused rows time the same outputs, and the dense causal baseline its
--selected table sets beside ours (GQA heads repeated, its model FLOPs)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention import SDPBackend

from bench.attention import (
    NSA,
    _fused_branches,
    _separate_branches,
    dense_causal,
    equal_documents,
    nsa_tflops,
    programs_per_sm,
    random_block_indices,
)

HOPPER_SM = {"threads": 2048, "registers": 65536, "shared": 233472}


@pytest.mark.parametrize("warps, registers, shared_kib, expected", [
    (2, 168, 38, (5, "shared memory")),  # 40 KiB with the reserve: 5 fit in 228 KiB; registers would allow 6
    (4, 128, 36, (4, "registers")),  # 16K registers per program
    (2, 204, 0, (4, "registers")),  # 204 x 32 = 6528 rounds up to 6656 per warp: 4 programs, not 5
    (8, 24, 0, (8, "threads")),
    (1, 16, 0, (32, "programs")),  # threads alone would allow 64
])
def test_programs_per_sm_counts_the_limiting_resource(warps, registers, shared_kib, expected):
    assert programs_per_sm(warps, registers, shared_kib * 1024, HOPPER_SM) == expected


@pytest.mark.parametrize("T, n_docs, expected", [(8192, 16, 16), (8192, 1, 1), (1000, 4, 4), (256, 16, 4)])
def test_equal_documents_start_on_selection_blocks(T, n_docs, expected):
    """n_docs documents per row (as many as fit when a document must hold a selection block), each starting on a
    block, as the data pipeline aligns them; every row the same."""
    doc_start = equal_documents(2, T, n_docs, "cpu")
    t = torch.arange(T)
    assert doc_start.shape == (2, T) and doc_start.dtype == torch.int32 and torch.equal(doc_start[0], doc_start[1])
    assert (doc_start[0] <= t).all() and (doc_start[0] % NSA.sel_block_size == 0).all()
    assert (doc_start[0].diff() >= 0).all() and doc_start[0].unique().numel() == expected
    starts = doc_start[0].unique()
    assert torch.equal(doc_start[0][starts.long()], starts)  # each document begins at its own start


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need the interpreter")
def test_fused_rows_time_the_same_outputs():
    """--fused compares like with like: the separate branches and the fused sweep it times sum to the same output
    (T = 300: 5 selection blocks, the window of 512 covers every prefix)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 300, 2, 16, generator=gen)
    k, v = (torch.randn(1, 300, 1, 16, generator=gen) for _ in range(2))
    idx = random_block_indices(1, 1, 300, NSA.n_selected, NSA.sel_block_size, "cpu")
    torch.testing.assert_close(_fused_branches(q, k, v, idx), _separate_branches(q, k, v, idx, None),
                               rtol=1e-4, atol=1e-5)


def test_dense_causal_baseline_attends_each_query_heads_kv_group():
    """The dense baseline ([B, T, heads, D] in, K/V repeated to the G query heads of their group) against a masked
    softmax per query head; its rate counts 3 x 4 D FLOPs per causal (query head, key) pair."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, G, D = 2, 9, 2, 3, 8
    q = torch.randn(B, T, H * G, D, generator=gen)
    k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    fn, leaves = dense_causal(q, k, v, SDPBackend.MATH)
    got = fn()
    scores = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(G, dim=2)) * D ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = torch.einsum("bhts,bshd->bhtd", scores.masked_fill(~causal, float("-inf")).softmax(-1),
                        v.repeat_interleave(G, dim=2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert all(x.grad is not None for x in leaves)
    pairs = B * H * G * T * (T + 1) / 2
    assert nsa_tflops(B, T, H * G, H, D, 1.0, ("dense",)) == f"{3 * 4 * D * pairs / 1e9:.0f}"
