"""Passkey retrieval beyond the sliding window: an NSA model against its window-only twin, in one table.

    python bench/retrieval.py --devices 0 1                       # both runs at once, one GPU each
    python bench/retrieval.py --steps 600 --set training.eval_interval=300  # shorter

Trains `--recipe` (recipes/retrieval_nsa.toml) twice through the sweep machinery (`nsa_training.sweep`, as
bench/e2e.py does): as it is, and with model.nsa.window_only = true, the one difference. Then scores each run's
final checkpoint as scripts/eval_passkey.py does (held-out haystacks, lengths from --min-length doubling up to
data.seq_len, --depths needle depths, --samples keys per cell) and prints one markdown table of teacher-forced
accuracy on the key's tokens: rows are lengths, columns depths, each cell "NSA / window-only". Writes it, under a
header naming the command, the window and the machine, to OUT/retrieval.md, and the last [passkey] heat map each run
logged to tensorboard (rows lengths, columns depths; red 0, green 1) to OUT/heat_map_nsa.png and
OUT/heat_map_window_only.png, beside the sweep's own files (each run's checkpoints, output.log and tensorboard events,
in OUT/<cell>).

Exit status: 0 done; 1 a run failed (its error line is printed; no table); 2 bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from nsa_training.config import ConfigError, load_config
from nsa_training.inference import score_passkey
from nsa_training.passkey import HEAT_MAP_TAG, PasskeyScore
from nsa_training.sweep import add_sweep_arguments, machine, sweep_from_args

ABLATION = "model.nsa.window_only"
CELLS = [{ABLATION: "false"}, {ABLATION: "true"}]  # the NSA run, then its window-only twin
LABELS = ["nsa", "window_only"]


def comparison_table(nsa: Sequence[PasskeyScore], window_only: Sequence[PasskeyScore]) -> str:
    """Markdown: one row per length, one column per depth, each cell "NSA accuracy / window-only accuracy", and the
    mean over depths; both runs scored at the same lengths and depths."""
    def grid(scores: Sequence[PasskeyScore]) -> dict[tuple[int, float], float]:
        return {(s.length, s.depth): s.accuracy for s in scores}

    a, b = grid(nsa), grid(window_only)
    if a.keys() != b.keys():
        raise ValueError("the two runs were scored at different lengths or depths")
    lengths, depth_values = sorted({k[0] for k in a}), sorted({k[1] for k in a})
    lines = ["| length | " + " | ".join(f"depth {d:.2f}" for d in depth_values) + " | mean |",
             "|---" * (len(depth_values) + 2) + "|"]
    for length in lengths:
        cells = [(a[length, d], b[length, d]) for d in depth_values]
        mean = tuple(sum(c[i] for c in cells) / len(cells) for i in (0, 1))
        lines.append(f"| {length} | " + " | ".join(f"{x:.2f} / {y:.2f}" for x, y in [*cells, mean]) + " |")
    return "\n".join(lines) + "\n"


def save_heat_maps(out: Path, cells: Sequence[str]) -> list[Path]:
    """The last [passkey] heat map of each run's tensorboard events (PNG, as logged) as OUT/heat_map_<label>.png;
    runs that logged none (no evaluation ran) are left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    saved = []
    for label, cell in zip(LABELS, cells):
        events = EventAccumulator(str(out / cell / "tb"), size_guidance={"images": 0})  # 0: keep every image
        events.Reload()
        if HEAT_MAP_TAG in events.Tags()["images"]:
            saved.append(out / f"heat_map_{label}.png")
            saved[-1].write_bytes(events.Images(HEAT_MAP_TAG)[-1].encoded_image_string)
    return saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/retrieval_nsa.toml", help="the NSA run's recipe")
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
        # The recipe with every --set, checked before anything trains (the sweep passes the same values on).
        config, _ = load_config([args.recipe, *(f"--{text}" for text in args.set)])
        args.steps = args.steps or config.training.steps
        min_length = args.min_length or config.passkey.min_length
        rows = sweep_from_args(args, args.recipe, [CELLS], measure_only=False)
        failed = [row for row in rows if row["status"] != "ok"]
        for row in failed:
            print(f"error: run {row['cell']} failed (exit {row['exit_code']}): {row['error']}", file=sys.stderr)
        if failed:
            return 1
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        nsa, window_only = (score_passkey(args.out / row["cell"], min_length=min_length, n_depths=args.depths,
                                          samples=args.samples, key_digits=args.key_digits, seed=args.seed,
                                          device=device)[0] for row in rows)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = comparison_table(nsa, window_only)
    header = (f"Passkey accuracy, NSA / window-only ({ABLATION} = true), {args.samples} keys of {args.key_digits} "
              f"digits per cell, after {args.steps} steps of `{args.recipe}` (window_size "
              f"{config.model.nsa.window_size}, data.seq_len {config.data.seq_len}).\n"
              f"Command: `python bench/retrieval.py {shlex.join(sys.argv[1:] if argv is None else argv)}`\n"
              f"{machine()}\n")
    (args.out / "retrieval.md").write_text(header + table)
    saved = [args.out / "retrieval.md", *save_heat_maps(args.out, [row["cell"] for row in rows])]
    print("\n" + header + table + f"\nsaved {', '.join(map(str, saved))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
