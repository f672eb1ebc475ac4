"""Plot NSA against dense training throughput by sequence length from a CSV of measured results.

    python scripts/plot_results.py                     # docs/e2e_results.csv -> docs/e2e_nsa_vs_dense.png

The CSV holds one row per sequence length (columns gpu, date, seq_len, nsa_tokens_per_s, dense_tokens_per_s,
activation_checkpoint, window_backend, source), copied from docs/PERFORMANCE.md. Both models' tokens/s go on a
log-log plot with the NSA / dense ratio written above each length; lengths measured with activation checkpointing
get hollow markers and a line of their own. Needs matplotlib (`pip install -e .[plot]`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def read_results(path: Path) -> list[dict[str, str]]:
    """The CSV's rows, sorted by sequence length."""
    with path.open(newline="") as f:
        return sorted(csv.DictReader(f), key=lambda row: int(row["seq_len"]))


def plot(rows: list[dict[str, str]], out: Path) -> None:
    """Tokens/s of both models against T, the ratio annotated; written to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = [int(r["seq_len"]) for r in rows]
    nsa = [float(r["nsa_tokens_per_s"]) for r in rows]
    dense = [float(r["dense_tokens_per_s"]) for r in rows]
    checkpointed = [r["activation_checkpoint"] != "none" for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, values, color in (("nsa-125m", nsa, "tab:blue"), ("dense-125m", dense, "tab:gray")):
        # One line per AC mode: the step between modes is not the sequence length's alone.
        for hollow in (False, True):
            points = [(t, v) for t, v, c in zip(T, values, checkpointed) if c == hollow]
            if points:
                ax.plot(*zip(*points), "o-", color=color, markerfacecolor="white" if hollow else color,
                        label=None if hollow else name)
    for t, a, b in zip(T, nsa, dense):
        ax.annotate(f"{a / b:.2f}x", (t, max(a, b)), textcoords="offset points", xytext=(0, 9), ha="center",
                    fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.margins(y=0.12)  # room for the top ratio
    ax.set_xticks(T, [f"{t // 1024}k" for t in T])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("training tokens/s, one GPU")
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    ax.set_title(f"NSA / dense tokens/s, {gpus} (hollow: with activation checkpointing)", fontsize=10)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, default=DOCS / "e2e_results.csv")
    parser.add_argument("--out", type=Path, default=DOCS / "e2e_nsa_vs_dense.png")
    args = parser.parse_args()
    plot(read_results(args.csv), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
