"""The `triton` NSA backend on a CUDA GPU against the reference: outputs, selected blocks and every gradient.

Outputs and gradients are compared with the fp32 reference on the same (bf16-rounded) inputs and the blocks the
backend chose; the choice itself is checked against the reference's selection scores (near-equal scores summed in
another order may rank differently).
"""

import pytest
import torch
import torch.nn.functional as F

from bench.attention import random_block_indices
from nsa_models.args import NSAArgs
from nsa_models.nsa.fa4 import fa4_compressed_attention
from nsa_models.nsa.reference import nsa_reference
from nsa_models.nsa.triton_backend import nsa_triton, window_block_mask
from nsa_models.nsa.triton_selected import selected_attention
from nsa_models.nsa.triton_selection import select_topn
from tests.helpers import assert_valid_selection, needs_flash_attn_4, reference_scores, ungated_compressed

pytestmark = pytest.mark.gpu

HYPERS = [dict(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512),
          dict(cmp_block_size=64, cmp_stride=64, sel_block_size=64, n_selected=16, window_size=512)]
LENGTHS = [1, 31, 64, 1000, 4113]
# every power-of-two G and D, few compiles; and nsa-125m's G = 3 (tiles of 21 positions x 3 heads)
GROUPS_DIMS = [(1, 64), (2, 128), (3, 64), (4, 64), (8, 128), (16, 64), (16, 128)]
NAMES = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, or the RMS of a - b where b is numerically zero (dq and dk when T = 1 are rounding)."""
    diff, scale = (a.float() - b.float()).norm().item(), b.float().norm().item()
    if scale <= 1e-3 * b.numel() ** 0.5:
        return diff / max(1, b.numel()) ** 0.5
    return diff / scale


def make_leaves(B: int, T: int, H: int, G: int, D: int, args: NSAArgs, dtype: torch.dtype, separate: bool):
    """q, k_slc, v_slc, (k_win, v_win when separate), k_cmp, v_cmp, gates."""
    gen = torch.Generator(device="cuda").manual_seed(T * 31 + G * 7 + D)
    n_cmp = args.num_cmp_blocks(T)
    kv_shapes = [(B, T, H, D)] * (4 if separate else 2) + [(B, n_cmp, H, D)] * 2
    leaves = [torch.randn(s, generator=gen, device="cuda") for s in [(B, T, H * G, D)] + kv_shapes]
    leaves[0] = leaves[0] * 2  # sharper compressed softmax: selection depends on the inputs
    leaves.append(torch.rand(B, T, H * G, 3, generator=gen, device="cuda"))
    return [t.to(dtype).requires_grad_() for t in leaves]


def as_call(leaves: list, separate: bool) -> list:
    """The 8 backend arguments; a shared K/V (the model's default) serves the selected and window branches."""
    return leaves if separate else leaves[:3] + leaves[1:3] + leaves[3:]


def check_backend(T: int, G: int, D: int, hyper: dict, dtype: torch.dtype, window_backend: str, separate: bool):
    """Errors against the fp32 reference must stay within TOL, or for bf16 within twice the reference's own
    bf16 error (the plain-torch gating and compressed branch round the same way in both backends)."""
    args = NSAArgs(**hyper, window_backend=window_backend)
    B, H = (1, 2) if T >= 1000 else (2, 2)
    leaves = make_leaves(B, T, H, G, D, args, dtype, separate)
    out, idx, _ = nsa_triton(*as_call(leaves, separate), args)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    want, *_ = nsa_reference(*as_call(ref_leaves, separate), args, idx)
    cot = torch.randn_like(want)
    names = ["out"] + [f"d{n}" for n in (NAMES if separate else NAMES[:3] + NAMES[5:])]
    got = [out] + list(torch.autograd.grad((out.float() * cot).sum(), leaves))
    truth = [want] + list(torch.autograd.grad((want * cot).sum(), ref_leaves))
    bound = {n: TOL[dtype] for n in names}
    if dtype != torch.float32:
        ref_lo, *_ = nsa_reference(*as_call(leaves, separate), args, idx)
        ref_lo = [ref_lo] + list(torch.autograd.grad((ref_lo.float() * cot).sum(), leaves))
        bound = {n: max(TOL[dtype], 2 * rel_err(r, w)) for n, r, w in zip(names, ref_lo, truth)}
    errors = {n: rel_err(g, w) for n, g, w in zip(names, got, truth)}
    assert all(errors[n] <= bound[n] for n in names), (errors, bound)
    assert all(torch.isfinite(g).all() for g in got)
    k_cmp = leaves[-3]
    assert_valid_selection(idx, reference_scores(leaves[0], k_cmp, args), args.n_selected, tol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("G,D", GROUPS_DIMS)
def test_backend_matches_reference(T: int, G: int, D: int, dtype: torch.dtype):
    hyper = HYPERS[(LENGTHS.index(T) + GROUPS_DIMS.index((G, D))) % 2]
    check_backend(T, G, D, hyper, dtype, "sdpa", separate=T == 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [31, 4113])  # within one FlexAttention block, and past a multiple of the block
def test_backend_with_flex_window(T: int, dtype: torch.dtype):
    check_backend(T, 16, 128, HYPERS[0], dtype, "flex", separate=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 31, 1000, 2048, 4095])  # up to the fused sweep's 64 blocks
@pytest.mark.parametrize("G,D", GROUPS_DIMS)
def test_backend_with_window_fused_with_selected(T: int, G: int, D: int, dtype: torch.dtype):
    hyper = HYPERS[(T + G) % 2]
    check_backend(T, G, D, hyper, dtype, "fused_with_selected", separate=False)


@pytest.mark.parametrize("T", [1, 31, 1000, 4113])  # FA4 takes bf16 / fp16 only
@pytest.mark.parametrize("G,D", [(1, 128), (3, 64), (16, 128)])
def test_backend_with_flash_attn_4_window(T: int, G: int, D: int):
    needs_flash_attn_4()
    check_backend(T, G, D, HYPERS[0], torch.bfloat16, "flash_attn_4", separate=T == 1000)


@pytest.mark.parametrize("T", [1, 31, 1000, 4113])
@pytest.mark.parametrize("G,D", [(1, 128), (3, 64), (16, 128)])
def test_backend_with_flash_attn_4_compressed(T: int, G: int, D: int):
    """cmp_backend = 'flash_attn_4' (queries packed as heads): T < l (no block visible), T not a multiple of d,
    both block configurations (l = 2d and l = d)."""
    needs_flash_attn_4()
    hyper = HYPERS[(T + G) % 2]
    check_backend(T, G, D, {**hyper, "cmp_backend": "flash_attn_4"}, torch.bfloat16, "flash_attn_4",
                  separate=T == 1000)


@pytest.mark.parametrize("G,D", [(3, 64), (16, 128)])
def test_backend_with_flash_attn_4_and_float_atomics(G: int, D: int):
    """model.nsa.float_atomics: FA4's atomic backward (window and compressed), within the deterministic bounds."""
    needs_flash_attn_4()
    check_backend(4113, G, D, {**HYPERS[0], "float_atomics": True, "cmp_backend": "flash_attn_4"}, torch.bfloat16,
                  "flash_attn_4", separate=False)


@pytest.mark.parametrize("G", [16, 2], ids=["query-tiles", "key-block-major"])
def test_long_sequence_forward_and_deterministic_backward(G: int):
    """T = 65536: forward against the reference's selected branch; backward finite and bitwise reproducible."""
    B, T, H, D, block, n = 1, 65536, 1, 128, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (H * G, H, H))
    idx = random_block_indices(B, H, T, n, block, "cuda")
    out = selected_attention(q, k, v, idx, block)
    gates = torch.zeros(B, T, H * G, 3, device="cuda")
    gates[..., 1] = 1  # the reference's selected branch alone
    args = NSAArgs(cmp_block_size=block, cmp_stride=block, sel_block_size=block, n_selected=n, window_size=1)
    with torch.no_grad():
        empty = torch.zeros(B, 0, H, D, device="cuda")
        want, *_ = nsa_reference(q.float(), k.float(), v.float(), k.float(), v.float(), empty, empty, gates, args,
                                 idx)
    assert rel_err(out, want) <= 1e-2
    cot = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), cot)
    second = torch.autograd.grad(selected_attention(q, k, v, idx, block), (q, k, v), cot)
    for a, b in zip(first, second):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("cmp_backend", ["triton", "flash_attn_4"])
