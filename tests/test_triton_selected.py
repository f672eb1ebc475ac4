"""Triton selected attention and the `triton` backend under the Triton interpreter (CPU), against the reference.

The kernels run in fp32 (the interpreter's bf16 tl.dot is wrong); the oracle is the reference in fp64.
tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU (before triton is first imported); on a GPU
machine tests/test_triton_gpu.py covers the compiled kernels at real shapes instead.
"""

import os

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_models.nsa import triton_selected
from nsa_models.nsa.reference import nsa_reference
from nsa_models.nsa.triton_backend import nsa_triton
from nsa_models.nsa.triton_common import head_rows_operand
from nsa_models.nsa.triton_selected import selected_attention, selected_attention_fwd, work_lists
from nsa_models.nsa.triton_selection import select_topn
from tests.helpers import ungated_compressed

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests; with a GPU, test_triton_gpu.py runs instead")

BS = 16  # l'


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_indices(B: int, H: int, T: int, n: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """[B, H, T, n] block indices; every query keeps block 0 and its two most recent blocks, like the selection.

    forced: only those (-1 padded at the end). random: plus random older blocks, in random order, with the -1
    padding shuffled in. all: every candidate block while n allows, so each block is chosen by many queries.
    """
    idx = torch.full((B, H, T, n), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                cur = t // BS
                chosen = sorted({0, cur, max(cur - 1, 0)})
                if pattern == "all":
                    chosen = list(range(cur + 1))[-n:] if cur + 1 > n else list(range(cur + 1))
                elif pattern == "random":
                    rest = [j for j in torch.randperm(cur + 1, generator=gen).tolist() if j not in chosen]
                    chosen += rest[: torch.randint(0, n - len(chosen) + 1, (1,), generator=gen).item()]
                row = torch.tensor(chosen + [-1] * (n - len(chosen)))
                idx[b, h, t] = row[torch.randperm(n, generator=gen)] if pattern == "random" else row
    return idx


def dense_lse(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp [B, T, HQ] of the selected scores, from a dense [T, T] mask."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    mask = torch.zeros(B, H, T, T, dtype=torch.bool)
    for j in range((T + BS - 1) // BS):
        chosen = (idx == j).any(-1)  # [B, H, T]
        in_block = torch.zeros(T, dtype=torch.bool)
        in_block[j * BS:(j + 1) * BS] = True
        mask |= chosen[..., None] & in_block
    mask &= torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(HQ // H, dim=2)) * D ** -0.5
    scores = scores.masked_fill(~mask.repeat_interleave(HQ // H, dim=1), float("-inf"))
    return scores.logsumexp(-1).transpose(1, 2)


def reference_selected(q, k, v, idx):
    """The reference's selected branch alone: gates (0, 1, 0) and no compressed block."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    gates = torch.zeros(B, T, HQ, 3, dtype=q.dtype)
    gates[..., 1] = 1
    empty = q.new_zeros(B, 0, H, D)
    args = NSAArgs(cmp_block_size=BS, cmp_stride=BS, sel_block_size=BS, n_selected=idx.shape[-1], window_size=1)
    return nsa_reference(q, k, v, k.detach(), v.detach(), empty, empty, gates, args, idx)[0]


# item_queries: (query, slot) pairs per key-block work item; small values split a block's queries over several.
# layout: "key" runs the forward and dQ key-block-major; a number N runs them by query tiles of about N rows (1:
# one query per tile; more: several queries over the union of their blocks, the last tile partly empty).
# dq_terms: with query tiles, dQ from the key-block-major dK/dV kernel's per-pair terms instead of the tiles.
# row_bits: query tiles test a row's block by its bitmask over the tile's union (False: by its list).
@pytest.mark.parametrize("B,T,G,n,pattern,item_queries,layout,dq_terms,row_bits", [
    (1, 10, 1, 3, "forced", 256, 64, False, True),  # T < l'
    (1, 10, 1, 3, "forced", 256, 64, True, True),
    (1, 10, 1, 3, "forced", 256, "key", True, True),
    (2, 37, 2, 3, "random", 7, 1, False, True),     # T not a multiple of l', padding shuffled in
    (2, 37, 2, 3, "random", 7, 12, False, True),
    (2, 37, 2, 3, "random", 7, 12, False, False),
    (2, 37, 2, 3, "random", 7, 12, True, True),
    (2, 37, 2, 3, "random", 7, "key", True, True),
    (1, 80, 3, 4, "random", 256, 64, False, True),
    (1, 80, 3, 4, "random", 256, "key", True, True),
    (1, 64, 4, 4, "all", 5, 1, False, True),        # many queries on every block
    (1, 64, 4, 4, "all", 5, 64, False, True),
    (1, 64, 4, 4, "all", 5, 64, False, False),
    (1, 64, 4, 4, "all", 5, 64, True, True),
    (1, 64, 4, 4, "all", 5, "key", True, True),
])
def test_selected_attention_matches_reference(B: int, T: int, G: int, n: int, pattern: str, item_queries: int,
                                              layout: int | str, dq_terms: bool, row_bits: bool, monkeypatch):
    monkeypatch.setattr(triton_selected, "_ITEM_QUERIES", item_queries)
    monkeypatch.setattr(triton_selected, "_key_major", lambda G, n_blocks, n: layout == "key")
    monkeypatch.setattr(triton_selected, "_dq_by_key_blocks", lambda G, n_blocks, n, D: dq_terms)
    if not row_bits:
        monkeypatch.setattr(triton_selected, "_ROW_BITS_MAX", 0)
    if layout != "key":
        monkeypatch.setattr(triton_selected, "_TILE_ROWS", layout)
    gen = torch.Generator().manual_seed(T * 10 + G)
    H, D = 2, 16
    q = (torch.randn(B, T, H * G, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).requires_grad_()
    idx = make_indices(B, H, T, n, pattern, gen)
    want_o, want_lse = reference_selected(q, k, v, idx), dense_lse(q, k, idx)

    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    o, lse = selected_attention_fwd(q32, k32, v32, idx, *work_lists(q32, k32, idx, BS), BS, D ** -0.5)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(o, want_o) <= 1e-4
    assert rel_err(lse, want_lse) <= 1e-4
    with torch.no_grad():  # no backward to follow: the query-tile forward builds no reverse index
        assert torch.equal(selected_attention(q32, k32, v32, idx, BS, D ** -0.5), o)

    # The loss uses lse too, so its cotangent path (delta - dlse) is checked with the others.
    cot_o, cot_lse = torch.randn_like(want_o), torch.randn_like(want_lse)
    want = torch.autograd.grad((want_o * cot_o).sum() + (want_lse * cot_lse).sum(), (q, k, v))
    got = torch.autograd.grad((o * cot_o.float()).sum() + (lse * cot_lse.float()).sum(), (q32, k32, v32))
    for name, g, w in zip("qkv", got, want):
        assert rel_err(g, w) <= 1e-4, f"d{name}: rel err {rel_err(g, w):.2e}"


@pytest.mark.parametrize("B,H,T,n,block,key_dtype", [(2, 3, 1000, 5, 16, torch.int16),
                                                      (1, 4, 196608, 16, 64, torch.int16),
                                                      (128, 4, 1100, 2, 16, torch.int32)],
                         ids=["small", "nsa-125m-196k", "past-int16-segments"])
def test_reverse_index_lists_each_blocks_choosers_in_query_order(B: int, H: int, T: int, n: int, block: int,
                                                                 key_dtype: torch.dtype):
    """Each key block's work items hold exactly the (query, slot) pairs that chose it, in ascending query order, cut
    into items of at most `_item_queries` pairs. At 196k tokens of nsa-125m, segment * T passes 2^31: the size where
    the former 64-bit sort keys were used; past 32,767 segments the sort keys are 32-bit, up to them 16-bit."""
    gen = torch.Generator().manual_seed(T)
    n_blocks = -(-T // block)
    assert triton_selected._sort_key_dtype(B * H * n_blocks) == key_dtype
    current = torch.arange(T) // block
    # Each query chooses its last n blocks (distinct; -1 before block 0), in a random slot order.
    idx = (current[:, None] - torch.arange(n)).where(current[:, None] >= torch.arange(n), -1).expand(B, H, T, n)
    idx = idx.gather(3, torch.rand(B, H, T, n, generator=gen).argsort(-1))
    items, query_slot, seg_items = triton_selected.reverse_index(idx, block)
    seg, start, end = items
    n_real = int(seg_items[-1])
    assert (start[n_real:] == end[n_real:]).all(), "an item past the real count has entries"
    seg, start, end = seg[:n_real], start[:n_real], end[:n_real]
    size = end - start
    assert (size > 0).all() and (size <= triton_selected._item_queries(idx.numel())).all()
    assert torch.equal(start[1:], end[:-1]) and start[0] == 0, "the items do not tile the entries in order"
    assert int(end[-1]) == int((idx >= 0).sum()), "not every choice is listed once"
    # the items of segment s are seg_items[s] .. seg_items[s + 1] - 1
    assert torch.equal(torch.repeat_interleave(torch.arange(B * H * n_blocks), seg_items.diff()), seg)
    entry_seg = torch.repeat_interleave(seg, size)
    t, slot = query_slot[:int(end[-1])] // n, query_slot[:int(end[-1])] % n
    bh, j = entry_seg // n_blocks, entry_seg % n_blocks
    assert torch.equal(idx.reshape(B * H, T, n)[bh, t, slot], j), "an entry's query did not choose its block"
    same_seg = entry_seg[1:] == entry_seg[:-1]
    assert (t[1:][same_seg] > t[:-1][same_seg]).all(), "a block's queries are not in ascending order"


def test_kernels_refuse_more_sequence_heads_than_the_grid_holds():
    """B x H (sequence, KV head) pairs run in one CUDA grid dimension of at most 65,535: one clear error past it,
    before any kernel launches, in each op that launches such a grid."""
    B, H, D = 32768, 2, 16
    q, k = torch.zeros(B, 1, H, D), torch.zeros(B, 1, H, D)
    with pytest.raises(ValueError, match=r"^selected attention: batch 32768 x 2 KV heads = 65536 exceeds the 65535"):
        selected_attention(q, k, k, torch.zeros(B, H, 1, 3, dtype=torch.int64), BS)
    with pytest.raises(ValueError, match=r"^compressed attention: batch 32768 x 2 KV heads = 65536 exceeds"):
        ungated_compressed(q, k, k, 32, 16, D ** -0.5)
    with pytest.raises(ValueError, match=r"^selection: batch 32768 x 2 KV heads = 65536 exceeds"):
        select_topn(q, k, torch.zeros(B, 1, H), 32, 16, 64, 16, D ** -0.5)


def test_tile_row_bits():
    """Each query's bitmask marks exactly the places of its chosen blocks in its tile's union, up to a union of 64
    places (bit 63 included); a wider union, or a tile of one query, gets no bitmask."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, n, n_blocks, QT = 1, 2, 700, 16, 128, 4
    idx = torch.stack([torch.randperm(n_blocks, generator=gen)[:n] for _ in range(B * H * T)]).view(B, H, T, n)
    idx = idx.masked_fill(torch.rand(B, H, T, n, generator=gen) < 0.2, -1)  # padding among the choices
    idx[:, :, :QT] = torch.randperm(64, generator=gen).view(QT, n)  # the first tile's union: 64 distinct blocks
    blocks, counts, bits = triton_selected._tile_blocks(idx, n_blocks, QT)
    assert bits.shape == (B, H, T) and counts.max() == 64 and bits.min() < 0  # bit 63 is the sign
    for b in range(B):
        for h in range(H):
            for t in range(T):
                union = blocks[b, h, t // QT, :counts[b, h, t // QT]].tolist()
                want = sum(1 << union.index(c) for c in idx[b, h, t].tolist() if c >= 0)
                assert bits[b, h, t].item() & (2 ** 64 - 1) == want, (b, h, t)
    assert triton_selected._tile_blocks(idx, n_blocks, 5)[2].numel() == 0  # a union of 80 places
    assert triton_selected._tile_blocks(idx, n_blocks, 1)[2].numel() == 0


@pytest.mark.parametrize("gates", ["random", "zero_cmp"])
def test_backend_matches_reference(gates: str):
    """Full `triton` backend (window through masked SDPA on CPU): same blocks, output and every gradient, the
    gates' included. zero_cmp: the compressed gate exactly 0 everywhere (its op's gated lse +inf): the branch adds
    nothing to the output and to dq, dk_cmp, dv_cmp, and its gate still gets rowsum(o_cmp dO)."""
    args = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=BS, n_selected=3, window_size=24,
                   window_backend="flex", query_chunk=40)
    B, T, H, G, D = 1, 70, 2, 2, 16
    gen = torch.Generator().manual_seed(0)
    n_cmp = args.num_cmp_blocks(T)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, n_cmp, H, D)] * 2
    inputs = [torch.randn(s, generator=gen) * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    inputs.append(torch.rand(B, T, H * G, 3, generator=gen))
    if gates == "zero_cmp":
        inputs[-1][..., 0] = 0
    inputs = [x.requires_grad_() for x in inputs]
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]

    out, idx, _ = nsa_triton(*inputs, args)
    _, want_idx, _ = nsa_reference(*inputs, args)  # fp32, no near-ties here: the same selection
    assert torch.equal(idx, want_idx)
    want, *_ = nsa_reference(*inputs64, args, want_idx)
    assert rel_err(out, want) <= 1e-4
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * cot.float()).sum(), inputs)
    want_grads = torch.autograd.grad((want * cot).sum(), inputs64)
    names = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]
    for name, g, w in zip(names, grads, want_grads):
        if not w.any():  # k_cmp, v_cmp under a zero gate: exactly no gradient
            assert not g.any(), f"grad of {name} should be 0"
            continue
        assert rel_err(g, w) <= 1e-4, f"grad of {name}: rel err {rel_err(g, w):.2e}"


@pytest.mark.parametrize("block_size", [24, 512])
def test_rejects_bad_block_size(block_size: int):
    q, k = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 1, 16)
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        selected_attention(q, k, k, torch.zeros(1, 1, 8, 2, dtype=torch.int64), block_size, 0.25)


def test_head_rows_operand():
    """TMA descriptors: a misaligned base is copied, an empty tensor gets one zero row, and a head-dim row that is
    not a multiple of 16 bytes is refused with the reason."""
    x = torch.randn(2 * 5 * 2 * 8 + 1)[1:].view(2, 5, 2, 8)  # 4 bytes past a 16-byte boundary
    desc = head_rows_operand(x, 16, True)
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base.view_as(x), x)
    assert desc.shape == [2, 5, 16] and desc.block_shape == [1, 16, 8]
    empty = head_rows_operand(x[:, :0], 16, True)
    assert empty.shape == [2, 1, 16] and not empty.base.any()
    with pytest.raises(ValueError, match="multiple of 16"):
        head_rows_operand(torch.zeros(1, 4, 1, 2), 16, True)
    assert head_rows_operand(x, 16, False) is x


