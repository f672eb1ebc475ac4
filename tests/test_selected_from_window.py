"""`model.nsa.selected_from_window`: with shared K/V, the rows whose selected branch attends exactly their window's
keys take the window's output, and the selected kernels skip them.

Oracles: the reference's own selection (which rows' chosen keys equal their window's, whatever the scores) for the
rows the backend picks, and the fp64 reference backend (which computes every row's selected branch) for the
outputs and every gradient, with and without documents, at query offsets and for a shard's two chunks in one call.
CPU: the Triton interpreter at tiny shapes in fp32 (tests/conftest.py).
"""

import dataclasses
import os

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_models.nsa import triton_selected
from nsa_models.nsa.reference import select_blocks
from nsa_models.nsa.triton_backend import nsa_triton, selected_is_window
from tests.helpers import pack, rel_err

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU interpreter tests (the kernels at tiny shapes)")
# n l' = 64 > w = 40: rows past the window's reach but within n blocks stay with the kernels, as do rows past n.
ARGS = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=4, window_size=40, query_chunk=16)
T = 93  # a multiple of no block size


def selected_keys_equal_window(idx: torch.Tensor, positions: torch.Tensor, doc_start: torch.Tensor,
                               args: NSAArgs) -> torch.Tensor:
    """[B, C] bool from chosen block indices [B, 1, C, n]: the row's selected keys (u <= t in its chosen blocks)
    are exactly its window's (max(doc_start, t - w + 1) <= u <= t)."""
    u = torch.arange(int(positions.max()) + 1)
    t, first = positions[..., None], doc_start[..., None]
    in_chosen = ((u // args.sel_block_size)[None, None, :, None] == idx[:, 0, :, None, :]).any(-1) & (u <= t)
    in_window = (u <= t) & (u >= first) & (t - u < args.window_size)
    return (in_chosen == in_window).all(-1)


# documents only at offset 0: the backends refuse documents with an offset
@pytest.mark.parametrize("documents,q_start", [(False, 0), (False, 37), (False, (0, 48)), (True, 0)])
def test_rows_are_those_whose_selection_is_the_window(documents: bool, q_start):
    """The rows `selected_is_window` picks are exactly those whose chosen keys equal their window's under the
    reference's selection, for every one of several random score sets (picked rows: whatever the scores)."""
    B, C = 2, 45
    offsets = (q_start, q_start) if isinstance(q_start, int) else q_start
    positions = torch.arange(C)[None] + torch.tensor(offsets)[:, None]
    if documents:
        doc_start, _ = pack([[20, 10], [8]], C, ARGS.sel_block_size)
    else:
        doc_start = torch.zeros(B, C, dtype=torch.int32)
    picked = selected_is_window(B, C, ARGS, torch.device("cpu"), doc_start if documents else None, q_start)
    assert picked.any() and not picked.all()
    seq_len = int(positions.max()) + 1
    always = torch.ones(B, C, dtype=torch.bool)
    for seed in range(4):
        p_cmp = torch.rand(B, 1, 1, C, ARGS.num_cmp_blocks(seq_len), generator=torch.Generator().manual_seed(seed))
        idx = torch.cat([select_blocks(p_cmp[b:b + 1], offsets[b], seq_len, ARGS.cmp_block_size, ARGS.cmp_stride,
                                       ARGS.sel_block_size, ARGS.n_selected,
                                       doc_start[b:b + 1] if documents else None) for b in range(B)])
        always &= selected_keys_equal_window(idx, positions, doc_start, ARGS)
    assert torch.equal(picked, always)


def shared_kv_inputs(B: int, T: int, H: int, G: int, D: int, seed: int) -> list[torch.Tensor]:
    """q, k, v, k_cmp, v_cmp, gates (fp32 leaves) for a backend whose selected and window branches share k, v."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, H * G, D), (B, T, H, D), (B, T, H, D)] + [(B, ARGS.num_cmp_blocks(T), H, D)] * 2
    leaves = [torch.randn(s, generator=gen) * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    return [x.requires_grad_() for x in leaves + [torch.rand(B, T, H * G, 3, generator=gen)]]


def run(backend, leaves: list[torch.Tensor], args: NSAArgs, cot: torch.Tensor, doc_start=None, q_start=0,
        block_indices=None):
    """Output, block indices and every leaf's gradient; k and v are given to both branches as the same tensors."""
    q, k, v, k_cmp, v_cmp, gates = leaves
    out, idx, _ = backend(q, k, v, k, v, k_cmp, v_cmp, gates, args, block_indices, doc_start=doc_start,
                          q_start=q_start)
    return out, idx, torch.autograd.grad((out * cot.to(out.dtype)).sum(), leaves)


@interpreter
@pytest.mark.parametrize("case", ["whole", "documents", "offset", "two-chunks"])
@pytest.mark.parametrize("G,layout", [(1, "key-block-major"), (3, "query-tiles")])
def test_backend_with_shortcut_matches_reference(case: str, G: int, layout: str, monkeypatch):
    """nsa_triton with the shortcut against the fp64 reference (given the same blocks) and against itself without
    the shortcut: outputs and the gradients of q, the shared k and v, the compressed keys and the gates."""
    from nsa_models.nsa.reference import nsa_reference

    monkeypatch.setattr(triton_selected, "_key_major", lambda G, n_blocks, n: layout == "key-block-major")
    B, D, H = 2, 16, 2
    C = 45 if case in ("offset", "two-chunks") else T
    q_start = {"offset": 37, "two-chunks": (0, 48)}.get(case, 0)
    doc_start = pack([[20, 40, 10], [70, 10]], T, ARGS.sel_block_size)[0] if case == "documents" else None
    leaves = shared_kv_inputs(B, T, H, G, D, seed=G)
    if C < T:  # queries (and gates) of C rows at the offset; keys of the whole T
        leaves = [x.detach()[:, :C].clone().requires_grad_() if i in (0, 5) else x for i, x in enumerate(leaves)]
    cot = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out, idx, grads = run(nsa_triton, leaves, ARGS, cot, doc_start, q_start)
    assert selected_is_window(B, C, ARGS, torch.device("cpu"), doc_start, q_start).any()
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    want, _, want_grads = run(nsa_reference, leaves64, ARGS, cot, doc_start, q_start, idx)
    assert rel_err(out, want) <= 1e-5
    for name, g, w in zip(["q", "k", "v", "k_cmp", "v_cmp", "gates"], grads, want_grads):
        assert rel_err(g, w, floor_rms=1e-3) <= 1e-5, f"d{name}: {rel_err(g, w):.2e}"
    off, _, off_grads = run(nsa_triton, leaves, dataclasses.replace(ARGS, selected_from_window=False), cot,
                            doc_start, q_start)
    assert rel_err(out, off) <= 1e-5
    assert all(rel_err(g, w) <= 1e-5 for g, w in zip(grads, off_grads))


@pytest.mark.gpu
@pytest.mark.parametrize("window_backend", ["flex", "sdpa"])
def test_shortcut_on_gpu_matches_reference(window_backend: str):
    """nsa-125m's heads (G = 3, D = 64, 4 KV heads, its n, l' and w) in bf16 at 4160 tokens of documents shorter
    than the window, longer than n blocks and in between: against the fp32 reference with the same blocks, errors
    within 2x the reference's own bf16 error (or 1e-2), outputs and every gradient."""
    from nsa_models.nsa.reference import nsa_reference

    args = NSAArgs(backend="triton", window_backend=window_backend)
    B, T, H, G, D = 2, 4160, 4, 3, 64
    doc_start = pack([[40, 700, 1501, 1000, 777], [4113]], T, args.sel_block_size, "cuda")[0]
    gen = torch.Generator("cuda").manual_seed(0)
    shapes = [(B, T, H * G, D), (B, T, H, D), (B, T, H, D)] + [(B, args.num_cmp_blocks(T), H, D)] * 2
    leaves = [torch.randn(s, generator=gen, device="cuda") * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    leaves.append(torch.rand(B, T, H * G, 3, generator=gen, device="cuda"))
    leaves = [x.bfloat16().requires_grad_() for x in leaves]
    picked = selected_is_window(B, T, args, torch.device("cuda"), doc_start)
    assert 0.2 < picked.float().mean() < 0.8
    cot = torch.randn(leaves[0].shape, generator=gen, device="cuda")
    out, idx, grads = run(nsa_triton, leaves, args, cot, doc_start)
    leaves32 = [x.detach().float().requires_grad_() for x in leaves]
    want, _, want_grads = run(nsa_reference, leaves32, args, cot, doc_start, block_indices=idx)
    ref_lo, _, ref_lo_grads = run(nsa_reference, leaves, args, cot, doc_start, block_indices=idx)
    for name, g, lo, w in zip(["out", "q", "k", "v", "k_cmp", "v_cmp", "gates"], [out, *grads],
                              [ref_lo, *ref_lo_grads], [want, *want_grads]):
        assert torch.isfinite(g).all(), name
        bound = max(1e-2, 2 * rel_err(lo, w, floor_rms=1e-3))
        assert rel_err(g, w, floor_rms=1e-3) <= bound, f"{name}: {rel_err(g, w):.2e} (bound {bound:.2e})"
