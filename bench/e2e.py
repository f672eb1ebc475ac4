"""End-to-end training throughput of NSA against its dense twin at several sequence lengths, on one GPU.

    python bench/e2e.py                                    # nsa-125m vs dense-125m at T = 2048, 8192, 32768
    python bench/e2e.py --seq-lens 2048 8192 --steps 30 --set training.global_batch_tokens=262144

A thin wrapper over the sweep of bench/compile_sweep.py (`benchmarking.sweep`): the grid is flavor x T, where each T
also sets model.max_seq_len = T and training.micro_batch_size = --tokens-per-micro-batch / T, so every cell does the
same work per step in tokens and only attention's cost changes with T. Data is `synthetic`
(`benchmarking.sweep.SYNTHETIC_DATA`: GPT-2's vocabulary size, no tokenizer file) unless --set data.source=... says
otherwise (throughput does not depend on the text); the window is FlexAttention's unless --set
model.nsa.window_backend=... says otherwise (it runs every T: the recipes' fused_with_selected stops at 4096).
Prints and saves (OUT/e2e.md) tokens/s per flavor and the ratio of the first flavor to the second per T, on top of
the sweep's own table and files.

Each optimizer step ends in a device sync (the trainer's finiteness check), so with one micro-batch per step
(`--set training.global_batch_tokens` = --tokens-per-micro-batch) the host cannot run ahead into the next step:
at short T, where enqueueing an NSA step takes the host most of the step's GPU time, a slower host then shows as
a slower run. Compare with several micro-batches per step, repeat the runs, or take the host out with CUDA graphs
(`--set compile.mode=reduce-overhead`); measured figures in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import sys

from benchmarking.sweep import SYNTHETIC_DATA, add_sweep_arguments, sweep_from_args
from nsa_training.config import ConfigError
from nsa_training.watchdog import report_failure


def seq_len_axis(seq_lens: list[int], tokens_per_micro_batch: int) -> list[dict[str, str]]:
    """One grid axis: per T, the sequence length, the RoPE table to match and a micro-batch of constant tokens."""
    axis = []
    for T in seq_lens:
        if T <= 0 or tokens_per_micro_batch % T:
            raise ConfigError(f"--seq-lens {T}: must divide --tokens-per-micro-batch ({tokens_per_micro_batch}) "
                              "so that every T trains on the same tokens per micro-batch")
        axis.append({"data.seq_len": str(T), "model.max_seq_len": str(T),
                     "training.micro_batch_size": str(tokens_per_micro_batch // T)})
    return axis


def ratio_table(rows: list[dict], flavors: list[str], seq_lens: list[int]) -> str:
    """Markdown: tokens/s of each flavor per T and first / second ("" where a cell failed)."""
    tokens_per_s = {(row["model.flavor"], int(row["data.seq_len"])): row.get("tokens_per_s", "") for row in rows}
    lines = [f"| T | {' | '.join(f'{f} tokens/s' for f in flavors)} | {flavors[0]} / {flavors[1]} |",
             "|---|" + "---|" * (len(flavors) + 1)]
    for T in seq_lens:
        values = [tokens_per_s.get((f, T), "") for f in flavors]
        ratio = f"{values[0] / values[1]:.2f}" if "" not in values[:2] else ""
        lines.append(f"| {T} | {' | '.join(f'{v:,.0f}' if v != '' else 'failed' for v in values)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/nsa_125m.toml",
                        help="base recipe (compile, precision, optimizer, global batch)")
    parser.add_argument("--flavors", nargs=2, default=["nsa-125m", "dense-125m"], metavar=("NSA", "DENSE"),
                        help="the two model flavors compared; the ratio is the first over the second")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--tokens-per-micro-batch", type=int, default=32768,
                        help="micro_batch_size x seq_len of every cell (the recipes' 16 x 2048)")
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    # The FlexAttention window unless --set says otherwise: it runs every T (the recipes' fused_with_selected stops
    # at 4096 tokens), and the tables in docs/PERFORMANCE.md name the window backend of each row.
    args.set = [*SYNTHETIC_DATA, "model.nsa.window_backend=flex", *args.set]  # later --set wins
    try:
        axes = [[{"model.flavor": f} for f in args.flavors], seq_len_axis(args.seq_lens, args.tokens_per_micro_batch)]
        rows = sweep_from_args(args, args.recipe, axes)
    except ConfigError as e:
        return report_failure(e)
    table = ratio_table(rows, args.flavors, args.seq_lens)
    (args.out / "e2e.md").write_text(table)
    print("\n" + table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
