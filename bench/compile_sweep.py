"""Run train.py once per cell of a grid of overrides and compare compile time, throughput, memory and loss.

    python bench/compile_sweep.py recipes/nsa_125m.toml --grid compile.mode=default,max-autotune \
        --grid activation_checkpoint.mode=none,full --set data.source=synthetic --set data.document_mask=false \
        --steps 20 --warmup 5 --devices 0 1 2 3
    python bench/compile_sweep.py recipes/nsa_125m_fsdp2.toml --grid compile.enable=false,true \
        --launcher "NGPU=2 ./run.sh"

Every combination of the --grid overrides (each --grid one axis) runs train.py in a fresh process with its own
inductor cache (unless --keep-inductor-cache); --devices runs cells concurrently, one per GPU set. What a sweep
writes under OUT (sweep.md, sweep.csv, each cell's log and tensorboard hparams) and its columns:
`benchmarking.sweep`, which bench/e2e.py and bench/scaling.py run too.
"""

from __future__ import annotations

import argparse
import sys

from benchmarking.sweep import Overrides, add_sweep_arguments, parse_override, sweep_from_args
from nsa_training.config import ConfigError
from nsa_training.watchdog import report_failure


def parse_grid(text: str) -> list[Overrides]:
    """`key=v1,v2,...` -> one axis of the grid: [{key: v1}, {key: v2}, ...]."""
    key, values = parse_override(text, "--grid")
    if not all(values.split(",")):
        raise ConfigError(f"--grid {text!r}: empty value; write KEY=V1,V2,...")
    return [{key: value} for value in values.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe .toml file")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="one axis of the grid; cells are the cartesian product of all axes")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    try:
        sweep_from_args(args, args.recipe, [parse_grid(text) for text in args.grid])
    except ConfigError as e:
        return report_failure(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
