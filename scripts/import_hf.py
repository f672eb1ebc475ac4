"""Turn an export of scripts/export.py back into a run directory that training resumes (fine-tunes) from.

    python scripts/import_hf.py exports/debug --run-dir runs/ft recipes/debug.toml --optimizer.lr 1e-4
    ./run.sh recipes/debug.toml --optimizer.lr 1e-4 --job.run_dir runs/ft        # resumes from its step 0

After DIR and --run-dir come a recipe and overrides, as train.py takes them: they set everything but the model and
the tokenizer, which are the export's. The run directory gets a step-0 checkpoint (the weights, a fresh optimizer
and LR schedule) written by the trainer's own checkpoint code, and its config.toml. Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nsa_training.config import ConfigError
from nsa_training.hf_export import import_export
from nsa_training.watchdog import RunFailed, report_failure


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s DIR --run-dir RUN "
                                     "[RECIPE.toml] [--section.key value ...]")
    parser.add_argument("export_dir", type=Path, help="a directory written by scripts/export.py")
    parser.add_argument("--run-dir", type=Path, required=True, help="the new run directory")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = import_export(args.export_dir, args.run_dir, train_args)
    except (ConfigError, RunFailed) as e:  # as train.py: bad input is 2, a failed write (disk full) 7
        return report_failure(e)
    print(f"imported {args.export_dir} as {path}; train on with the same recipe and overrides and "
          f"--job.run_dir {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
