"""Where one training step's time goes: GPU time per kernel family, launches per block, host versus GPU time.

    python bench/profile_step.py recipes/nsa_125m.toml --seq-len 2048
    python bench/profile_step.py recipes/dense_125m.toml --seq-len 32768 --set compile.mode=reduce-overhead

Trains the recipe for a few steps through train.py (synthetic data as bench/e2e.py has it, one micro-batch of
--tokens-per-micro-batch tokens per step, no checkpoints, no evaluation) with its torch.profiler trace on
(`profiling.*`), then reads the trace. Per profiled step:
- **GPU busy**: the union of all kernel intervals; **step**: the ProfilerStep span on the host thread. A step
  much longer than its GPU busy time is host-bound (the GPU waits for launches) or sync-bound.
- **host enqueue**: from the step's start to the end of its last kernel launch call on the host: when it is
  close to the step time, the host cannot launch faster than the GPU runs (CUDA graphs help there).
- per kernel family and per kernel: GPU ms per step, share of GPU busy time, launches per step and per block.
Prints markdown and writes OUT/profile.md; the raw trace stays under OUT/run/profile (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from benchmarking.sweep import SYNTHETIC_DATA

ROOT = Path(__file__).resolve().parents[1]
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


def read_trace(folder: Path) -> list[dict]:
    traces = sorted(folder.rglob("*.pt.trace.json"))
    if not traces:
        raise SystemExit(f"error: no torch.profiler trace under {folder}: did the run reach its profiled steps?")
    return json.loads(traces[-1].read_text())["traceEvents"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tokens-per-micro-batch", type=int, default=32768)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the profiled ones (compilation)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed by GPU time")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe override")
    parser.add_argument("--out", type=Path, default=Path("runs/profile_step"))
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.tokens_per_micro_batch % args.seq_len:
        parser.error("--seq-len must divide --tokens-per-micro-batch")
    steps = args.warmup + args.profile_steps
    overrides = dict(kv.split("=", 1) for kv in SYNTHETIC_DATA)  # GPT-2's vocabulary size, no tokenizer file
    overrides |= {"data.seq_len": args.seq_len, "model.max_seq_len": args.seq_len,
                 "training.micro_batch_size": args.tokens_per_micro_batch // args.seq_len,
                 "training.global_batch_tokens": args.tokens_per_micro_batch, "training.steps": steps,
                 "lr_scheduler.warmup_steps": 1, "training.eval_interval": 0, "checkpoint.enable": "false",
                 "checkpoint.resume": "false", "profiling.enable": "true", "profiling.start_step": args.warmup + 1,
                 "profiling.num_steps": args.profile_steps, "job.run_dir": args.out / "run"}
    overrides.update(kv.split("=", 1) for kv in args.set)
    command = [sys.executable, str(ROOT / "train.py"), args.recipe, *(f"--{k}={v}" for k, v in overrides.items())]
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode:
        return done.returncode
    config = subprocess.run([*command, "--print-config"], cwd=ROOT, capture_output=True, text=True).stdout
    n_layers = int(re.search(r"^n_layers = (\d+)", config, re.M).group(1))
    report = (f"## {args.recipe} at T = {args.seq_len} ({args.tokens_per_micro_batch:,} tokens per step)\n\n"
              + summarize(read_trace(args.out / "run" / "profile"), n_layers, args.top))
    print(report)
    (args.out / "profile.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
