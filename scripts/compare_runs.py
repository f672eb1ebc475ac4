"""Compare one tensorboard scalar of two runs step by step: a resumed run against an uninterrupted one, or two
data-parallel plans on the same batches.

    python scripts/compare_runs.py runs/uninterrupted runs/killed_and_resumed --from-step 251
    python scripts/compare_runs.py RUN_A RUN_B --tag train/loss --rtol 1e-2   # exit 1 beyond the tolerance

RUN_A / RUN_B are runs' job.run_dir (events in RUN/tb) or folders of event files; a resumed run's events hold the
value its restart logged for every step it redid. Prints the steps both runs logged from --from-step on, how many
are bitwise equal, the largest absolute and relative difference and where, and a few rows (first, largest
difference, last). Exit status: 0 compared (and within --rtol if given); 1 a difference beyond --rtol; 2 bad input
(one `error:` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nsa_training.config import ConfigError  # noqa: E402
from scripts.plot_tb import read_scalars  # noqa: E402


def compare(a: dict[int, float], b: dict[int, float], from_step: int) -> tuple[list[int], dict[str, float]]:
    """The common steps (>= from_step) and the summary: steps, bitwise-equal steps, max abs / rel difference and the
    step of the largest relative one."""
    steps = sorted(s for s in a.keys() & b.keys() if s >= from_step)
    if not steps:
        raise ConfigError(f"the runs logged no common step at or after --from-step {from_step}")
    diffs = {s: abs(a[s] - b[s]) for s in steps}
    rel = {s: diffs[s] / max(abs(a[s]), 1e-30) for s in steps}
    worst = max(steps, key=rel.__getitem__)
    return steps, {"steps": len(steps), "equal": sum(diffs[s] == 0 for s in steps), "max_abs": max(diffs.values()),
                   "max_rel": rel[worst], "worst_step": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--tag", default="train/loss", help="scalar to compare (default train/loss)")
    parser.add_argument("--from-step", type=int, default=1, help="first step compared")
    parser.add_argument("--rtol", type=float, default=None, help="exit 1 if a relative difference exceeds it")
    args = parser.parse_args(argv)
    try:
        curves = []
        for run in (args.run_a, args.run_b):
            scalars = read_scalars(run)
            if args.tag not in scalars:
                raise ConfigError(f"--tag {args.tag}: {run} did not log it (it has {', '.join(sorted(scalars))})")
            curves.append(dict(zip(*scalars[args.tag], strict=True)))
        steps, summary = compare(*curves, args.from_step)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    a, b = curves
    print(f"{args.tag}: {args.run_a} (A) vs {args.run_b} (B), steps {steps[0]}-{steps[-1]}: {summary['steps']} "
          f"common, {summary['equal']} bitwise equal; max |A-B| {summary['max_abs']:.3g}, max relative "
          f"{summary['max_rel']:.3g} (step {summary['worst_step']})")
    print("| step | A | B | A - B |\n|---|---|---|---|")
    for step in sorted({steps[0], summary["worst_step"], steps[-1]}):
        print(f"| {step} | {a[step]:.6f} | {b[step]:.6f} | {a[step] - b[step]:.3g} |")
    if args.rtol is not None and summary["max_rel"] > args.rtol:
        print(f"relative difference {summary['max_rel']:.3g} > --rtol {args.rtol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
