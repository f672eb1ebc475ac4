"""The reference NSA core against the brute-force float64 oracle: outputs, block indices and every gradient."""

from __future__ import annotations

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_models.nsa import nsa_attention
from tests.nsa_oracle import oracle_nsa

# (l, d, l', n, w): l = l' = d, and the paper's 32/16/64 (n = 16 exceeds the candidates whenever T < 16 * 64).
EQUAL = dict(cmp_block_size=16, cmp_stride=16, sel_block_size=16, n_selected=5, window_size=24)
PAPER = dict(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=100)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def random_inputs(B: int, T: int, H: int, G: int, D: int, args: NSAArgs, dtype=torch.float64):
    n_cmp = args.num_cmp_blocks(T)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, n_cmp, H, D)] * 2
    # Scaled-up queries sharpen the softmaxes so the selection depends on the inputs, not on ties.
    tensors = [torch.randn(s, dtype=dtype) * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    gates = torch.rand(B, T, H * G, 3, dtype=dtype)
    return [t.requires_grad_() for t in tensors + [gates]]


def check_against_oracle(T: int, G: int, hyper: dict, H: int = 2, D: int = 8, B: int = 2, query_chunk: int = 96):
    args = NSAArgs(**hyper, query_chunk=query_chunk)
    inputs = random_inputs(B, T, H, G, D, args)
    out, idx, _ = nsa_attention(*inputs, args)
    want, want_idx = oracle_nsa(*inputs, args)
    assert torch.equal(idx, want_idx), "selected blocks differ from the oracle's"
    assert rel_err(out, want) <= 1e-6
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad((out * cotangent).sum(), inputs)
    want_grads = torch.autograd.grad((want * cotangent).sum(), inputs)
    names = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]
    for name, g, wg in zip(names, grads, want_grads):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, wg) <= 1e-6, f"grad of {name}: rel err {rel_err(g, wg):.2e}"


@pytest.mark.parametrize("hyper", [EQUAL, PAPER], ids=["l=l'=d", "32/16/64"])
@pytest.mark.parametrize("T_spec", ["1", "l-1", "l", "63", "64", "65", "300", "1000"])
def test_matches_oracle_over_lengths(T_spec: str, hyper: dict):
    l = hyper["cmp_block_size"]
    T = {"l-1": l - 1, "l": l}.get(T_spec) or int(T_spec)
    G = {"1": 1, "l-1": 2, "l": 3, "63": 4, "64": 2, "65": 3, "300": 4, "1000": 2}[T_spec]
    check_against_oracle(T, G, hyper, H=1 if T == 1000 else 2, B=1 if T == 1000 else 2)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 16])
def test_matches_oracle_every_group_size(G: int):
    check_against_oracle(150, G, PAPER, H=1 if G == 16 else 2)


def test_window_edge_and_chunk_boundaries():
    # Window exactly T, T one past it, and query chunks that do not divide T nor align with blocks.
    hyper = dict(EQUAL, window_size=48)
    for T, chunk in ((48, 7), (49, 7), (97, 33)):
        check_against_oracle(T, 2, hyper, query_chunk=chunk)


def test_chunking_does_not_change_results():
    args = NSAArgs(**PAPER)
    inputs = random_inputs(1, 257, 2, 2, 8, args)
    out_a, idx_a, _ = nsa_attention(*inputs, NSAArgs(**PAPER, query_chunk=512))
    out_b, idx_b, _ = nsa_attention(*inputs, NSAArgs(**PAPER, query_chunk=40))
    assert torch.equal(idx_a, idx_b)
    assert rel_err(out_b, out_a) <= 1e-12


def test_indices_are_ascending_padded_and_include_forced_blocks():
    args = NSAArgs(**PAPER)
    T = 700
    _, idx, _ = nsa_attention(*random_inputs(1, T, 2, 2, 8, args), args)
    t = torch.arange(T)
    current = t // 64
    for row in range(T):
        chosen = idx[0, :, row]
        valid = chosen[chosen >= 0]
        n_candidates = int(current[row]) + 1
        assert (chosen >= 0).sum(-1).tolist() == [min(16, n_candidates)] * 2
        for h in range(2):
            blocks = chosen[h][chosen[h] >= 0]
            assert torch.all(blocks[1:] > blocks[:-1])  # ascending, no repeats
            assert {0, int(current[row]), max(0, int(current[row]) - 1)} <= set(blocks.tolist())
        assert valid.max() <= current[row]


def test_given_block_indices_are_used():
    args = NSAArgs(**PAPER)
    inputs = random_inputs(1, 200, 2, 2, 8, args)
    out, idx, _ = nsa_attention(*inputs, args)
    again, idx2, _ = nsa_attention(*inputs, args, block_indices=idx)
    assert torch.equal(idx, idx2) and torch.equal(out, again)
    only_forced = idx.clone()
    only_forced[..., 3:] = -1
    changed, *_ = nsa_attention(*inputs, args, block_indices=only_forced)
    assert not torch.allclose(changed, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_float64(dtype):
    args = NSAArgs(**PAPER)
    inputs = random_inputs(1, 300, 2, 3, 16, args)
    want, idx, _ = nsa_attention(*inputs, args)
    low = [x.detach().to(dtype) for x in inputs]
    out, *_ = nsa_attention(*low, args, block_indices=idx)  # same blocks: compare the arithmetic only
    assert out.dtype == dtype
    assert rel_err(out.double(), want) <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_no_nan_when_no_query_sees_a_compressed_block():
    args = NSAArgs(**PAPER)
    inputs = random_inputs(1, 20, 2, 2, 8, args)  # T < l: Nc = 0
    out, *_ = nsa_attention(*inputs, args)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(x.grad).all() for x in inputs)


def test_ties_break_to_the_lower_block_index():
    # Uniform compressed probabilities make every fully covered selection block score the same: the choice
    # must then be the forced blocks plus the lowest-indexed others, whatever the sort implementation does.
    T, n = 1024, 5
    n_cmp = NSAArgs(cmp_block_size=32, cmp_stride=16).num_cmp_blocks(T)
    p_cmp = torch.ones(1, 1, 1, T, n_cmp) / n_cmp
    idx = torch.ops.nsa.select_blocks(p_cmp, 0, T, 32, 16, 64, n)
    t = T - 1  # current block 15: forced {0, 14, 15}, then blocks 1 and 2 (the lowest tied ones)
    assert idx[0, 0, t].tolist() == [0, 1, 2, 14, 15]
    reversed_scores = torch.flip(torch.arange(1, n_cmp + 1, dtype=torch.float32), [0]).expand(1, 1, 1, T, n_cmp)
    assert torch.ops.nsa.select_blocks(reversed_scores, 0, T, 32, 16, 64, n)[0, 0, t].tolist() == [0, 1, 2, 14, 15]
