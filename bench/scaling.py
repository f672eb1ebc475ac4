"""Weak scaling on one host: throughput of each data-parallel plan on 1, 2, 4, ... GPUs at a fixed batch per GPU.

    python bench/scaling.py recipes/nsa_125m_ddp.toml --plans ddp fsdp --gpus 1 2 4 --steps 60 --warmup 10
    python bench/scaling.py recipes/debug.toml --gpus 1 2 --set training.device=cpu --steps 4 --warmup 1  # gloo

Each GPU count N is one bench/compile_sweep.py sweep over the plans (parallelism.data_parallel = PLAN), every cell
launched as `PYTHON -m torch.distributed.run --standalone --nproc-per-node N train.py RECIPE ...` in a fresh
process group. Every rank keeps the recipe's micro-batch (or --set's) and --grad-accum micro-batches per step, so
training.global_batch_tokens = micro_batch_size * seq_len * N * grad_accum grows with N. Data is synthetic unless
--set data.source=... says otherwise. Writes OUT/scaling.md and OUT/scaling.csv, one row per plan and N, on top
of each sweep's own files in OUT/<N>gpu/ (logs, tensorboard events: `tensorboard --logdir OUT`).

Columns: tokens_per_s = the whole job's median tokens/s after --warmup; tokens_per_s_per_gpu = that / N;
efficiency = per-GPU tokens/s over the same plan's at its fewest GPUs (1.0: perfect weak scaling); peak_mem_gib
(max allocated on rank 0, peak RSS on CPU), mfu, compile_s, graph_breaks, recompiles, final_loss, status and
exit_code as compile_sweep reads them. With one process train.py ignores the plan: the 1-GPU rows are the
unwrapped model, the baseline each plan's communication and sharding overhead is measured against.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_sweep import REPO, ConfigError, add_sweep_arguments, parse_override, save_table, sweep_from_args  # noqa: E402

from nsa_training.config import load_config  # noqa: E402  (compile_sweep put the repo on sys.path)

COLUMNS = ["plan", "gpus", "global_batch_tokens", "tokens_per_s", "tokens_per_s_per_gpu", "efficiency",
           "peak_mem_gib", "mfu", "compile_s", "graph_breaks", "recompiles", "final_loss", "status", "exit_code",
           "cell", "error"]


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
    if min(args.gpus) < 1 or args.grad_accum < 1:
        raise ConfigError(f"--gpus {' '.join(map(str, args.gpus))} --grad-accum {args.grad_accum}: must be >= 1")
    if args.launcher:
        raise ConfigError("--launcher: scaling.py launches torchrun itself; choose its interpreter with --python")
    if args.devices:
        raise ConfigError("--devices: each scaling cell uses the first N GPUs; set CUDA_VISIBLE_DEVICES instead")
    overrides = dict(parse_override(text, "--set") for text in args.set)
    per_rank = tokens_per_rank(args.recipe, overrides, args.grad_accum)
    out = (args.out or REPO / "runs" / "scaling" / f"{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    out = out.resolve()

    rows = []
    for gpus in args.gpus:
        print(f"== {gpus} GPU(s): {per_rank * gpus:,} tokens per step ==", flush=True)
        per_gpu_count = argparse.Namespace(**{
            **vars(args), "out": out / f"{gpus}gpu", "launcher": torchrun(args.python, gpus),
            "set": [*args.set, f"training.global_batch_tokens={per_rank * gpus}"]})
        plan_axis = [{"parallelism.data_parallel": plan} for plan in args.plans]
        for row in sweep_from_args(per_gpu_count, args.recipe, [plan_axis]):
            rows.append({**row, "plan": row["parallelism.data_parallel"], "gpus": gpus,
                         "global_batch_tokens": per_rank * gpus, "cell": f"{gpus}gpu/{row['cell']}"})
    rows.sort(key=lambda row: (args.plans.index(row["plan"]), row["gpus"]))
    add_efficiency(rows)

    header = (f"Weak scaling of `{args.recipe}`: {per_rank:,} tokens per GPU per step, {args.steps} steps, medians "
              f"after {args.warmup}; overrides {' '.join(args.set)}; {time.strftime('%Y-%m-%d')}.\n"
              "efficiency: per-GPU tokens/s over the same plan's on its fewest GPUs.\n\n")
    table = save_table(out, "scaling", header, rows, COLUMNS)
    print("\n" + table + f"\nsaved {out / 'scaling.md'} and {out / 'scaling.csv'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe .toml file")
    parser.add_argument("--plans", nargs="+", default=["ddp", "fsdp"], help="values of parallelism.data_parallel")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="process counts (one GPU each)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs torchrun and train.py")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    args.set = ["data.source=synthetic", *args.set]  # later --set wins
    try:
        scaling(args)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