@pytest.mark.parametrize("T, D", [(112, 16), (64, 16), (112, 128), (64, 128)],
                         ids=["key-major-D16", "query-tiles-D16", "key-major-D128", "query-tiles-D128"])
def test_gluon_kernels_are_dispatched_with_the_triton_launch_arguments(T: int, D: int, monkeypatch):
    """kernels = "gluon_hopper" (`model.nsa.selected_kernels`): the key-block-major forward's item launch goes to
    `gluon_selected.gluon_fwd_items` and every backward's dK/dV launch to `gluon_bwd_dkdv_items` (with and without
    the per-pair dQ term), with the arguments the Triton kernels get (the query-tile forward stays Triton's). Here
    (CPU) they are recording stand-ins that launch the Triton kernels with exactly those arguments, so the outputs
    and gradients are the default path's, bit for bit; the Gluon kernels themselves run in
    tests/test_gluon_selected.py (Hopper)."""
    from nsa_models.nsa import gluon_selected  # imports on a CPU machine (it compiles nothing until launched)

    calls = []

    def fwd_items(q, k, v, **launch):
        calls.append("fwd")
        triton_selected._fwd_item_kernel[(launch["ITEM_SEG"].shape[0],)](q, k, v, num_warps=4, **launch)

    def bwd_dkdv_items(q, k, v, do, lse, delta, **launch):
        calls.append("dkdv")
        triton_selected._bwd_dkdv_kernel[(launch["ITEM_SEG"].shape[0],)](q, k, v, do, lse, delta, **launch)

    monkeypatch.setattr(gluon_selected, "gluon_fwd_items", fwd_items)
    monkeypatch.setattr(gluon_selected, "gluon_bwd_dkdv_items", bwd_dkdv_items)
    B, H, G, n = 1, 2, 2, 3
    key_major = triton_selected._key_major(G, -(-T // BS), n)
    assert key_major == (T == 112)  # 7 key blocks > 2n; 4 blocks: query tiles
    want = ["fwd", "dkdv"] if key_major else ["dkdv"]
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H * G, D, generator=gen) * 2
    k, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    idx = make_indices(B, H, T, n, "random", gen)
    cot = torch.randn(B, T, H * G, D, generator=gen)
    results = {}
    for kernels in ("triton", "gluon_hopper"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = selected_attention(*leaves, idx, BS, D ** -0.5, kernels=kernels)
        results[kernels] = [out, *torch.autograd.grad((out * cot).sum(), leaves)]
        assert calls == ([] if kernels == "triton" else want)
    for name, want, got in zip(["out", "dq", "dk", "dv"], results["triton"], results["gluon_hopper"]):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="^selected attention: kernels = 'cuda'; valid: 'triton', 'gluon_hopper'$"):
        selected_attention(q, k, v, idx, BS, kernels="cuda")
