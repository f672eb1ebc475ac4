"""Render a run's tensorboard scalars into one PNG grid, one subplot per tag.

    python scripts/plot_tb.py runs/nsa_125m_ddp --out docs/nsa_125m_ddp.png --tags-prefix nsa/ perf/

RUN_DIR is a run's job.run_dir (events in RUN_DIR/tb) or a folder of event files. Per-layer tags share a
subplot: `nsa/gate_cmp/layer3` (a `layer<i>` anywhere in the tag) is drawn as line `layer3` of subplot
`nsa/gate_cmp`, so each statistic shows all layers at once. Scalars only (histograms are left out). Needs
matplotlib (`pip install -e .[plot]`).
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nsa_training.config import ConfigError  # noqa: E402
from nsa_training.watchdog import report_failure  # noqa: E402

Curve = tuple[list[int], list[float]]  # steps, values
# A tag component naming a layer (`layer3`, `layer_3`): curves differing only there share a subplot.
_LAYER = re.compile(r"^layer_?(\d+)$")


def read_scalars(run_dir: Path) -> dict[str, Curve]:
    """tag -> (steps, values) of every scalar in the run's event files (all of them, in order, e.g. after resumes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = run_dir / "tb" if (run_dir / "tb").is_dir() else run_dir
    if not any(tb_dir.glob("events.out.tfevents.*")):
        raise ConfigError(f"RUN_DIR {run_dir}: no tensorboard event files in it or in its tb/; give a run's "
                          "job.run_dir (metrics.tensorboard = true)")
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every step
    # A resumed run's writer starts with a purge marker (`purge_step`), so the steps its restart redid replace the
    # old ones; tensorboard warns of each such purge as "likely caused by a TensorFlow restart": mute it.
    tensorboard_log = logging.getLogger("tensorboard")
    level = tensorboard_log.level
    tensorboard_log.setLevel(logging.ERROR)
    try:
        events.Reload()
    finally:
        tensorboard_log.setLevel(level)
    if not events.Tags()["scalars"]:
        raise ConfigError(f"RUN_DIR {run_dir}: its event files hold no scalars; give a run that logged a step")
    return {tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
            for tag in events.Tags()["scalars"]}


def panels(scalars: dict[str, Curve], prefixes: list[str]) -> dict[str, dict[str, Curve]]:
    """Subplot title -> {line label: curve} for the tags starting with one of `prefixes` (all when empty)."""
    grouped: dict[str, dict[str, Curve]] = {}
    for tag in sorted(scalars):
        if prefixes and not tag.startswith(tuple(prefixes)):
            continue
        parts = tag.split("/")
        layer = next((i for i, part in enumerate(parts) if _LAYER.match(part)), None)
        if layer is None:
            grouped.setdefault(tag, {})[tag.rsplit("/", 1)[-1]] = scalars[tag]
        else:
            title = "/".join(parts[:layer] + parts[layer + 1:])
            grouped.setdefault(title, {})[parts[layer]] = scalars[tag]
    for title, lines in grouped.items():  # layer2 before layer10
        grouped[title] = dict(sorted(lines.items(), key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])]))
    return grouped


def plot(grid: dict[str, dict[str, Curve]], out: Path, title: str, columns: int) -> None:
    """One subplot per entry of `grid` (per-layer lines shaded by depth, with a legend), saved as a PNG at `out`."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state
    from matplotlib.ticker import MaxNLocator

    columns = min(columns, len(grid))
    rows = math.ceil(len(grid) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax, (name, lines) in zip(axes, grid.items()):
        depth = colormaps["viridis"].resampled(len(lines))
        for i, (label, (steps, values)) in enumerate(lines.items()):
            # Markers while points are few: a single logged value would otherwise draw nothing.
            ax.plot(steps, values, label=label, color=depth(i) if len(lines) > 1 else None, linewidth=1.2,
                    marker="." if len(steps) < 50 else None)
        ax.set(title=name, xlabel="step", ylabel=name.rsplit("/", 1)[-1])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="x-small", ncols=math.ceil(len(lines) / 8))
    for ax in axes[len(grid):]:  # the grid's unused cells
        ax.set_visible(False)
    figure.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's job.run_dir, or a folder of event files")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write, e.g. docs/nsa_health.png")
    parser.add_argument("--tags-prefix", nargs="+", default=[], metavar="PREFIX",
                        help="plot only tags starting with one of these (e.g. nsa/ perf/); default: every scalar")
    parser.add_argument("--columns", type=int, default=3, help="subplots per row")
    args = parser.parse_args(argv)
    try:
        if args.columns < 1:
            raise ConfigError(f"--columns {args.columns}: must be >= 1")
        grid = panels(read_scalars(args.run_dir), args.tags_prefix)
        if not grid:
            raise ConfigError(f"--tags-prefix {' '.join(args.tags_prefix)}: no scalar tag of {args.run_dir} starts "
                              "with these; leave it out to plot every scalar")
    except ConfigError as e:
        return report_failure(e)
    plot(grid, args.out, str(args.run_dir), args.columns)
    print(f"saved {args.out}: {len(grid)} subplots ({', '.join(grid)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
