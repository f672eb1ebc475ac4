"""Weak scaling on one host: throughput of each data-parallel plan on 1, 2, 4, ... GPUs at a fixed batch per GPU.

    python bench/scaling.py recipes/nsa_125m_ddp.toml --plans ddp fsdp --gpus 1 2 4 --steps 60 --warmup 10
    python bench/scaling.py recipes/nsa_1b_fsdp2.toml --plans fsdp hsdp --gpus 1 2 4 --dp-replicate 2  # 2 x 2 at 4
    python bench/scaling.py recipes/debug.toml --gpus 1 2 --set training.device=cpu --steps 4 --warmup 1  # gloo
    python bench/scaling.py recipes/nsa_125m.toml --plans fsdp --gpus 1 2 --context-parallel \
        --set data.seq_len=131072 --set model.max_seq_len=131072 --set training.micro_batch_size=1  # one sequence

Each GPU count N is one bench/compile_sweep.py sweep over the plans (parallelism.data_parallel = PLAN), every cell
launched as `PYTHON -m torch.distributed.run --standalone --nproc-per-node N train.py RECIPE ...` in a fresh process
group (hsdp cells also set parallelism.dp_replicate = --dp-replicate). Every rank keeps the recipe's micro-batch (or
--set's) and --grad-accum micro-batches per step, so training.global_batch_tokens = micro_batch_size * seq_len * N *
grad_accum grows with N. Data is synthetic (`benchmarking.sweep.SYNTHETIC_DATA`: GPT-2's vocabulary size, no
tokenizer file) unless --set data.source=... says otherwise. With one process train.py ignores the plan, so 1 GPU is
one cell (run with the first plan) whose row every plan shares: the unwrapped model, the baseline each plan's
communication and sharding overhead is measured against. With compile.mode = auto that cell uses CUDA graphs, which
FSDP2 and HSDP cannot: they share a second 1-GPU cell in compile.mode = default (`one_gpu_cells`). Writes
OUT/scaling.md and OUT/scaling.csv, one row per plan and N, and OUT/profile.md, the profiled steps' breakdown, on
top of each sweep's own files in OUT/<N>gpu/ (logs, tensorboard events: `tensorboard --logdir OUT`; torch.profiler
traces in <cell>/profile/, for https://ui.perfetto.dev).

Columns: tokens_per_s = the whole job's median tokens/s after --warmup; tokens_per_s_per_gpu = that / N;
efficiency = per-GPU tokens/s over the same plan's at its fewest GPUs (1.0: perfect weak scaling); peak_mem_gib
per GPU (max allocated on rank 0; peak RSS on CPU), mfu, compile_s, graph_breaks, recompiles, final_loss, status
and exit_code as compile_sweep reads them.

With --context-parallel the N GPUs of a cell share each sequence instead (parallelism.context_parallel_degree = N,
docs/CONTEXT_PARALLEL.md): the step's tokens stay those of one rank at every N (strong scaling of one sequence), and
efficiency = per-GPU tokens/s over one GPU's is the fraction of N x one GPU's throughput that N GPUs reach.

Communication (CUDA only): each cell records a torch.profiler trace of its last --profile-steps steps (late, so
that the profiler's own cost moves the steady median little) and `comm_breakdown` reads every rank's trace. On
the GPU timeline NCCL kernels (names `nccl...`) are communication and every other kernel is compute;
exposed_comm_ms = per step, the time some NCCL kernel runs while no compute kernel does (the union of the NCCL
intervals minus its overlap with the union of the compute intervals), on the rank where it is largest: what a
perfectly overlapped plan would not pay; comm_ms = the NCCL union per step. An NCCL kernel runs from its launch
until the peers' matching kernels have joined and the data has moved, so a rank that waits for a slower one (its
host launching later) counts that wait as communication; the profiler slows the hosts, so the profiled steps'
exposed time is an upper bound for the steady steps'. Overlapped communication still slows compute (NCCL takes SMs
and memory bandwidth): that shows as lost efficiency with little exposed time.
profile.md adds, per step, the wall time, the GPU's compute time, its idle time (no kernel running: the host
launching too slowly, or waiting) and the kernel time of all-gathers, reduce-scatters and all-reduces; kernels.md,
each cell's rank 0 by kernel family and kernel (bench/profile_step.py's tables), to compare where the GPU time of 1
and N GPUs goes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import get_args, get_type_hints

from benchmarking.kernels import summarize
from benchmarking.sweep import (
    REPO,
    SYNTHETIC_DATA,
    add_sweep_arguments,
    machine,
    parse_override,
    save_table,
    sweep_from_args,
)
from nsa_training.config import ConfigError, load_config
from parallelisms import resolve_compile_mode
from parallelisms.config import ParallelismConfig

COLUMNS = ["plan", "gpus", "cp", "global_batch_tokens", "tokens_per_s", "tokens_per_s_per_gpu", "efficiency",
           "peak_mem_gib", "exposed_comm_ms", "comm_ms", "mfu", "compile_s", "graph_breaks", "recompiles",
           "final_loss", "status", "exit_code", "cell", "error"]
PROFILE_COLUMNS = ["plan", "gpus", "cp", "step_ms", "compute_ms", "gpu_idle_ms", "comm_ms", "exposed_comm_ms",
                   "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "profiled_steps", "cell"]
COLLECTIVES = {"all_gather_ms": "allgather", "reduce_scatter_ms": "reducescatter", "all_reduce_ms": "allreduce"}
PLANS = get_args(get_type_hints(ParallelismConfig)["data_parallel"])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same time as `intervals` ((start, end) pairs)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_breakdown(trace: dict) -> dict[str, float] | None:
    """Per-step milliseconds of one rank's torch.profiler trace (chrome JSON): see the module docstring. None when
    the trace holds no profiler step or no GPU kernel (a CPU run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # The host's step spans; torch also marks each step on the GPU timeline (category gpu_user_annotation).
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not steps or not kernels:
        return None

    def is_comm(event: dict) -> bool:
        return event["name"].lower().startswith("nccl")

    def spans(selected: list[dict]) -> list[tuple[float, float]]:
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in selected])

    comm = [e for e in kernels if is_comm(e)]
    comm_spans, compute_spans = spans(comm), spans([e for e in kernels if not is_comm(e)])
    n, ms = len(steps), 1e-3  # per step; trace times are microseconds
    step_time = sum(e["dur"] for e in steps)
    result = {
        "step_ms": step_time / n * ms,
        "compute_ms": _length(compute_spans) / n * ms,
        "gpu_idle_ms": (step_time - _length(spans(kernels))) / n * ms,
        "comm_ms": _length(comm_spans) / n * ms,
        "exposed_comm_ms": (_length(comm_spans) - _overlap(comm_spans, compute_spans)) / n * ms,
        "profiled_steps": n}
    for column, kind in COLLECTIVES.items():
        result[column] = sum(e["dur"] for e in comm if kind in e["name"].lower().replace("_", "")) / n * ms
    return result


