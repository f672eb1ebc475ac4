"""Passkey retrieval of a run's latest checkpoint, as the trainer's `[passkey]` evaluation scores it.

    python scripts/eval_passkey.py runs/retrieval_nsa --min-length 512 --depths 5 --samples 8

Prints a markdown table of accuracy (rows: context lengths from --min-length doubling up to the run's
data.seq_len; columns: the needle's relative depth). Filler text comes from the run's held-out split.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nsa_training.config import ConfigError
from nsa_training.inference import score_passkey
from nsa_training.passkey import table
from nsa_training.watchdog import report_failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the job.run_dir of a training run")
    parser.add_argument("--min-length", type=int, default=256, help="shortest context, doubled up to data.seq_len")
    parser.add_argument("--depths", type=int, default=5, help="needle depths, evenly spaced from 0 to 1")
    parser.add_argument("--samples", type=int, default=4, help="keys per (length, depth)")
    parser.add_argument("--key-digits", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scores, path = score_passkey(args.run_dir, min_length=args.min_length, n_depths=args.depths,
                                     samples=args.samples, key_digits=args.key_digits, seed=args.seed,
                                     device=torch.device(args.device))
    except ConfigError as e:
        return report_failure(e)
    print(f"passkey accuracy of {path} ({args.samples} keys per cell)\n\n{table(scores)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
