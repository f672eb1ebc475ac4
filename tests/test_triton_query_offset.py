"""The `triton` backend with queries at an offset (`q_start`: context parallelism's chunks of a shard) against the
reference with the same offset, and against the whole sequence's run sliced to those rows.

CPU tests run the kernels in the Triton interpreter (fp32; tests/conftest.py sets it up) at tiny shapes, with small
tiles so that the loops cross tile and chunk boundaries; the GPU test runs nsa-125m's heads at 8k in bf16.
"""

import os

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_models.nsa import triton_compressed, triton_selected, triton_selection
from nsa_models.nsa.core import nsa_attention
from nsa_models.nsa.reference import nsa_reference
from nsa_models.nsa.triton_backend import check_query_offset, nsa_triton
from tests.helpers import assert_valid_selection, reference_scores, rel_err

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU interpreter tests; with a GPU, the gpu test below runs instead")
NAMES = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]
QUERY_ROWS = (0, 7)  # the names whose tensors hold one row per query (q, gates); the others span the keys


def make_inputs(B: int, T: int, H: int, G: int, D: int, args: NSAArgs, dtype: torch.dtype,
                device: str = "cpu") -> list[torch.Tensor]:
    """The 8 backend inputs for T tokens (separate selected and window K/V, so that each gets its own gradient)."""
    gen = torch.Generator(device).manual_seed(T * 31 + G * 7 + D)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, args.num_cmp_blocks(T), H, D)] * 2
    leaves = [torch.randn(s, generator=gen, device=device) * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    leaves.append(torch.rand(B, T, H * G, 3, generator=gen, device=device))
    return [x.to(dtype).requires_grad_() for x in leaves]


def rows(inputs: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """The inputs of queries start .. end-1: their rows of q and gates, every key."""
    return [x[:, start:end] if i in QUERY_ROWS else x for i, x in enumerate(inputs)]


def run(backend, inputs: list[torch.Tensor], start: int, end: int, args: NSAArgs, cot: torch.Tensor,
        block_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output, block indices and the gradients of every input of queries start .. end-1 (loss: out . cot)."""
    out, idx, _ = backend(*rows(inputs, start, end), args, block_indices, q_start=start)
    return out, idx, list(torch.autograd.grad((out * cot[:, start:end].to(out.dtype)).sum(), inputs))


def one_call(backend, inputs: list[torch.Tensor], starts: tuple[int, int], C: int, args: NSAArgs, cot: torch.Tensor,
             block_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output, block indices and the inputs' gradients of both chunks (C queries from each of `starts`) of every
    sequence in one call, as context parallelism's shard runs them: row 2b + c holds chunk c of sequence b, with
    sequence b's keys repeated for both rows, and q_start the pair of starts."""
    def pair_rows(x: torch.Tensor, i: int) -> torch.Tensor:
        if i in QUERY_ROWS:
            return torch.stack([x[:, start:start + C] for start in starts], 1).flatten(0, 1)
        return x.repeat_interleave(2, dim=0)

    out, idx, _ = backend(*(pair_rows(x, i) for i, x in enumerate(inputs)), args, block_indices, q_start=starts)
    return out, idx, list(torch.autograd.grad((out * pair_rows(cot, 0).to(out.dtype)).sum(), inputs))


# Chunks: q_start at 0 (queries shorter than the keys), at a selection-block boundary mid-sequence, and at a
# position on no block boundary; T is a multiple of no block size.
T_CPU, CHUNKS = 93, ((0, 32), (32, 57), (57, 93))
ARGS = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=4, window_size=24, query_chunk=16)


def small_tiles(monkeypatch, layout: str) -> None:
    """Tiles of 16 keys and queries, so that the selection and dK/dV loops cross several tiles and query chunks at
    T_CPU; the selected branch key-block-major or by query tiles with their own dQ kernel (`layout`)."""
    monkeypatch.setattr(triton_selection, "_KEYS", 16)
    monkeypatch.setattr(triton_compressed, "_KEYS", 16)
    monkeypatch.setattr(triton_compressed, "_KEYS_BWD", 16)
    monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MIN", 16)
    monkeypatch.setattr(triton_compressed, "_BWD_CHUNK_MAX", 16)
    monkeypatch.setattr(triton_selected, "_key_major", lambda G, n_blocks, n: layout == "key-block-major")
    monkeypatch.setattr(triton_selected, "_dq_by_key_blocks", lambda G, n_blocks, n, D: False)


@interpreter
@pytest.mark.parametrize("G,D,layout", [(1, 16, "key-block-major"), (3, 16, "query-tiles")])
def test_query_offset_matches_reference_and_whole_sequence(G: int, D: int, layout: str, monkeypatch):
    """Each chunk against the fp64 reference at the same offset (output, chosen blocks, every gradient), and the
    chunks together against the whole sequence's run: the same rows, the same blocks, and gradients that sum to
    the whole run's. Small tiles: the selection and dK/dV loops cross several tiles and query chunks. The selected
    branch runs key-block-major (G = 1) or by query tiles with their own dQ kernel (G = 3)."""
    small_tiles(monkeypatch, layout)
    inputs = make_inputs(1, T_CPU, 2, G, D, ARGS, torch.float32)
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    cot = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole, whole_idx, whole_grads = run(nsa_triton, inputs, 0, T_CPU, ARGS, cot)
    summed = [torch.zeros_like(x) for x in inputs]
    for start, end in CHUNKS:
        out, idx, grads = run(nsa_triton, inputs, start, end, ARGS, cot)
        assert_valid_selection(idx, reference_scores(inputs[0][:, start:end], inputs[5], ARGS, start, T_CPU),
                               ARGS.n_selected, tol=1e-5)
        want, _, want_grads = run(nsa_reference, inputs64, start, end, ARGS, cot, idx)
        assert rel_err(out, want) <= 1e-5
        for name, g, w in zip(NAMES, grads, want_grads):
            assert rel_err(g, w, floor_rms=1e-3) <= 1e-5, f"d{name} at q_start = {start}: {rel_err(g, w):.2e}"
        # The whole run's rows: the same blocks (per-row scores do not depend on the query tiling), outputs and
        # gradients up to the order of the sums.
        assert torch.equal(idx, whole_idx[:, :, start:end])
        assert rel_err(out, whole[:, start:end]) <= 1e-6
        summed = [s + g for s, g in zip(summed, grads)]
    for name, g, w in zip(NAMES, summed, whole_grads):
        assert rel_err(g, w) <= 1e-6, f"d{name}: the chunks' gradients sum to {rel_err(g, w):.2e} off the whole run's"


@interpreter
@pytest.mark.parametrize("G,D,layout", [(1, 16, "key-block-major"), (3, 16, "query-tiles")])
def test_two_chunks_as_the_rows_of_one_call(G: int, D: int, layout: str, monkeypatch):
    """A context-parallel shard's two chunks in one call: two sequences' chunks at positions 8 and 65 (no block
    boundary) as the even and odd rows of a batch of 4, with q_start = (8, 65) and each sequence's keys repeated
    for its two rows, give each chunk's own call's outputs, blocks and gradients (the keys' summed over their
    rows), and the fp64 reference's with the same pair of offsets."""
    small_tiles(monkeypatch, layout)
    C, starts = 24, (8, 65)
    inputs = make_inputs(2, T_CPU, 2, G, D, ARGS, torch.float32)
    cot = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    out, idx, grads = one_call(nsa_triton, inputs, starts, C, ARGS, cot)
    separate = [run(nsa_triton, inputs, start, start + C, ARGS, cot) for start in starts]
    assert torch.equal(idx, torch.stack([s[1] for s in separate], 1).flatten(0, 1))
    assert rel_err(out, torch.stack([s[0] for s in separate], 1).flatten(0, 1)) <= 1e-6
    for name, g, a, b in zip(NAMES, grads, separate[0][2], separate[1][2]):
        assert rel_err(g, a + b, floor_rms=1e-3) <= 1e-6, f"d{name}: {rel_err(g, a + b):.2e}"
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    want, _, want_grads = one_call(nsa_reference, inputs64, starts, C, ARGS, cot, idx)
    assert rel_err(out, want) <= 1e-5
    for name, g, w in zip(NAMES, grads, want_grads):
        assert rel_err(g, w, floor_rms=1e-3) <= 1e-5, f"d{name} against the reference: {rel_err(g, w):.2e}"


def test_kernels_without_an_offset_are_refused():
    """FlashAttention's windows, the fused sweep and FlashAttention-4's compressed branch align queries with keys:
    one line naming the key and the fix, from nsa_triton before any kernel runs; q_start = 0 runs them all."""
    for key, choice, fix in [("window_backend", "flash_attn", "'flex' or 'sdpa'"),
                             ("window_backend", "flash_attn_4", "'flex' or 'sdpa'"),
                             ("window_backend", "fused_with_selected", "'flex' or 'sdpa'"),
                             ("cmp_backend", "flash_attn_4", "'triton'")]:
        args = NSAArgs(backend="triton", **{key: choice})
        with pytest.raises(ValueError) as error:
            check_query_offset(args)
        assert str(error.value) == (f"model.nsa.{key} = {choice!r} takes no query offset (queries that start "
                                    f"mid-sequence, as context parallelism's): set it to {fix}")
        with pytest.raises(ValueError, match="takes no query offset"):
            nsa_attention(*make_inputs(1, 16, 1, 1, 16, args, torch.float32), args, q_start=8)
    check_query_offset(NSAArgs(backend="triton", window_backend="sdpa"))


def test_chunk_window_masks_compile_once_for_every_offset():
    """The chunks' FlexAttention window masks (built by a compiled kernel) at two offsets: one compiled graph, not
    one per chunk (an int offset in the mask's closure was a constant Dynamo guarded on), and each mask equal to
    the one built without compile at its offset; and the mask of both chunks as alternate rows of one batch."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    from nsa_models.nsa.triton_backend import _window_block_mask

    C, TK, w = 256, 1024, 200
    before = counters["stats"]["unique_graphs"]
    masks = {start: _window_block_mask(C, w, "cpu", q_start=start, kv_len=TK) for start in (0, 3 * C)}
    assert counters["stats"]["unique_graphs"] - before == 1
    for start, mask in masks.items():
        def window(b, h, q_idx, kv_idx, start=start):
            return (kv_idx <= q_idx + start) & (q_idx + start - kv_idx < w)

        want = create_block_mask(window, None, None, C, TK, device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(mask, name), getattr(want, name)), f"{name} at q_start = {start}"
        n = want.kv_num_blocks[0, 0]
        for row, count in enumerate(n.tolist()):  # indices past a row's count are unused
            assert torch.equal(mask.kv_indices[0, 0, row, :count], want.kv_indices[0, 0, row, :count]), start
    # Both chunks as the rows of one call (even rows at 0, odd ones at 3C): each row's mask is its offset's.
    pair = _window_block_mask(C, w, "cpu", q_start=(0, 3 * C), kv_len=TK, batch=4)
    assert pair.kv_num_blocks.shape[0] == 4
    for b in range(4):
        single = masks[(0, 3 * C)[b % 2]]
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(pair, name)[b], getattr(single, name)[0]), f"{name}, row {b}"
        for row, count in enumerate(single.kv_num_blocks[0, 0].tolist()):
            assert torch.equal(pair.kv_indices[b, 0, row, :count], single.kv_indices[0, 0, row, :count]), (b, row)


@pytest.mark.gpu
def test_query_offset_on_gpu_matches_reference():
    """nsa-125m's heads (G = 3, D = 64, 4 KV heads) at 8k in bf16, as 2-way CP's rank 0 runs them: chunks 0 and 3
    of 4 (q_start 0 and 6144) with the FlexAttention window, against the fp32 reference with the same offset and
    blocks; errors within 2x the reference's own bf16 error (or 1e-2). The selection against the reference's
    scores at the chunk's global positions. Then both chunks in one call (`one_call`) against the two calls."""
    args = NSAArgs(backend="triton", window_backend="flex")
    T, C = 8192, 2048
    inputs = make_inputs(1, T, 4, 3, 64, args, torch.bfloat16, "cuda")
    inputs32 = [x.detach().float().requires_grad_() for x in inputs]
    cot = torch.randn(inputs[0].shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
    separate = []
    for start in (0, 3 * C):
        out, idx, grads = run(nsa_triton, inputs, start, start + C, args, cot)
        assert_valid_selection(idx, reference_scores(inputs[0][:, start:start + C], inputs[5], args, start, T),
                               args.n_selected, tol=1e-2)
        want, _, want_grads = run(nsa_reference, inputs32, start, start + C, args, cot, idx)
        ref_lo, _, ref_lo_grads = run(nsa_reference, inputs, start, start + C, args, cot, idx)
        for name, g, lo, w in zip(["out", *NAMES], [out, *grads], [ref_lo, *ref_lo_grads], [want, *want_grads]):
            assert torch.isfinite(g).all(), name
            bound = max(1e-2, 2 * rel_err(lo, w, floor_rms=1e-3))
            assert rel_err(g, w, floor_rms=1e-3) <= bound, f"{name} at q_start = {start}: {rel_err(g, w):.2e}"
        separate.append((out, idx, grads))
    # Both chunks in one call (the FlexAttention mask of a pair of offsets): each row as its chunk's own call.
    out, idx, grads = one_call(nsa_triton, inputs, (0, 3 * C), C, args, cot)
    assert torch.equal(idx, torch.stack([s[1] for s in separate], 1).flatten(0, 1))
    assert rel_err(out, torch.stack([s[0] for s in separate], 1).flatten(0, 1)) <= 1e-3
    for name, g, a, b in zip(NAMES, grads, separate[0][2], separate[1][2]):
        assert rel_err(g, a + b, floor_rms=1e-3) <= 1e-2, f"d{name} in one call: {rel_err(g, a + b):.2e}"