def read_traces(run_dir: Path) -> dict[str, dict]:
    """Every rank's torch.profiler trace in `run_dir`/profile, by file name (rank<i>.<...>.json), read once for
    both reports below (a trace of two long steps runs to tens of MB)."""
    return {path.name: json.loads(path.read_text()) for path in sorted((run_dir / "profile").glob("*.json"))}


def read_profiles(traces: dict[str, dict]) -> dict[str, float] | None:
    """comm_breakdown of every rank's trace, taken from the rank with the most exposed communication (the one the
    others wait for at the next collective); None without GPU traces."""
    ranks = [r for r in map(comm_breakdown, traces.values()) if r is not None]
    return max(ranks, key=lambda r: r["exposed_comm_ms"]) if ranks else None


def kernel_report(traces: dict[str, dict], n_layers: int) -> str | None:
    """`benchmarking.kernels.summarize` of rank 0's trace (GPU time per kernel family and per kernel, launches per
    block); None without GPU kernels (a CPU run)."""
    events = next((trace.get("traceEvents", []) for name, trace in traces.items() if name.startswith("rank0.")), [])
    if not any(e.get("ph") == "X" and e.get("cat") == "kernel" for e in events):
        return None
    return summarize(events, n_layers, top=15)


def tokens_per_rank(recipe: str, overrides: dict[str, str], grad_accum: int) -> int:
    """Tokens one rank trains on per step: micro_batch_size x seq_len (recipe, or --set) x grad_accum."""
    config, _ = load_config([recipe])
    values = {"training.micro_batch_size": config.training.micro_batch_size, "data.seq_len": config.data.seq_len}
    for key in values:
        if key in overrides:
            # Read here, not by load_config: the recipe's global_batch_tokens need not fit the new micro-batch.
            if not overrides[key].isdigit() or int(overrides[key]) < 1:
                raise ConfigError(f"--set {key}={overrides[key]}: expected a positive integer")
            values[key] = int(overrides[key])
    return values["training.micro_batch_size"] * values["data.seq_len"] * grad_accum


