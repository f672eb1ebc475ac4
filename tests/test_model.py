"""The plain model: causality, every parameter in the graph, compile with 0 graph breaks, overfitting, FLOPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_models import get_flavor
from nsa_models.args import NSAArgs
from nsa_models.flops import flops_per_token
from nsa_models.model import Compression, Transformer, compress

TINY_NSA = NSAArgs(cmp_block_size=8, cmp_stride=4, sel_block_size=8, n_selected=3, window_size=8, query_chunk=16)


def build(flavor: str = "debug", dtype=torch.float32, **overrides) -> Transformer:
    args = dataclasses.replace(get_flavor(flavor), **overrides)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.to(dtype)


def test_meta_build_then_init_gives_finite_weights():
    model = build()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in weights)
    assert set(model.layers.keys()) == {"0", "1"}


@pytest.mark.parametrize("flavor,nsa", [("debug", TINY_NSA), ("debug", dataclasses.replace(TINY_NSA, separate_kv=True,
                                                                                            compress="mean")),
                                        ("dense-debug", TINY_NSA)], ids=["nsa", "nsa-separate-kv-mean", "dense"])
def test_causal(flavor, nsa):
    model = build(flavor, torch.float64, nsa=nsa)
    T = 57
    tokens = torch.randint(0, 256, (2, T))
    logits = model(tokens)
    for t in (0, 7, 8, 23, 40):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, 256, (2, T - t - 1))
        other = model(changed)
        torch.testing.assert_close(other[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-10)
        assert not torch.allclose(other[:, t + 1:], logits[:, t + 1:])


def unfolded_phi(compression: Compression, x: Tensor) -> Tensor:
    """The spec's phi, block by block: fc2(silu(fc1(flatten(x[i d : i d + l] + pos_emb)))) [B, Nc, H, D]."""
    l, d = compression.block, compression.stride
    n_blocks = compression.nsa.num_cmp_blocks(x.shape[1])
    blocks = torch.stack([x[:, i * d:i * d + l] for i in range(n_blocks)], 1)  # [B, Nc, l, H, D]
    blocks = blocks.transpose(2, 3) + compression.pos_emb  # [B, Nc, H, l, D]
    return compression.fc2(F.silu(compression.fc1(blocks.flatten(-2))))


@pytest.mark.parametrize("block, stride", [(8, 4), (8, 8), (16, 4)])
@pytest.mark.parametrize("T", [16, 37, 64])
def test_compression_equals_phi_of_each_block(block, stride, T):
    """`Compression` never builds the blocks (fc1 as m = l/d products of chunks of d tokens): it equals phi of each
    unfolded block, with every gradient, in float64; so does `compress` of a layer's keys and values stacked, each
    through its own module."""
    torch.manual_seed(0)
    args = NSAArgs(cmp_block_size=block, cmp_stride=stride, sel_block_size=16, n_selected=2, window_size=16)
    modules = [Compression(args, head_dim=4).double() for _ in range(2)]
    for compression in modules:
        compression.init_weights(0.5)
        torch.nn.init.normal_(compression.fc1.bias)
        torch.nn.init.normal_(compression.fc2.bias)
    x = torch.randn(2, 2, T, 3, 4, dtype=torch.float64, requires_grad=True)
    params = [p for compression in modules for p in compression.parameters()]
    names = [f"{i}.{name}" for i, compression in enumerate(modules) for name, _ in compression.named_parameters()]
    expected = torch.stack([unfolded_phi(compression, xs) for compression, xs in zip(modules, x)])
    assert expected.shape == (2, 2, args.num_cmp_blocks(T), 3, 4)
    weights = torch.randn_like(expected)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [x, *params])
    for out in (compress(tuple(modules), x), torch.stack([c(xs) for c, xs in zip(modules, x)])):
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad((out * weights).sum(), [x, *params])
        for name, grad, expected_grad in zip(["x", *names], grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12, msg=name)


