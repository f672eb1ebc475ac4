"""Console lines, tensorboard scalars and histograms for the training loop."""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from nsa_models.args import ModelArgs
from nsa_models.telemetry import Histogram
from nsa_training.config import MetricsConfig
from parallelisms.config import ActivationCheckpointConfig

# The tag of each device's peak memory: the console line's `mem` and the sweep's peak_mem_gib read the first present.
PEAK_MEMORY_TAGS = ("memory/max_allocated_gib", "memory/peak_rss_gib")


def memory_scalars(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB: the CUDA allocator's max allocated and reserved on a GPU; on CPU, where there is no
    allocator to ask, the process's peak resident set size, under its own name."""
    if device.type == "cuda":
        return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


def peak_memory_gib(scalars: dict) -> float | None:
    """The peak memory among `scalars` (tag -> value), whichever device logged it; None without one."""
    return next((scalars[tag] for tag in PEAK_MEMORY_TAGS if tag in scalars), None)


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes one rank needs: fp32 parameters, gradients and AdamW's two moments (its shard under FSDP), and a rough
    bound of one micro-batch's activations and logits."""

    states: float
    activations: float

    @property
    def total(self) -> float:
        return self.states + self.activations

    def __str__(self) -> str:
        return (f"{self.total / 2**30:.1f} GiB ({self.states / 2**30:.1f} GiB parameters, gradients, AdamW "
                f"state and buffers, ~{self.activations / 2**30:.1f} GiB activations)")


def estimate_memory(args: ModelArgs, n_params: int, tokens: int, *, shards: int, compute_bytes: int,
                    ac: ActivationCheckpointConfig, buffer_bytes: int = 0) -> MemoryEstimate:
    """What a training step of `args` (`n_params` parameters, `buffer_bytes` of buffers such as the RoPE table) on
    a micro-batch of `tokens` needs per rank.

    Activations: 12 values of width `dim` kept per token per block without activation checkpointing, one (the block
    input) per checkpointed block (`full`: all, `every_n`: every N-th) plus one block being recomputed, and the
    logits with their gradient. `selective_op` counts as none: it keeps the matmul and attention outputs, most of
    a block's activations (nsa-125m: 16.6 GiB measured against 21.0 without checkpointing). The NSA `reference`
    backend also keeps, per query, the gathered keys and values of its selected blocks and their probabilities
    (nsa-125m: 0.5M values per token per block, which is what takes it past a CPU's memory). Deliberately low, so
    that only runs that cannot fit are refused: measured peaks are higher (nsa-125m, 16 x 2048 tokens, bf16,
    compiled, triton backend, H200: 21.0 GiB against 15.4 estimated without checkpointing, 10.2 against 9.7 with
    `full`; `tests/test_first_hour.py` holds the estimates to the measured peaks of docs/PERFORMANCE.md; Korthikanti
    et al. 2022 count 17 values per GPT block).
    """
    states = 16 * n_params / shards + buffer_bytes  # fp32 weights, gradients, exp_avg, exp_avg_sq; buffers whole
    per_block = 12 * args.dim
    if args.attention == "nsa" and args.nsa.backend == "reference":
        gathered = args.nsa.n_selected * args.nsa.sel_block_size
        per_block += gathered * (2 * args.n_kv_heads * args.head_dim + args.n_heads)
    checkpointed = {"full": args.n_layers, "every_n": args.n_layers // ac.every_n}.get(ac.mode, 0)
    kept = checkpointed * args.dim + (args.n_layers - checkpointed) * per_block
    recompute = per_block if checkpointed else 0
    per_token = (kept + recompute + 2 * args.vocab_size) * compute_bytes
    return MemoryEstimate(states=states, activations=float(per_token * tokens))


def available_memory(device: torch.device) -> tuple[float | None, str]:
    """(bytes this rank may still allocate, where) on `device`: the GPU's free memory, or on CPU the host's
    available memory (within its cgroup's limit) shared by the ranks on it; None when unknown."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0]), f"GPU {device.index}"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    where = "this host" + (f" (shared by {ranks} ranks)" if ranks > 1 else "")
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:  # not Linux
        return None, where
    free = int(meminfo["MemAvailable"].split()[0]) * 1024
    cgroup = Path("/sys/fs/cgroup")
    try:  # a container's limit, which the out-of-memory killer enforces before the host's runs out
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free / ranks, where


# Peak dense bf16 tensor-core TFLOP/s per GPU (no 2:4 sparsity), from the vendors' data sheets. The first name
# contained in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    """Peak dense bf16 TFLOP/s of `device`, or None when unknown (CPU, a GPU missing from the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


class MetricLogger:
    """Prints one line per log step (on `metrics.log_rank`) and writes the same scalars to `<run_dir>/tb`."""

    def __init__(self, cfg: MetricsConfig, run_dir: str | Path, *, rank: int, total_steps: int, config_text: str,
                 start_step: int = 0):
        self.cfg, self.total_steps = cfg, total_steps
        self.active = rank == cfg.log_rank
        self.writer = None
        self.start_time: float | None = None
        self.start_step = 0
        self.skipped = 0.0  # skipped steps seen so far (resumed runs start from 0: only increases are marked)
        if self.active and cfg.tensorboard:
            # A run resumed from step N re-runs the steps after N that a crash had already logged: purging them
            # keeps one value per step (tensorboard drops every event of a step >= purge_step written before).
            self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
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

    def log_image(self, step: int, tag: str, image: torch.Tensor) -> None:
        """Write an RGB image [3, H, W] (values in [0, 1]) for `step`; tensorboard only."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step)
            self.writer.flush()

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
                f"step {s['perf/step_time_s'] * 1000:.0f} ms  mem {peak_memory_gib(s):.2f} GiB  "
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
