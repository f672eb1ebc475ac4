"""The profiled steps' kernel breakdown (benchmarking/kernels.py: bench/profile_step.py and bench/scaling.py print
it) on a hand-made trace whose answers are known."""

from __future__ import annotations

import pytest

from benchmarking import kernels


def test_union_of_overlapping_intervals():
    assert kernels.union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert kernels.union_ms([(0, 4000), (1000, 2000)]) == pytest.approx(4.0)


def test_summary_of_two_steps():
    def x(name, ts, dur, cat="kernel"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}

    events = []
    for start in (0, 10_000):  # two steps of 10 ms: 3 launches each, the last ending 6 ms in
        events.append(x("ProfilerStep#6", start, 10_000, "user_annotation"))
        events.append(x("ProfilerStep#6", start + 2000, 7000, "gpu_user_annotation"))  # the GPU's copy: not a step
        events += [x("cudaLaunchKernel", start + 1000 * i, 500, "cuda_runtime") for i in range(1, 6, 2)]
        events += [x("sm90_xmma_gemm_bf16", start + 2000, 2000), x("_fwd_kernel", start + 3000, 2000),
                   x("triton_poi_fused_add_0", start + 7000, 1000)]
    text = kernels.summarize(events, n_layers=2)
    assert "step 10.00 ms, GPU busy 4.00 ms (40%), host enqueue 5.50 ms, 3 kernel launches per step" in text
    assert "| GEMM | 2.00 | 40.0% | 1 | 0.5 |" in text
    assert "| NSA Triton kernels | 2.00 | 40.0% | 1 | 0.5 |" in text
    assert "| inductor fused (triton_*) | 1.00 | 20.0% | 1 | 0.5 |" in text
