"""Passkey retrieval beyond the sliding window: an NSA model, its window-only twin and its dense twin, over seeds.

    python bench/retrieval.py --devices 0 1 2                     # three runs at once, one GPU each
    python bench/retrieval.py --seeds 1 --steps 600 --set training.eval_interval=300  # shorter

Trains `--recipe` (recipes/retrieval_nsa.toml) through the sweep machinery (`benchmarking.sweep`, as bench/e2e.py
does) as three arms: as it is (NSA); with model.nsa.window_only = true (the window branch alone: it cannot see a
needle beyond the window); and with model.attention = dense (full causal attention: the ceiling), each with
--seeds training seeds. Then scores each run's final checkpoint as scripts/eval_passkey.py does (held-out
haystacks, lengths from --min-length doubling up to data.seq_len, --depths needle depths, --samples keys per cell)
and prints, per arm, a markdown table of teacher-forced accuracy on the key's tokens: rows are lengths, columns
depths, each cell the mean over seeds and, with several seeds, their range. Writes the tables, under a header naming
the command, the window and the machine, to OUT/retrieval.md, and per arm a labelled heat map of the seeds' mean
(lengths x depths, the values in the cells, a colour bar) to OUT/heat_map_<arm>.png, beside the sweep's own files
(each run's checkpoints, output.log and tensorboard events, in OUT/<cell>).

Exit status: 0 done; 1 a run failed (its error line is printed; no table); 2 bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

import torch

from benchmarking.sweep import add_sweep_arguments, machine, sweep_from_args
from nsa_training.config import ConfigError, load_config
from nsa_training.inference import score_passkey
from nsa_training.passkey import PasskeyScore, heat_map_figure
from nsa_training.watchdog import report_failure

# The arms, each the one set of overrides that makes it: NSA as the recipe has it, the window branch alone, dense.
ARMS = {
    "nsa": {"model.attention": "nsa", "model.nsa.window_only": "false"},
    "window_only": {"model.attention": "nsa", "model.nsa.window_only": "true"},
    "dense": {"model.attention": "dense", "model.nsa.window_only": "false"},
}

Grid = dict[tuple[int, float], list[float]]  # (length, depth) -> one accuracy per seed


def accuracy_grid(runs: Sequence[Sequence[PasskeyScore]]) -> Grid:
    """Per (length, depth), the accuracy of each run (one run per seed); ValueError unless every run was scored at
    the same lengths and depths."""
    cells = {(s.length, s.depth) for s in runs[0]}
    grid: Grid = {cell: [] for cell in cells}
    for scores in runs:
        if {(s.length, s.depth) for s in scores} != cells:
            raise ValueError("the runs were scored at different lengths or depths")
        for s in scores:
            grid[s.length, s.depth].append(s.accuracy)
    return grid


def _cell(values: Sequence[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})"


def arm_table(grid: Grid) -> str:
    """Markdown: one row per length, one column per depth and the mean over depths; each cell the mean accuracy over
    the seeds and, with several, their range (min-max; the row mean's range is over the seeds' row means)."""
    lengths, depth_values = sorted({k[0] for k in grid}), sorted({k[1] for k in grid})
    lines = ["| length | " + " | ".join(f"depth {d:.2f}" for d in depth_values) + " | mean |",
             "|---" * (len(depth_values) + 2) + "|"]
    for length in lengths:
        row = [grid[length, d] for d in depth_values]
        seed_means = [sum(cell[i] for cell in row) / len(row) for i in range(len(row[0]))]
        lines.append(f"| {length} | " + " | ".join(_cell(values) for values in [*row, seed_means]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/retrieval_nsa.toml", help="the NSA run's recipe")
    parser.add_argument("--seeds", type=int, default=2, help="training seeds per arm (training.seed 0, 1, ...)")
    parser.add_argument("--min-length", type=int, default=None,
                        help="shortest scored context, doubled up to data.seq_len (default: the recipe's "
                             "passkey.min_length)")
    parser.add_argument("--depths", type=int, default=5, help="needle depths, evenly spaced from 0 to 1")
    parser.add_argument("--samples", type=int, default=16, help="keys per (length, depth)")
    parser.add_argument("--key-digits", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the scored keys")
    parser.add_argument("--device", default=None, help="where the checkpoints are scored (default: cuda if any)")
    add_sweep_arguments(parser)
    parser.set_defaults(steps=None, warmup=0)  # the recipe's steps; no throughput medians are read here
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.seeds < 1:
            raise ConfigError(f"--seeds {args.seeds}: must be at least 1")
        # The recipe with every --set, checked before anything trains (the sweep passes the same values on).
        config, _ = load_config([args.recipe, *(f"--{text}" for text in args.set)])
        args.steps = args.steps or config.training.steps
        min_length = args.min_length or config.passkey.min_length
        seeds = [{"training.seed": str(seed)} for seed in range(args.seeds)]
        rows = sweep_from_args(args, args.recipe, [list(ARMS.values()), seeds], measure_only=False)
        failed = [row for row in rows if row["status"] != "ok"]
        for row in failed:
            print(f"error: run {row['cell']} failed (exit {row['exit_code']}): {row['error']}", file=sys.stderr)
        if failed:
            return 1
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        scores = [score_passkey(args.out / row["cell"], min_length=min_length, n_depths=args.depths,
                                samples=args.samples, key_digits=args.key_digits, seed=args.seed, device=device)[0]
                  for row in rows]
    except ConfigError as e:
        return report_failure(e)
    # The sweep's rows are the arms' seeds in order: arm-major, as the grid's first axis.
    grids = {arm: accuracy_grid(scores[i * args.seeds:(i + 1) * args.seeds]) for i, arm in enumerate(ARMS)}
    header = (f"Passkey accuracy, {args.samples} keys of {args.key_digits} digits per cell, after {args.steps} steps "
              f"of `{args.recipe}` (window_size {config.model.nsa.window_size}, data.seq_len {config.data.seq_len}); "
              f"each cell the mean over {args.seeds} training seed(s)"
              + (" and their range" if args.seeds > 1 else "") + ".\n"
              f"Command: `python bench/retrieval.py {shlex.join(sys.argv[1:] if argv is None else argv)}`\n"
              f"{machine()}\n")
    tables = "".join(f"\n{arm} ({', '.join(f'{k} = {v}' for k, v in overrides.items())}):\n\n{arm_table(grids[arm])}"
                     for arm, overrides in ARMS.items())
    (args.out / "retrieval.md").write_text(header + tables)
    saved = [args.out / "retrieval.md"]
    for arm, grid in grids.items():
        saved.append(args.out / f"heat_map_{arm}.png")
        mean = {cell: sum(values) / len(values) for cell, values in grid.items()}
        heat_map_figure(mean, f"passkey accuracy, {arm} (window {config.model.nsa.window_size})").savefig(saved[-1])
    print("\n" + header + tables + f"\nsaved {', '.join(map(str, saved))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
