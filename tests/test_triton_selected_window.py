"""The fused selected + window kernels (`window_backend = "fused_with_selected"`) under the Triton interpreter (CPU),
against the reference backend's selected and window branches in fp64 (fp32 kernels: the interpreter's bf16 tl.dot
is wrong). tests/test_triton_gpu.py runs them compiled, in bf16 too, at real shapes."""

import os

import pytest
import torch

from nsa_models.args import MAX_FUSED_BLOCKS, ModelArgs, NSAArgs
from nsa_models.nsa import triton_common
from nsa_models.nsa import triton_selected_window as sw
from nsa_models.nsa.reference import nsa_reference
from nsa_models.nsa.triton_backend import nsa_triton
from nsa_models.nsa.triton_selected_window import chosen_bits, selected_window_attention
from tests.helpers import rel_err

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests; with a GPU, test_triton_gpu.py runs instead")

BS = 16  # l'


def document_starts(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] int32: each row cut into documents at random multiples of l'."""
    doc = torch.zeros(B, T, dtype=torch.int32)
    for b in range(B):
        cuts = sorted({c * BS for c in torch.randint(1, max(2, T // BS), (3,), generator=gen).tolist()})
        for c in cuts:
            doc[b, c:] = c
    return doc


def random_indices(B: int, H: int, T: int, n: int, doc: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[B, H, T, n] as the selection gives them: the document's first block and the two most recent forced, random
    others from the query's document, -1 padding, in random order."""
    idx = torch.full((B, H, T, n), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                first, cur = int(doc[b, t]) // BS, t // BS
                chosen = sorted({first, cur, max(cur - 1, first)})
                rest = [first + j for j in torch.randperm(cur - first + 1, generator=gen).tolist()
                        if first + j not in chosen]
                chosen += rest[:n - len(chosen)]
                row = torch.tensor(chosen + [-1] * (n - len(chosen)))
                idx[b, h, t] = row[torch.randperm(n, generator=gen)]
    return idx


def reference_gated(q, k, v, gates, idx, window, doc):
    """The reference's g_slc o_slc + g_win o_win (gates [B, T, HQ, 2]): no compressed block, its gate 0."""
    B, T, HQ, D = q.shape
    empty = q.new_zeros(B, 0, k.shape[2], D)
    args = NSAArgs(cmp_block_size=BS, cmp_stride=BS, sel_block_size=BS, n_selected=idx.shape[-1], window_size=window)
    gates = torch.cat([torch.zeros_like(gates[..., :1]), gates], -1)
    return nsa_reference(q, k, v, k, v, empty, empty, gates, args, idx, doc_start=doc)[0]


def random_inputs(B: int, T: int, H: int, G: int, D: int, gen: torch.Generator) -> list[torch.Tensor]:
    """fp64 q, k, v and gates [B, T, HQ, 2] in (0, 1), requiring grad."""
    q = torch.randn(B, T, H * G, D, generator=gen, dtype=torch.float64) * 2
    k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    gates = torch.rand(B, T, H * G, 2, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, gates)]


def assert_matches_reference(inputs: list[torch.Tensor], idx, window, doc, gen, bound: float = 1e-5) -> None:
    """The fused op in fp32 against the reference in fp64 on the same inputs: the output and the gradients of q,
    k, v and the gates for a random cotangent."""
    want = reference_gated(*inputs, idx, window, doc)
    leaves = [x.detach().float().requires_grad_() for x in inputs]
    q, k, v, gates = leaves
    got = selected_window_attention(q, k, v, gates, idx, BS, window, doc_start=doc)
    assert rel_err(got, want) <= bound, f"o: rel err {rel_err(got, want):.2e}"
    cot = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * cot.float()).sum(), leaves)
    want_grads = torch.autograd.grad((want * cot).sum(), inputs)
    for name, g, w in zip(["q", "k", "v", "gates"], grads, want_grads):
        assert rel_err(g, w) <= bound, f"d{name}: rel err {rel_err(g, w):.2e}"


# keys: keys a step (64: four selection blocks of the tests' l' = 16; 16: one).
@pytest.mark.parametrize("B,T,G,D,n,window,documents,keys", [
    (1, 10, 1, 16, 3, 4, False, 64),     # T < l': one partial block
    (2, 37, 2, 16, 3, 20, False, 16),    # T not a multiple of l'
    (1, 70, 3, 16, 4, 24, True, 64),     # 21 queries a tile: a tile straddles blocks; documents
    (1, 70, 3, 16, 4, 24, True, 16),
    (1, 80, 4, 16, 6, 40, False, 64),
    (1, 50, 16, 16, 3, 16, True, 16),    # 4 queries a tile
    (1, 45, 1, 64, 3, 33, False, 64),    # D = 64; 64 queries a tile
    (1, 48, 3, 64, 4, 24, True, 64),
    (2, 150, 2, 16, 4, 40, True, 16),   # two rows of documents: the walks start and stop at each row's own
])
def test_selected_window_matches_reference(B, T, G, D, n, window, documents, keys, monkeypatch):
    for launch in (sw.FWD_LAUNCH, sw.DQ_LAUNCH, sw.DKDV_LAUNCH):
        monkeypatch.setitem(launch, "keys", keys)
    gen = torch.Generator().manual_seed(T * 10 + G)
    H = 2
    inputs = random_inputs(B, T, H, G, D, gen)
    doc = document_starts(B, T, gen) if documents else None
    idx = random_indices(B, H, T, n, doc if documents else torch.zeros(B, T, dtype=torch.int32), gen)
    assert_matches_reference(inputs, idx, window, doc, gen)


@pytest.mark.parametrize("zero", [0, 1], ids=["selected gate 0", "window gate 0"])
def test_a_zero_gate_adds_nothing(zero: int):
    """A branch whose gate is 0 (everywhere) must add nothing to the output, dQ, dK and dV, and still receive its
    gate's gradient."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, G, D, window = 1, 40, 1, 2, 16, 12
    inputs = random_inputs(B, T, H, G, D, gen)
    with torch.no_grad():
        inputs[3][..., zero] = 0
    idx = random_indices(B, H, T, 3, torch.zeros(B, T, dtype=torch.int32), gen)
    assert_matches_reference(inputs, idx, window, None, gen, bound=1e-4)


def test_chosen_bits_mark_exactly_the_chosen_blocks():
    """Bit j is set iff block j is among the query's blocks (bit 63, the sign, included; -1 padding sets none)."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, n = 1, 2, 64, 9
    idx = torch.stack([torch.randperm(T, generator=gen)[:n] for _ in range(B * H * T)]).view(B, H, T, n)
    idx[0, 0, 0, :3] = torch.tensor([0, 62, 63])
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.3, -1)
    bits = chosen_bits(idx)
    assert bits.shape == (B, H, T) and bits.min() < 0
    for b, h, t in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(T)).tolist():
        want = {j for j in idx[b, h, t].tolist() if j >= 0}
        assert {i for i in range(64) if (bits[b, h, t].item() >> i) & 1} == want, (b, h, t)


def test_backend_matches_reference():
    """The whole `triton` backend with the fused window, against the reference: output and every gradient (the
    gates' included), with documents."""
    args = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=BS, n_selected=3, window_size=24,
                   window_backend="fused_with_selected", query_chunk=40)
    B, T, H, G, D = 1, 80, 2, 2, 16
    gen = torch.Generator().manual_seed(0)
    doc = torch.where(torch.arange(T) < 48, 0, 48).to(torch.int32).view(B, T)  # two documents with compressed blocks
    kv = [torch.randn(B, T, H, D, generator=gen) for _ in range(2)]
    cmp = [torch.randn(B, args.num_cmp_blocks(T), H, D, generator=gen) for _ in range(2)]
    q = torch.randn(B, T, H * G, D, generator=gen) * 3.0
    gates = torch.rand(B, T, H * G, 3, generator=gen)
    inputs = [x.requires_grad_() for x in (q, *kv, *cmp, gates)]
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]

    def call(backend, xs, idx=None):
        q, k, v, kc, vc, g = xs
        return backend(q, k, v, k, v, kc, vc, g, args, idx, doc_start=doc)

    out, idx, _ = call(nsa_triton, inputs)
    _, want_idx, _ = call(nsa_reference, inputs)
    assert torch.equal(idx, want_idx)
    want, *_ = call(nsa_reference, inputs64, want_idx)
    assert rel_err(out, want) <= 1e-4
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * cot.float()).sum(), inputs)
    want_grads = torch.autograd.grad((want * cot).sum(), inputs64)
    for name, g, w in zip(["q", "k", "v", "k_cmp", "v_cmp", "gates"], grads, want_grads):
        assert rel_err(g, w) <= 1e-4, f"grad of {name}: rel err {rel_err(g, w):.2e}"


