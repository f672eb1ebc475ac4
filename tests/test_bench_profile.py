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


def test_idle_gaps_are_charged_to_the_host_op_that_launched_the_next_kernel():
    def x(name, ts, dur, cat, tid=1, correlation=None):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid,
                "args": {} if correlation is None else {"correlation": correlation}}

    events = [x("ProfilerStep#3", 0, 10_000, "user_annotation"),
              x("Optimizer.step", 100, 5000, "cpu_op"), x("aten::sort", 2000, 500, "cpu_op"),
              x("aten::add", 3000, 100, "cpu_op"), x("aten::mul", 6000, 100, "cpu_op", tid=2),
              x("cudaLaunchKernel", 150, 10, "cuda_runtime", correlation=1),
              x("cudaLaunchKernel", 2100, 10, "cuda_runtime", correlation=2),  # in Optimizer.step > aten::sort
              x("cudaLaunchKernel", 3010, 10, "cuda_runtime", correlation=3),  # in Optimizer.step > aten::add
              x("cudaLaunchKernel", 6010, 10, "cuda_runtime", tid=2, correlation=4),  # aten::mul alone
              x("k0", 200, 1000, "kernel", correlation=1),
              x("k1", 1500, 1000, "kernel", correlation=2),  # 300 us idle before it
              x("k2", 2510, 100, "kernel", correlation=3),  # 10 us: under the threshold
              x("k3", 6100, 100, "kernel", correlation=4),  # 3490 us
              x("k4", 6250, 100, "kernel", correlation=99)]  # 50 us, its launch not in the trace
    text = kernels.summarize(events, n_layers=1)
    assert "GPU idle in gaps of 20 us or more: 3.84 ms per step" in text
    assert "| `aten::mul [cudaLaunchKernel]` | 3.490 | 1.0 |" in text
    assert "| `Optimizer.step > aten::sort [cudaLaunchKernel]` | 0.300 | 1.0 |" in text
    assert "| `(launch not in the trace)` | 0.050 | 1.0 |" in text
    assert "aten::add" not in text.split("| host op")[0]  # its gap was under the threshold


def test_host_time_is_split_into_each_ops_own_time():
    def x(name, ts, dur, cat, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}

    events = []
    for start in (0, 10_000):  # two steps: one op holding another and a launch, and an op on a second thread
        events += [x("ProfilerStep#1", start, 10_000, "user_annotation"),
                   x("nsa::selected_window_bwd", start + 100, 3000, "cpu_op"),
                   x("aten::empty_like", start + 200, 500, "cpu_op"),
                   x("cuLaunchKernelEx", start + 1000, 200, "cuda_driver"),
                   x("aten::mm", start + 5000, 1000, "cpu_op", tid=2)]
    events.append(x("aten::mm", 30_000, 1000, "cpu_op"))  # after the steps: not counted
    text = kernels.summarize(events, n_layers=1)
    assert "| `nsa::selected_window_bwd` | 2.30 | 3.00 | 1 |" in text
    assert "| `aten::mm` | 1.00 | 1.00 | 1 |" in text
    assert "| `aten::empty_like` | 0.50 | 0.50 | 1 |" in text
    assert "| `cuLaunchKernelEx` | 0.20 | 0.20 | 1 |" in text
    assert "ProfilerStep" not in text.split("| host op")[1]
