"""Console lines, tensorboard scalars and histograms for the training loop."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from nsa_models.model import NSA_STATS, distance_bin_starts
from nsa_training.config import MetricsConfig


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(max allocated, max reserved) GiB on a CUDA device; on CPU the process's peak RSS for both."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss


# Peak dense bf16 tensor-core TFLOP/s per GPU (no 2:4 sparsity), from the vendors' data sheets. The first name
# contained in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    """Peak dense bf16 TFLOP/s of `device`, or None when unknown (CPU, a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


@dataclasses.dataclass
class Histogram:
    """A histogram as tensorboard stores it (`SummaryWriter.add_histogram_raw`): bucket i ends at bucket_limits[i]
    (the last one at max)."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]


def nsa_metrics(rows: list[list[float]]) -> tuple[dict[str, float], dict[str, Histogram]]:
    """Tensorboard scalars `nsa/<stat>/layer<i>` and histograms `nsa/slc_distance_hist/layer<i>` from the
    per-layer telemetry rows of an NSA model (`nsa_models.model.nsa_stats`)."""
    scalars, histograms = {}, {}
    for layer, row in enumerate(rows):
        stats = dict(zip(NSA_STATS, row))
        scalars.update({f"nsa/{name}/layer{layer}": value for name, value in stats.items()
                        if name != "slc_distance_sq"})  # kept for the histogram only
        counts = row[len(NSA_STATS):]
        starts = distance_bin_starts(len(counts))
        used = max(k for k, count in enumerate(counts) if count) + 1  # trailing empty bins dropped
        num = sum(counts)
        histograms[f"nsa/slc_distance_hist/layer{layer}"] = Histogram(  # min 0: every query selects its own block
            min=0.0, max=stats["slc_distance_max"], num=num, sum=stats["slc_distance_blocks"] * num,
            sum_squares=stats["slc_distance_sq"] * num,
            bucket_limits=[start - 0.5 for start in starts[1:used]] + [stats["slc_distance_max"]],
            bucket_counts=counts[:used])
    return scalars, histograms


class MetricLogger:
    """Prints one line per log step (on `metrics.log_rank`) and writes the same scalars to `<run_dir>/tb`."""

    def __init__(self, cfg: MetricsConfig, run_dir: str | Path, *, rank: int, total_steps: int, config_text: str):
        self.cfg, self.total_steps = cfg, total_steps
        self.active = rank == cfg.log_rank
        self.writer = None
        self.start_time: float | None = None
        self.start_step = 0
        self.skipped = 0.0  # skipped steps seen so far (resumed runs start from 0: only increases are marked)
        if self.active and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"))
            self.writer.add_text("config", "```toml\n" + config_text + "\n```")

    def should_log(self, step: int) -> bool:
        return step % self.cfg.log_freq == 0 or step == self.total_steps

    def should_log_nsa(self, step: int) -> bool:
        """NSA telemetry goes to tensorboard only: on this rank if it writes there, every `nsa_stats_freq` steps."""
        return self.writer is not None and self.cfg.nsa_stats_freq > 0 and step % self.cfg.nsa_stats_freq == 0

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Write `scalars` (tensorboard tags) for `step`; training steps also print the console line."""
        if not self.active:
            return
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()  # a crash must not lose what was already logged
        if "train/loss" in scalars:
            print(self._line(step, scalars), flush=True)
        elif "eval/loss" in scalars:
            print(f"step {step:>6}  eval loss {scalars['eval/loss']:.4f}", flush=True)

    def log_histograms(self, step: int, histograms: dict[str, Histogram]) -> None:
        """Write `histograms` (tensorboard tags) for `step`; tensorboard only, no console line."""
        if self.writer is None:
            return
        for tag, histogram in histograms.items():
            self.writer.add_histogram_raw(tag, **dataclasses.asdict(histogram), global_step=step)
        self.writer.flush()

    def _line(self, step: int, s: dict[str, float]) -> str:
        now = time.perf_counter()
        if self.start_time is None:
            self.start_time, self.start_step = now - s["perf/step_time_s"], step - 1
        rate = (now - self.start_time) / max(1, step - self.start_step)
        eta = rate * (self.total_steps - step)
        return (f"step {step:>6}/{self.total_steps}  loss {s['train/loss']:.4f}  lr {s['train/lr']:.2e}  "
                f"gnorm {s['train/grad_norm']:.3f}  tok/s {s['perf/tokens_per_s']:,.0f}  "
                f"step {s['perf/step_time_s'] * 1000:.0f} ms  mem {s['memory/max_allocated_gib']:.2f} GiB  "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s"
                + (f"  mfu {s['perf/mfu']:.1%}" if "perf/mfu" in s else "")
                + self._skip_marker(s.get("train/skipped_steps", 0)))

    def _skip_marker(self, skipped_steps: float) -> str:
        """Marks the line of a step whose update was skipped (the running count went up)."""
        increased, self.skipped = skipped_steps > self.skipped, skipped_steps
        return f"  SKIPPED: not finite, no update ({skipped_steps:.0f} in all)" if increased else ""

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
