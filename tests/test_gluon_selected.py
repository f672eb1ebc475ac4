"""The Gluon key-block-major selected kernels (`nsa_models/nsa/gluon_selected.py`) against Triton's on a Hopper GPU:
the same work lists (the repo's `reverse_index` / `_item_args`), random bf16 inputs and random valid block choices.
The forward (`_fwd_item_kernel`): the per-(row, slot) outputs and log-sum-exps compared slot by slot. The backward's
dK/dV kernel (`_bwd_dkdv_kernel`, with and without the dQ term, the Gluon one at each rows per step / warps it
supports): the per-item dK / dV partial sums and the per-(row, slot) dQ terms, from the forward's lse and random dO.

Model level: one nsa-125m and one nsa-1b block (the triton backend, bf16) with `model.nsa.selected_kernels =
"gluon_hopper"` against "triton": logits and every parameter's gradient within 1e-2 relative error.

Both kernels write exactly the slots of chosen blocks (checked: NaN-filled buffers stay NaN elsewhere). Outputs
within 1e-2 relative error (bf16 P and outputs, fp32 accumulation in both), lse within 1e-3 where finite and -inf in
the same slots (rows that see no key). Backward: DK_PART / DV_PART within 1e-2 relative error on the used items
(NaN elsewhere), DQ_PART within 1e-2 on the chosen slots (NaN elsewhere).
"""

import pytest
import torch

from bench.gluon_selected import dkdv_launch, item_launch
from nsa_models.nsa import gluon_selected
from tests.helpers import one_block_run, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon kernel is written for Hopper (sm_90)"),
]

CASES = [  # B, T, H (KV heads), G, D, q_start
    (2, 8192, 4, 3, 64, 0),  # nsa-125m's heads
    (2, 8192, 4, 4, 128, 0),  # nsa-1b's heads
    (1, 4160, 4, 3, 64, 0),  # T not a multiple of 64: a partial last key block
    (1, 4160, 4, 4, 128, 0),
    (2, 1000, 4, 3, 64, 3100),  # queries at an offset (context parallelism's chunks), keys 4100 long
    (1, 2048, 4, 1, 128, 0),  # G = 1: 64 queries a step
]


@pytest.mark.parametrize("B, T, H, G, D, q_start", CASES)
def test_gluon_matches_triton(B: int, T: int, H: int, G: int, D: int, q_start: int):
    launch = item_launch(B, T, H, G, D, q_start)
    o_triton, lse_triton = launch.outputs()
    o_gluon, lse_gluon = launch.outputs()
    launch.run_triton(o_triton, lse_triton)
    launch.run_gluon(o_gluon, lse_gluon)
    torch.cuda.synchronize()

    filled = launch.filled()
    assert not lse_triton[filled].isnan().any(), "the Triton kernel left a chosen slot unwritten"
    assert not lse_gluon[filled].isnan().any(), "the Gluon kernel left a chosen slot unwritten"
    assert lse_gluon[~filled].isnan().all() and o_gluon[~filled].isnan().all(), "the Gluon kernel wrote a padding slot"

    want, got = o_triton[filled].double(), o_gluon[filled].double()
    assert not got.isnan().any()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"O_PART relative error {err:.2e}"

    lse_want, lse_got = lse_triton[filled], lse_gluon[filled]
    finite = lse_want.isfinite()
    assert torch.equal(finite, lse_got.isfinite()), "rows that see no key differ"
    assert (lse_got[~finite] == float("-inf")).all() and (lse_want[~finite] == float("-inf")).all()
    lse_err = (lse_got[finite] - lse_want[finite]).abs().max().item()
    assert lse_err <= 1e-3, f"LSE_PART max abs error {lse_err:.2e}"


# Every case at the Gluon kernel's default rows per step / warps (`bwd_launch_shape`); the 8k cases also at the
# other ones it supports (the bench times them all).
DKDV_CASES = [(*case, None) for case in CASES] + [(*case, shape) for case in CASES[:2]
                                                   for shape in ((64, 4), (64, 8), (128, 8))]


@pytest.mark.parametrize("with_dq", [True, False], ids=["dq", "no-dq"])
@pytest.mark.parametrize("B, T, H, G, D, q_start, shape", DKDV_CASES)
def test_gluon_dkdv_matches_triton(B: int, T: int, H: int, G: int, D: int, q_start: int,
                                   shape: tuple[int, int] | None, with_dq: bool):
    launch = dkdv_launch(B, T, H, G, D, with_dq, q_start)
    dk_t, dv_t, dq_t = launch.outputs()
    dk_g, dv_g, dq_g = launch.outputs()
    launch.run_triton(dk_t, dv_t, dq_t)
    launch.run_gluon(dk_g, dv_g, dq_g, *(shape or (None, None)))
    torch.cuda.synchronize()

    used = launch.used_items()
    for name, want, got in (("DK_PART", dk_t, dk_g), ("DV_PART", dv_t, dv_g)):
        assert not want[used].isnan().any(), f"the Triton kernel left a used item of {name} unwritten"
        assert not got[used].isnan().any(), f"the Gluon kernel left a used item of {name} unwritten (or NaN)"
        assert got[~used].isnan().all(), f"the Gluon kernel wrote an unused item of {name}"
        err = rel_err(got[used], want[used])
        assert err <= 1e-2, f"{name} relative error {err:.2e}"
    if with_dq:
        filled = launch.fwd.filled()
        assert not dq_t[filled].isnan().any(), "the Triton kernel left a chosen slot of DQ_PART unwritten"
        assert not dq_g[filled].isnan().any(), "the Gluon kernel left a chosen slot of DQ_PART unwritten (or NaN)"
        assert dq_g[~filled].isnan().all(), "the Gluon kernel wrote a padding slot of DQ_PART"
        err = rel_err(dq_g[filled], dq_t[filled])
        assert err <= 1e-2, f"DQ_PART relative error {err:.2e}"


@pytest.mark.parametrize("flavor", ["nsa-125m", "nsa-1b"])
def test_model_block_with_gluon_selected_kernels_matches_triton(flavor: str, monkeypatch):
    """selected_kernels = "gluon_hopper" end to end through the model: 2 x 4096 tokens (64 key blocks > 2n = 32 at
    G = 3 and 4: the key-block-major layout), the Gluon forward and dK/dV kernels launched (head dim 64 and 128, both
    with the per-pair dQ term)."""
    calls = []
    for name in ("gluon_fwd_items", "gluon_bwd_dkdv_items"):
        launch = getattr(gluon_selected, name)
        monkeypatch.setattr(gluon_selected, name,
                            lambda *a, _launch=launch, _name=name, **kw: (calls.append(_name), _launch(*a, **kw))[1])
    tokens = torch.randint(0, 512, (2, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want_logits, want_grads = one_block_run(flavor, tokens, selected_kernels="triton")
    assert calls == []
    got_logits, got_grads = one_block_run(flavor, tokens, selected_kernels="gluon_hopper")
    assert calls == ["gluon_fwd_items", "gluon_bwd_dkdv_items"]
    errors = {"logits": rel_err(got_logits, want_logits)}
    errors |= {name: rel_err(got_grads[name], grad) for name, grad in want_grads.items()}
    assert not any(x.isnan().any() for x in [got_logits, *got_grads.values()])
    assert all(err <= 1e-2 for err in errors.values()), {name: err for name, err in errors.items() if err > 1e-2}