def test_compressed_long_sequence(cmp_backend: str):
    """T = 65536, G = 16, D = 128: compressed attention and its gradients against SDPA with the visibility mask
    (fp32), the selection against the reference's scores, and a bitwise reproducible backward."""
    if cmp_backend == "flash_attn_4":
        needs_flash_attn_4()
    compressed_attention = ungated_compressed if cmp_backend == "triton" else fa4_compressed_attention
    B, T, H, G, D, l, d = 1, 65536, 1, 16, 128, 32, 16
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=64, n_selected=16)
    n_cmp = args.num_cmp_blocks(T)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, t, h, D, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
               for t, h in ((T, H * G), (n_cmp, H), (n_cmp, H)))
    o, lse = compressed_attention(q, k, v, l, d, D ** -0.5)
    cot = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), cot)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(
        compressed_attention(q, k, v, l, d, D ** -0.5)[0], (q, k, v), cot)))
    # Queries from l - 1 on see at least one block (SDPA would give NaN rows before); they alone have gradients.
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    t = torch.arange(l - 1, T, device="cuda")
    visible = torch.arange(n_cmp, device="cuda") * d + l - 1 <= t[:, None]
    want = F.scaled_dot_product_attention(q32[:, l - 1:].transpose(1, 2), k32.transpose(1, 2).expand(-1, G, -1, -1),
                                          v32.transpose(1, 2).expand(-1, G, -1, -1), attn_mask=visible)
    want = want.transpose(1, 2)
    want_grads = torch.autograd.grad(want, (q32, k32, v32), cot[:, l - 1:].float())
    assert rel_err(o[:, l - 1:], want) <= 1e-2 and o[:, :l - 1].abs().max() == 0
    for name, g, w in zip("qkv", got, want_grads):
        assert rel_err(g, w) <= 1e-2, f"d{name}"
    idx, _ = select_topn(q.detach(), k.detach(), lse, l, d, 64, 16, D ** -0.5)
    scores = torch.cat([reference_scores(q[:, s:s + 4096], k, args, start=s, seq_len=T) for s in range(0, T, 4096)],
                       dim=2)
    assert_valid_selection(idx, scores, 16, tol=1e-3)


