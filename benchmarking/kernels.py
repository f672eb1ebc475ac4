"""Where a profiled step's GPU time goes, from a torch.profiler trace's events: GPU time per kernel family and per
kernel, launches per block, host enqueue against GPU busy time, what the host was launching when the GPU sat idle,
and the host's own time per op (bench/profile_step.py prints it for one process, bench/scaling.py for each cell's
rank 0)."""

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


def _enclosing(ops: list[dict], times: list[float]) -> dict[float, list[str]]:
    """Per time, the names of one thread's host ops running then, outermost first. The ops of a thread nest, so
    one sweep in time order with a stack of the open ones answers every time."""
    chains, stack, i = {}, [], 0
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    for t in sorted(times):
        while i < len(ops) and ops[i]["ts"] <= t:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ops[i]["ts"]:
                stack.pop()
            stack.append(ops[i])
            i += 1
        chains[t] = [e["name"] for e in stack if t < e["ts"] + e["dur"]]
    return chains


def idle_gaps(steps: list[dict], kernels: list[dict], events: list[dict], min_us: float = 20.0,
              top: int = 10) -> list[str]:
    """Markdown lines: the GPU's idle time within the steps (gaps of at least min_us between kernels), charged to
    the host op that launched the kernel ending each gap (innermost, and the outermost under the step): what the
    GPU was waiting for. Kernels and launches pair up by the trace's correlation ids."""
    launch_of = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X" and e.get("name") in LAUNCHES
                 and "correlation" in e.get("args", {})}
    ops_by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)
    gaps = []  # (idle µs, the launch of the kernel that ended it or None)
    for s in steps:
        inside = sorted((e for e in kernels if s["ts"] <= e["ts"] < s["ts"] + s["dur"]), key=lambda e: e["ts"])
        end = inside[0]["ts"] + inside[0]["dur"] if inside else 0.0
        for e in inside[1:]:
            gap = e["ts"] - end
            end = max(end, e["ts"] + e["dur"])
            if gap >= min_us:
                gaps.append((gap, launch_of.get(e.get("args", {}).get("correlation"))))
    chains = {tid: _enclosing(ops, [launch["ts"] for _, launch in gaps if launch and launch["tid"] == tid])
              for tid, ops in ops_by_thread.items()}
    charged = defaultdict(lambda: [0.0, 0])
    for gap, launch in gaps:
        ops = chains.get(launch["tid"], {}).get(launch["ts"], []) if launch else []
        key = (f"{ops[0]} > {ops[-1]}" if len(ops) > 1 else ops[0] if ops
               else "(launch not in the trace)") + (f" [{launch['name']}]" if launch else "")
        charged[key][0] += gap
        charged[key][1] += 1
    n = len(steps)
    lines = [f"GPU idle in gaps of {min_us:.0f} us or more: {sum(g for g, _ in gaps) / n / 1e3:.2f} ms per step", "",
             "| host op launching the kernel after the gap (outer > inner) [launch] | idle ms / step | gaps / step |",
             "|---|---|---|"]
    for key, (us, count) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]:
        short = key if len(key) <= 110 else key[:107] + "..."
        lines.append(f"| `{short}` | {us / n / 1e3:.3f} | {count / n:.1f} |")
    return lines


HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


def host_time(steps: list[dict], events: list[dict], top: int = 15) -> list[str]:
    """Markdown lines: the host's time per op name within the steps, on every thread, by self time (its own time
    less that of the ops and runtime calls nested in it), with its inclusive time and calls per step: what a
    host-bound step (no CUDA graphs: FSDP2, `compile.mode = "default"`) spends its time on. The steps themselves
    are not ops; a thread blocked inside an op (a synchronize, the main thread in backward) counts as that op's."""
    spans = [(s["ts"], s["ts"] + s["dur"]) for s in steps]
    by_thread = defaultdict(list)
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and not e["name"].startswith("ProfilerStep")
                and any(lo <= e["ts"] < hi for lo, hi in spans)):
            by_thread[e.get("tid")].append(e)
    own, total, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for ops in by_thread.values():
        stack = []
        for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            own[e["name"]] += e["dur"]
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
            stack.append(e)
    n = len(steps)
    lines = [f"| host op (top {top} by self time) | self ms / step | total ms / step | calls / step |",
             "|---|---|---|---|"]
    for name in sorted(own, key=lambda k: -own[k])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {own[name] / n / 1e3:.2f} | {total[name] / n / 1e3:.2f} | {calls[name] / n:.0f} |")
    return lines


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
    lines += ["", *idle_gaps(steps, kernels, events), "", *host_time(steps, events)]
    return "\n".join(lines) + "\n"