def torchrun(python: str, nproc: int) -> str:
    """The launcher of one cell: torchrun of `python` on one host, `nproc` ranks."""
    return shlex.join([python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "train.py"])


def one_gpu_cells(recipe: str, overrides: dict[str, str], plans: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """The 1-GPU cells and the plans each one is the baseline of. One process ignores the plan, so plans share a
    cell, except that `compile.mode = "auto"` gives one process CUDA graphs, which FSDP2 / HSDP cannot use on
    several GPUs: their baseline is a cell in the mode they run in (`default`), so that their efficiency measures
    communication and sharding, and the DDP / 1-GPU rows show what the CUDA graphs are worth."""
    # The recipe with the --set keys that decide the mode (the others may not fit the recipe's batch yet).
    config, _ = load_config([recipe, *(f"--{key}={value}" for key, value in overrides.items()
                                       if key.startswith("compile.") or key == "training.device")])
    compile_cfg, device = config.compile, config.training.device
    groups: dict[str, list[str]] = {}
    for plan in plans:
        several = resolve_compile_mode(compile_cfg, device_type=device, data_parallel=plan, world_size=2).mode
        one = resolve_compile_mode(compile_cfg, device_type=device, data_parallel=plan, world_size=1).mode
        groups.setdefault("" if not compile_cfg.enable or several == one else several, []).append(plan)
    return [({"parallelism.data_parallel": shared[0], **({"compile.mode": mode} if mode else {})}, shared)
            for mode, shared in groups.items()]


def plan_overrides(plan: str, dp_replicate: int, cp: int) -> dict[str, str]:
    """One plan's cell: parallelism.data_parallel, for hsdp its replica groups (train.py refuses a count that does
    not divide the GPUs, and that cell's row says so), and the context-parallel degree where it is not 1."""
    cell = {"parallelism.data_parallel": plan}
    if plan == "hsdp" and dp_replicate > 1:
        cell["parallelism.dp_replicate"] = str(dp_replicate)
    if cp > 1:
        cell["parallelism.context_parallel_degree"] = str(cp)
    return cell


def add_efficiency(rows: list[dict]) -> None:
    """Fill tokens_per_s_per_gpu, and efficiency against the same plan's row with the fewest GPUs."""
    for row in rows:
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / row["gpus"] if row.get("tokens_per_s", "") != "" else ""
    for row in rows:
        baseline = min((r for r in rows if r["plan"] == row["plan"]), key=lambda r: r["gpus"])
        if "" not in (row["tokens_per_s_per_gpu"], baseline["tokens_per_s_per_gpu"]):
            row["efficiency"] = row["tokens_per_s_per_gpu"] / baseline["tokens_per_s_per_gpu"]


def scaling(args: argparse.Namespace) -> list[dict]:
    """One sweep over the plans per GPU count; returns the COLUMNS rows (plan-major) and writes OUT/scaling.*."""
    for name, values in (("--plans", args.plans), ("--gpus", args.gpus)):
        if len(set(values)) != len(values):
            raise ConfigError(f"{name} {' '.join(map(str, values))}: repeated value; list each once")
    if min(args.gpus) < 1 or args.grad_accum < 1 or args.dp_replicate < 1:
        raise ConfigError(f"--gpus {' '.join(map(str, args.gpus))} --grad-accum {args.grad_accum} --dp-replicate "
                          f"{args.dp_replicate}: must be >= 1")
    unknown = [plan for plan in args.plans if plan not in PLANS]
    if unknown:
        raise ConfigError(f"--plans {' '.join(unknown)}: expected some of {', '.join(PLANS)}")
    if not 0 <= args.profile_steps < args.steps - args.warmup:
        raise ConfigError(f"--profile-steps {args.profile_steps}: must be >= 0 and leave unprofiled steady steps "
                          f"(fewer than --steps {args.steps} - --warmup {args.warmup})")
    if args.launcher:
        raise ConfigError("--launcher: scaling.py launches torchrun itself; choose its interpreter with --python")
    if args.devices:
        raise ConfigError("--devices: each scaling cell uses the first N GPUs; set CUDA_VISIBLE_DEVICES instead")
    overrides = dict(parse_override(text, "--set") for text in args.set)
    per_rank = tokens_per_rank(args.recipe, overrides, args.grad_accum)
    out = (args.out or REPO / "runs" / "scaling" / f"{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    out = out.resolve()

    profiling = (["profiling.enable=true", f"profiling.start_step={args.steps - args.profile_steps + 1}",
                  f"profiling.num_steps={args.profile_steps}"] if args.profile_steps else [])
    model_keys = [f"--{key}={value}" for key, value in overrides.items() if key.startswith("model.")]
    n_layers = load_config([args.recipe, *model_keys])[0].model.n_layers
    rows, reports = [], {}
    for gpus in args.gpus:
        cp = gpus if args.context_parallel else 1
        step_tokens = per_rank * gpus // cp  # each sequence counted once: cp ranks share it
        print(f"== {gpus} GPU(s), context-parallel degree {cp}: {step_tokens:,} tokens per step ==", flush=True)
        per_gpu_count = argparse.Namespace(**{
            **vars(args), "out": out / f"{gpus}gpu", "launcher": torchrun(args.python, gpus),
            "set": [*profiling, *args.set, f"training.global_batch_tokens={step_tokens}"]})
        if gpus == 1:  # one process: the plans share a cell per compile mode
            cells = one_gpu_cells(args.recipe, overrides, args.plans)
        else:
            cells = [(plan_overrides(plan, args.dp_replicate, cp), [plan]) for plan in args.plans]
        results = sweep_from_args(per_gpu_count, args.recipe, [[cell for cell, _ in cells]])
        for row, (_, shared_by) in zip(results, cells, strict=True):
            cell = f"{gpus}gpu/{row['cell']}"
            traces = read_traces(out / cell)
            reports[cell] = kernel_report(traces, n_layers)
            row = {**row, **(read_profiles(traces) or {}), "gpus": gpus, "cp": cp,
                   "global_batch_tokens": step_tokens, "cell": cell}
            rows += [{**row, "plan": plan} for plan in shared_by]
    rows.sort(key=lambda row: (args.plans.index(row["plan"]), row["gpus"]))
    reports = {cell: report for cell, report in reports.items() if report}
    if reports:
        (out / "kernels.md").write_text("".join(f"## {cell}\n\n{report}\n" for cell, report in reports.items()))
    add_efficiency(rows)

    scaling_kind = (f"Context parallelism (N GPUs share each sequence) of `{args.recipe}`: {per_rank:,} tokens per step"
                    if args.context_parallel else
                    f"Weak scaling of `{args.recipe}`: {per_rank:,} tokens per GPU per step")
    header = (f"{scaling_kind}, {args.steps} steps, medians after {args.warmup}; overrides {' '.join(args.set)}; "
              f"{time.strftime('%Y-%m-%d')}.\n{machine()}"
              "efficiency: per-GPU tokens/s over the same plan's on its fewest GPUs; peak_mem_gib per GPU; "
              f"exposed_comm_ms and comm_ms per step, from a trace of the last {args.profile_steps} steps.\n\n")
    table = save_table(out, "scaling", header, rows, COLUMNS)
    profile_header = (f"Profile of the last {args.profile_steps} steps of each cell of `{args.recipe}` "
                      "(bench/scaling.py docstring), milliseconds per step, on the rank with the most exposed "
                      "communication.\n\n")
    profiles = save_table(out, "profile", profile_header, [r for r in rows if r.get("step_ms", "") != ""],
                          PROFILE_COLUMNS)
    print("\n" + table + "\n" + profiles + f"\nsaved {out / 'scaling.md'}, {out / 'scaling.csv'} and "
          f"{out / 'profile.md'}" + (f"; rank 0's GPU time by kernel family: {out / 'kernels.md'}" if reports else ""),
          flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe .toml file")
    parser.add_argument("--plans", nargs="+", default=["ddp", "fsdp"], help="values of parallelism.data_parallel")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="process counts (one GPU each)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--dp-replicate", type=int, default=2,
                        help="the hsdp plan's replica groups (parallelism.dp_replicate; 2 on 4 GPUs: 2 x 2)")
    parser.add_argument("--context-parallel", action="store_true",
                        help="N GPUs share each sequence (context_parallel_degree = N) instead of each taking its own")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="profile each cell's last N steps for the communication columns (0: none)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs torchrun and train.py")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    args.set = [*SYNTHETIC_DATA, *args.set]  # later --set wins
    try:
        scaling(args)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