def test_refusals():
    """Separate window K/V, or more selection blocks than the sweep takes: one line naming the key and the fix."""
    args = NSAArgs(sel_block_size=BS, window_backend="fused_with_selected")
    x, k = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 1, 16)
    with pytest.raises(ValueError, match="separate_kv = false"):
        nsa_triton(x, k, k, k.clone(), k, k[:, :0], k[:, :0], torch.zeros(1, 8, 2, 3), args)
    T = MAX_FUSED_BLOCKS * BS + 1
    with pytest.raises(ValueError, match="window_backend to 'flex'"):
        selected_window_attention(torch.zeros(1, T, 1, 16), torch.zeros(1, T, 1, 16), torch.zeros(1, T, 1, 16),
                                  torch.zeros(1, T, 1, 2), torch.zeros(1, 1, T, 3, dtype=torch.int64), BS, 8)
    with pytest.raises(ValueError, match=r"gates must be \[B, T, HQ, 2\]"):
        selected_window_attention(x, k, k, torch.zeros(1, 8, 2, 3), torch.zeros(1, 1, 8, 3, dtype=torch.int64), BS, 8)
    for nsa, key in [(NSAArgs(backend="triton", window_backend="fused_with_selected", separate_kv=True),
                      "separate_kv = false"),
                     (NSAArgs(backend="triton", window_backend="fused_with_selected"), "lower model.max_seq_len")]:
        with pytest.raises(ValueError, match=key):
            ModelArgs(attention="nsa", nsa=nsa, max_seq_len=64 * MAX_FUSED_BLOCKS + 1).validate()
    ModelArgs(attention="nsa", nsa=NSAArgs(backend="triton", window_backend="fused_with_selected"),
              max_seq_len=64 * MAX_FUSED_BLOCKS).validate()


