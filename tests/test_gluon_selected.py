"""The Gluon key-block-major selected forward (`nsa_models/nsa/gluon_selected.py`) against Triton's
`_fwd_item_kernel` on a Hopper GPU: the same work lists (the repo's `reverse_index` / `_item_args`), random bf16
inputs and random valid block choices, and the per-(row, slot) outputs and log-sum-exps compared slot by slot.

Both kernels write exactly the slots of chosen blocks (checked: NaN-filled buffers stay NaN elsewhere). Outputs
within 1e-2 relative error (bf16 P and outputs, fp32 accumulation in both), lse within 1e-3 where finite and -inf in
the same slots (rows that see no key).
"""

import pytest
import torch

from bench.gluon_selected import item_launch

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
