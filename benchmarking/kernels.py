"""Where a profiled step's GPU time goes, from a torch.profiler trace's events: GPU time per kernel family and per
kernel, launches per block, host enqueue against GPU busy time (bench/profile_step.py prints it for one process,
bench/scaling.py for each cell's rank 0)."""

from __future__ import annotations

import re
from collections import defaultdict

FAMILIES = [  # (family, regex on the kernel name), first match wins
    ("NCCL", r"nccl"),
    ("SDPA / flash / FA4 / cuDNN attention", r"flash|fmha|cudnn|attn|flex"),
    ("GEMM", r"gemm|xmma|cutlass|nvjet|wgmma|sm90_|sm80_"),
    ("inductor fused (triton_*)", r"^triton_"),
    ("NSA Triton kernels", r"^_\w+_kernel$|^_\w+$"),
    ("aten (eager ops)", r"at::|native|elementwise|reduce_kernel|vectorized"),
]
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, name)), "other")


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals in µs."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def summarize(events: list[dict], n_layers: int, top: int = 20) -> str:
    # The host's step spans only: Kineto also writes each ProfilerStep on the GPU timeline (cat
    # "gpu_user_annotation"), and counting those too halved every per-step figure.
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
             and re.fullmatch(r"ProfilerStep#\d+", e.get("name", ""))]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = [e for e in events if e.get("ph") == "X" and e.get("name") in LAUNCHES]
    n = len(steps)
    step_ms = sum(e["dur"] for e in steps) / n / 1e3
    busy_ms = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / n
    enqueue = []
    for s in steps:
        ends = [e["ts"] + e["dur"] for e in launches if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        enqueue.append((max(ends) - s["ts"]) / 1e3 if ends else 0.0)
    by_family, by_name = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for e in kernels:
        for table, key in ((by_family, family(e["name"])), (by_name, e["name"])):
            table[key][0] += e["dur"] / 1e3 / n
            table[key][1] += 1 / n
    kernel_ms = sum(ms for ms, _ in by_family.values()) or float("nan")  # no kernel: a CPU run
    lines = [f"{n} profiled steps: step {step_ms:.2f} ms, GPU busy {busy_ms:.2f} ms "
             f"({busy_ms / step_ms:.0%}), host enqueue {sum(enqueue) / n:.2f} ms, "
             f"{len(kernels) / n:.0f} kernel launches per step ({len(kernels) / n / n_layers:.0f} per block)", "",
             "| kernel family | GPU ms / step | share | launches / step | per block |", "|---|---|---|---|---|"]
    for name, (ms, count) in sorted(by_family.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {name} | {ms:.2f} | {ms / kernel_ms:.1%} | {count:.0f} | {count / n_layers:.1f} |")
    lines += ["", f"| kernel (top {top} by GPU time) | family | GPU ms / step | launches / step |", "|---|---|---|---|"]
    for name, (ms, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        short = name if len(name) <= 70 else name[:67] + "..."
        lines.append(f"| `{short}` | {family(name)} | {ms:.3f} | {count:.0f} |")
    return "\n".join(lines) + "\n"
