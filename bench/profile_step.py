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
- per kernel family and per kernel: GPU ms per step, share of GPU busy time, launches per step and per block;
- where the GPU sat idle (the host op that launched the kernel after each gap), and the host's own time per op.
Prints markdown and writes OUT/profile.md; the raw trace stays under OUT/run/profile (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarking.kernels import summarize
from benchmarking.sweep import SYNTHETIC_DATA

ROOT = Path(__file__).resolve().parents[1]


def read_trace(folder: Path) -> list[dict]:
    traces = sorted(folder.rglob("*.pt.trace.json"))
    if not traces:
        raise SystemExit(f"error: no torch.profiler trace under {folder}: did the run reach its profiled steps?")
    return json.loads(traces[-1].read_text())["traceEvents"]


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