@pytest.mark.parametrize("window_backend,cmp_backend", [("flex", "triton"), ("sdpa", "triton"),
                                                         ("flash_attn_4", "triton"), ("flash_attn_4", "flash_attn_4"),
                                                         ("fused_with_selected", "triton")])
def test_compile_fullgraph_matches_eager_and_backward_is_deterministic(window_backend: str, cmp_backend: str):
    """The whole backend under torch.compile(fullgraph=True): no graph break, the eager result; and with the
    FlexAttention or FA4 window its backward run twice gives bitwise the same gradients (the masked-SDPA window
    runs the memory-efficient kernel, whose backward is not bitwise reproducible; the fused window's is)."""
    if "flash_attn_4" in (window_backend, cmp_backend):
        needs_flash_attn_4()
    args = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512,
                   window_backend=window_backend, cmp_backend=cmp_backend)
    leaves = make_leaves(1, 2000, 2, 4, 64, args, torch.bfloat16, separate=False)
    cot = torch.randn(1, 2000, 8, 64, device="cuda")

    def loss(*leaves):
        out, idx, _ = nsa_triton(*as_call(list(leaves), False), args)
        return (out.float() * cot).sum(), idx

    (eager, eager_idx), (compiled, compiled_idx) = loss(*leaves), torch.compile(loss, fullgraph=True)(*leaves)
    assert torch.equal(eager_idx, compiled_idx)
    eager_grads = torch.autograd.grad(eager, leaves)
    for e, c in zip(eager_grads, torch.autograd.grad(compiled, leaves)):
        assert rel_err(c, e) <= 1e-2
    if window_backend != "sdpa":
        again = torch.autograd.grad(loss(*leaves)[0], leaves)
        assert all(torch.equal(a, b) for a, b in zip(eager_grads, again))


@pytest.mark.parametrize("cmp_backend", ["triton", "flash_attn_4"])
def test_forward_and_backward_never_wait_on_the_gpu(cmp_backend: str):
    """No device-to-host sync in the backend's forward or backward: a sync stalls the host's kernel launches (the
    GPU idles until the host catches up) and cannot be captured in a CUDA graph."""
    if cmp_backend == "flash_attn_4":
        needs_flash_attn_4()
    args = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512,
                   cmp_backend=cmp_backend)
    leaves = make_leaves(1, 2000, 2, 4, 64, args, torch.bfloat16, separate=False)
    mask = window_block_mask(2000, args.window_size, torch.device("cuda"))

    def grads():
        out, _, _ = nsa_triton(*as_call(leaves, False), args, window_mask=mask)
        return torch.autograd.grad(out.float().square().sum(), leaves)

    grads()  # compiles the kernels and FlexAttention first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads()
    finally:
        torch.cuda.set_sync_debug_mode("default")
