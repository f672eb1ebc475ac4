"""Export a run's checkpoint as a transformers model directory (safetensors, config, tokenizer, modeling code).

    python scripts/export.py runs/debug --out exports/debug                  # the newest checkpoint, fp32
    python scripts/export.py runs/debug --out exports/debug --dtype bf16 --step 100

Load it with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` (the `nsa_models` package must be
installed). `scripts/import_hf.py` turns an export back into a run directory. Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nsa_training.config import ConfigError
from nsa_training.hf_export import DTYPES, export_run
from nsa_training.watchdog import report_failure


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the job.run_dir of a training run")
    parser.add_argument("--out", type=Path, required=True, help="the export directory (created if missing)")
    parser.add_argument("--dtype", default="fp32", help=f"weights' dtype: {' or '.join(DTYPES)}")
    parser.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest that verifies)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # Checked before anything is read, so the options' errors come first (and without the hf extra).
        if args.dtype not in DTYPES:
            raise ConfigError(f"--dtype {args.dtype!r}: unknown; choose {' or '.join(DTYPES)}")
        if args.step is not None and args.step < 0:
            raise ConfigError(f"--step {args.step}: must be >= 0")
        path = export_run(args.run_dir, args.out, DTYPES[args.dtype], args.step)
    except ConfigError as e:
        return report_failure(e)
    print(f"exported {path} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