class RecordLinearWeights(torch.overrides.TorchFunctionMode):
    """The weight shapes of the F.linear calls made inside it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.shapes.append(args[1].shape)
        return func(*args, **(kwargs or {}))


def test_query_and_gate_share_one_product():
    """NSA's wq and gate run as one product of stacked weights: each output and gradient equals its own Linear's,
    in float64 (a swapped or misaligned split would mix the gate logits into the queries)."""
    attention = build(dtype=torch.float64, nsa=TINY_NSA).layers["0"].attention
    torch.nn.init.normal_(attention.gate.bias)
    x = torch.randn(2, 5, attention.wq.in_features, dtype=torch.float64)
    with RecordLinearWeights() as weights:
        q, logits = attention._query_and_gate_logits(x)
    # one product, its rows padded to a multiple of 64 (aligned output rows keep cuBLAS on its Hopper kernels)
    assert [rows % 64 for rows, _ in weights.shapes] == [0], weights.shapes
    torch.testing.assert_close(q, attention.wq(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, attention.gate(x), rtol=1e-12, atol=1e-12)
    params = [attention.wq.weight, attention.gate.weight, attention.gate.bias]
    cot = torch.randn_like(q), torch.randn_like(logits)
    got = torch.autograd.grad((q * cot[0]).sum() + (logits * cot[1]).sum(), params)
    want = torch.autograd.grad((attention.wq(x) * cot[0]).sum() + (attention.gate(x) * cot[1]).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [40, 5], ids=["T>=l", "T<l"])
@pytest.mark.parametrize("separate_kv", [False, True])
def test_every_parameter_gets_a_gradient(T, separate_kv):
    model = build(nsa=dataclasses.replace(TINY_NSA, separate_kv=separate_kv))
    tokens = torch.randint(0, 256, (2, T + 1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} dropped out of the graph"
        # With T < l no query sees a compressed block: phi stays in the graph (DDP needs that) but its
        # gradient is exactly zero, since the spec makes o_cmp = 0 there.
        if T < TINY_NSA.cmp_block_size and ".compress_" in name:
            assert p.grad.abs().sum() == 0
        else:
            assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_compiled_block_fullgraph_no_graph_breaks():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = build(nsa=TINY_NSA)
    block = model.layers["0"]
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x = torch.randn(2, 40, model.args.dim, requires_grad=True)
    out, _ = compiled(x, model.rope)
    out.square().mean().backward()
    eager_x = x.detach().clone().requires_grad_()
    eager, _ = block(eager_x, model.rope)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0
    compiled(torch.randn(2, 40, model.args.dim, requires_grad=True), model.rope)  # same shapes: no recompile
    assert counters["stats"]["unique_graphs"] == 1


def test_debug_flavor_overfits_one_batch():
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, 256, (4, 65))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(300):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if loss.item() < 0.1 * losses[0]:
            break
    assert losses[-1] < 0.1 * losses[0], f"loss went {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_flops_per_token():
    nsa, dense = get_flavor("nsa-125m"), get_flavor("dense-125m")
    # Dense attention grows linearly with T; NSA's selected and window branches saturate.
    d2k, d32k = flops_per_token(dense, 2048), flops_per_token(dense, 32768)
    assert d32k.attention["dense"] / d2k.attention["dense"] == pytest.approx(32769 / 2049)  # mean of t+1 is (T+1)/2
    n32k = flops_per_token(nsa, 32768)
    assert n32k.total < 0.5 * d32k.total
    # Window keys at T >> w approach w; selected keys approach n * l' minus the causal half of the last block.
    from nsa_models.flops import mean_keys_per_query

    keys = mean_keys_per_query(nsa, 1 << 20)
    assert keys["win"] == pytest.approx(512, rel=1e-3)
    assert keys["slc"] == pytest.approx(15 * 64 + 32.5, rel=1e-3)
    assert keys["cmp"] == pytest.approx((1 << 20) / 2 / 16, rel=1e-3)
    # Counting by brute force at a small T agrees with the closed forms.
    small = dataclasses.replace(nsa, nsa=NSAArgs(cmp_block_size=4, cmp_stride=2, sel_block_size=4, n_selected=3,
                                                 window_size=5))
    T = 23
    brute_cmp = sum(sum(1 for i in range(T) if i * 2 + 3 <= t) for t in range(T)) / T

    def selected_keys(t: int) -> int:
        forced = {0, t // 4, t // 4 - 1} & set(range(t // 4 + 1))
        chosen = forced | set([j for j in range(t // 4 + 1) if j not in forced][: 3 - len(forced)])
        return sum(1 for u in range(t + 1) if u // 4 in chosen)

    brute_slc = sum(selected_keys(t) for t in range(T)) / T
    got = mean_keys_per_query(small, T)
    assert got["cmp"] == pytest.approx(brute_cmp)
    assert got["win"] == pytest.approx(sum(min(t + 1, 5) for t in range(T)) / T)
    assert got["slc"] == pytest.approx(brute_slc)


def test_window_mask_is_built_once_per_forward_and_shared_by_every_layer(monkeypatch):
    """The FlexAttention window mask is made in Transformer.forward, outside the (possibly checkpointed, compiled)
    blocks, and every layer's attention receives that one object."""
    import nsa_models.model

    built, received = [], []
    sentinel = object()

    def fake_window_mask(seq_len, args, device, doc_start=None):
        built.append((seq_len, args.window_size, device.type))
        return sentinel

    def recording(*args, window_mask=None, **kwargs):
        received.append(window_mask)
        return nsa_models.nsa.nsa_attention(*args, **kwargs)

    monkeypatch.setattr(nsa_models.model, "window_mask", fake_window_mask)
    monkeypatch.setattr(nsa_models.model, "nsa_attention", recording)
    model = build()
    args = model.args
    model(torch.randint(0, args.vocab_size, (2, 40)))
    assert built == [(40, args.nsa.window_size, "cpu")]
    assert len(received) == args.n_layers and all(mask is sentinel for mask in received)