def no_choice(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bits of no chosen block for every query (the window-only launches' stand-in for bits None)."""
    return torch.zeros(q.shape[0], k.shape[2], q.shape[1], dtype=torch.int64)


def triton_as_gluon_bwd(name: str, triton_launch, calls: list):
    """A stand-in for a Gluon backward launch (CPU): recorded, then run as the Triton launch on the same arguments
    and the block size; bits None (the window alone) as no block chosen and the selected branch's gate 0 (its gated
    lse +inf)."""
    def launch(q, k, v, bits, doc_start, window, scale, do, lse_slc, lse_win, delta_slc, delta_win, **outs):
        window_only = bits is None
        calls.append((name, q.shape, None if window_only else bits.shape, doc_start is not None, window, scale,
                      sorted(outs), window_only and lse_slc is None and delta_slc is None))
        if window_only:
            bits, lse_slc, delta_slc = no_choice(q, k), torch.full_like(lse_win, float("inf")), delta_win
        triton_launch(q, k, v, bits, doc_start, BS, window, scale, do=do, lse_slc=lse_slc, lse_win=lse_win,
                      delta_slc=delta_slc, delta_win=delta_win, **outs)
    return launch


@pytest.mark.parametrize("documents", [False, True])
def test_gluon_kernels_are_dispatched_with_the_triton_launch_arguments(documents: bool, monkeypatch):
    """kernels = "gluon_hopper" (`model.nsa.selected_kernels`): the fused forward, dQ and dK/dV are
    `gluon_selected_window.gluon_fwd`'s, `gluon_bwd_dq`'s and `gluon_bwd_dkdv`'s, each given what the Triton launch
    gets but the block size (the Gluon kernels' is 64) and writing the same outputs. Here (CPU) a Gluon launch is a
    recording stand-in that runs the Triton one on those arguments, so the output and gradients are the default
    path's, bit for bit; the Gluon kernels themselves run in tests/test_gluon_selected_window.py (Hopper)."""
    from nsa_models.nsa import gluon_selected_window  # imports on a CPU machine (it compiles nothing until launched)

    calls = []

    def fwd(q, k, v, bits, doc_start, window, scale, o_slc, o_win, lse_slc, lse_win):
        calls.append(("fwd", q.shape, bits.shape, doc_start is not None, window, scale))
        sw.triton_fwd(q, k, v, bits, doc_start, BS, window, scale, o_slc=o_slc, o_win=o_win, lse_slc=lse_slc,
                      lse_win=lse_win)

    monkeypatch.setattr(gluon_selected_window, "gluon_fwd", fwd)
    monkeypatch.setattr(gluon_selected_window, "gluon_bwd_dq", triton_as_gluon_bwd("dq", sw.triton_bwd_dq, calls))
    monkeypatch.setattr(gluon_selected_window, "gluon_bwd_dkdv",
                        triton_as_gluon_bwd("dkdv", sw.triton_bwd_dkdv, calls))
    B, T, H, G, D, n, window = 1, 70, 2, 3, 16, 4, 24
    gen = torch.Generator().manual_seed(3)
    doc = document_starts(B, T, gen) if documents else None
    inputs = [x.detach().float() for x in random_inputs(B, T, H, G, D, gen)]
    idx = random_indices(B, H, T, n, doc if documents else torch.zeros(B, T, dtype=torch.int32), gen)
    cot = torch.randn(B, T, H * G, D, generator=gen)
    results = {}
    for kernels in ("triton", "gluon_hopper"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = selected_window_attention(*leaves, idx, BS, window, D ** -0.5, doc, kernels)
        results[kernels] = [out, *torch.autograd.grad((out * cot).sum(), leaves)]
    shapes = (inputs[0].shape, (B, H, T), documents, window, D ** -0.5)
    assert calls == [("fwd", *shapes), ("dq", *shapes, ["dq"], False), ("dkdv", *shapes, ["dk", "dv"], False)]
    for name, want, got in zip(["o", "dq", "dk", "dv", "dgates"], results["triton"], results["gluon_hopper"]):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("documents", [False, True])
def test_window_sweep_op_matches_the_sdpa_window(documents: bool, monkeypatch):
    """window_backend = "gluon_hopper" (`window_attention` -> `window_sweep_attention`): the op's forward,
    autograd and launches, with the Gluon kernels (Hopper only) replaced by stand-ins that run the Triton sweep on
    the same arguments with no block chosen and the selected branch's gate 0 (so only the window's terms remain),
    against the masked-SDPA window. The Gluon kernels themselves: tests/test_gluon_selected_window.py."""
    from nsa_models.nsa import gluon_selected_window
    from nsa_models.nsa.triton_backend import window_attention

    calls = []

    def fwd(q, k, v, bits, doc_start, window, scale, o_slc, o_win, lse_slc, lse_win):
        calls.append(("fwd", bits is None and o_slc is None and lse_slc is None))
        sw.triton_fwd(q, k, v, no_choice(q, k), doc_start, BS, window, scale, o_slc=torch.empty_like(o_win),
                      o_win=o_win, lse_slc=torch.empty_like(lse_win), lse_win=lse_win)

    monkeypatch.setattr(gluon_selected_window, "gluon_fwd", fwd)
    monkeypatch.setattr(gluon_selected_window, "gluon_bwd_dq", triton_as_gluon_bwd("dq", sw.triton_bwd_dq, calls))
    monkeypatch.setattr(gluon_selected_window, "gluon_bwd_dkdv",
                        triton_as_gluon_bwd("dkdv", sw.triton_bwd_dkdv, calls))
    B, T, H, G, D, window = 2, 70, 2, 3, 16, 24
    gen = torch.Generator().manual_seed(5)
    doc = document_starts(B, T, gen) if documents else None
    q = torch.randn(B, T, H * G, D, generator=gen)
    k, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    cot = torch.randn(B, T, H * G, D, generator=gen)
    results = {}
    for backend in ("sdpa", "gluon_hopper"):
        args = NSAArgs(backend="triton", window_backend=backend, window_size=window, sel_block_size=BS)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = window_attention(*leaves, args, doc_start=doc)
        results[backend] = [out, *torch.autograd.grad((out * cot).sum(), leaves)]
    assert [c[0] for c in calls] == ["fwd", "dq", "dkdv"]
    assert all(c[-1] for c in calls), "the window-only launches get no selected-branch tensors"
    for name, want, got in zip(["out", "dq", "dk", "dv"], results["sdpa"], results["gluon_hopper"]):
        assert rel_err(got, want) < 1e-5, name


def test_document_query_ends_counts_the_queries_of_each_steps_documents():
    """`document_query_ends` against a count: for each step of keys, the queries whose document starts at or before
    the step's last key (T not a multiple of the step)."""
    gen = torch.Generator().manual_seed(5)
    B, T, step = 3, 150, 32
    doc = document_starts(B, T, gen)
    got = triton_common.document_query_ends(doc, step)
    last_keys = [min(s + step - 1, T - 1) for s in range(0, T, step)]
    want = torch.tensor([[int((doc[b] <= key).sum()) for key in last_keys] for b in range(B)], dtype=torch.int32)
    assert torch.equal(got, want)
