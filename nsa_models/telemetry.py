"""NSA health telemetry, encoded and decoded in one place.

Each NSA layer returns what its telemetry needs (`TelemetryInputs`) and the model keeps those of its latest forward.
Reading `Transformer.nsa_stats` encodes them, eagerly and without a host sync, as one fp32 row per layer
(`nsa_stats`): the trainer reads them only every `metrics.nsa_stats_freq` steps, so computing the rows inside every
compiled forward cost 20 of an nsa-125m block's 183 kernel launches (~0.56 ms a step on an H200) for rows that were
mostly thrown away. `nsa_metrics` decodes the rows into named scalars and histograms, which the trainer only logs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_models.args import NSAArgs

# Telemetry row of one NSA layer: these means, then the counts of the selected-block distance histogram.
NSA_STATS = ("gate_cmp", "gate_slc", "gate_win", "forced_share", "slc_distance_blocks", "slc_distance_sq",
             "slc_distance_max", "cmp_entropy")


class TelemetryInputs(NamedTuple):
    """What `nsa_stats` encodes for one NSA layer, as the layer's forward returns it (a compiled block may return
    tensors, None and ints). Nothing in it requires grad: held until the next forward, it must not keep the step's
    autograd graph alive."""

    gates: Tensor
    block_indices: Tensor
    cmp_entropy: Tensor
    doc_start: Tensor | None = None
    positions: Tensor | None = None
    seq_len: int | None = None


def _bin_starts(n_bins: int) -> list[int]:
    """Smallest distance of each histogram bin: bin 0 holds distance 0, bin k >= 1 distances [2^(k-1), 2^k)."""
    return [0] + [1 << k for k in range(n_bins - 1)]


def nsa_stats(gates: Tensor, block_indices: Tensor, cmp_entropy: Tensor, args: NSAArgs,
              doc_start: Tensor | None = None, positions: Tensor | None = None,
              seq_len: int | None = None) -> Tensor:
    """Health telemetry of one NSA layer as a detached fp32 row laid out as NSA_STATS then the histogram counts.

    gates [B, T, HQ, 3]; block_indices [B, H, T, n] (-1 = padding); cmp_entropy [B, T, HQ]. Over the selected
    blocks: the share that is forced (block 0, the query's block and the one before) and the distance's mean,
    mean square, max and histogram, in selection blocks (the query's own block is at distance 0). The entropy is
    the mean over the query heads that see at least one compressed block (t >= l - 1). With packed documents
    (doc_start [B, T]) the forced first block is the document's and t counts from its start. Queries that are a
    part of their sequence (context parallelism's shard) pass their positions [T] (int64) and the sequence's length
    `seq_len`, which sizes the histogram; None: positions 0 .. T-1 of a sequence of T. No host sync: the trainer
    reads the rows (`Transformer.nsa_stats`) while the step is still queued on the device.
    """
    B, T, HQ, _ = gates.shape
    n_sel = args.num_sel_blocks(T if seq_len is None else seq_len)
    t = torch.arange(T, device=gates.device) if positions is None else positions
    distance = t[:, None] // args.sel_block_size - block_indices
    selected = block_indices >= 0
    n_selected = selected.sum()  # > 0: every query selects its own block
    first = 0 if doc_start is None else doc_start[:, None, :, None] // args.sel_block_size
    forced = selected & ((block_indices == first) | (distance <= 1))
    distance = torch.where(selected, distance, 0).float()
    # One full reduction per bin: no [elements, n_bins] intermediate.
    at_least = torch.stack([(selected & (distance >= start)).sum()
                            for start in _bin_starts(1 + (n_sel - 1).bit_length())])
    counts = at_least - F.pad(at_least[1:], (0, 1))
    if doc_start is None and positions is None:
        entropy = cmp_entropy[:, args.cmp_block_size - 1:].sum() / max(1, B * max(0, T - args.cmp_block_size + 1) * HQ)
    else:  # a query that sees no compressed block has entropy 0: only the count needs the positions
        seeing = (t - (0 if doc_start is None else doc_start) >= args.cmp_block_size - 1).expand(B, T)
        entropy = cmp_entropy.sum() / (seeing.sum() * HQ).clamp_min(1)
    means = torch.stack([forced.sum() / n_selected, distance.sum() / n_selected,
                         distance.square().sum() / n_selected, distance.amax(), entropy])
    return torch.cat([gates.detach().float().mean((0, 1, 2)), means, counts.float()])


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
    per-layer telemetry rows of an NSA model (`Transformer.nsa_stats`: `nsa_stats` rows)."""
    scalars, histograms = {}, {}
    for layer, row in enumerate(rows):
        stats = dict(zip(NSA_STATS, row))
        scalars.update({f"nsa/{name}/layer{layer}": value for name, value in stats.items()
                        if name != "slc_distance_sq"})  # kept for the histogram only
        counts = row[len(NSA_STATS):]
        starts = _bin_starts(len(counts))
        used = max(k for k, count in enumerate(counts) if count) + 1  # trailing empty bins dropped
        num = sum(counts)
        histograms[f"nsa/slc_distance_hist/layer{layer}"] = Histogram(  # min 0: every query selects its own block
            min=0.0, max=stats["slc_distance_max"], num=num, sum=stats["slc_distance_blocks"] * num,
            sum_squares=stats["slc_distance_sq"] * num,
            bucket_limits=[start - 0.5 for start in starts[1:used]] + [stats["slc_distance_max"]],
            bucket_counts=counts[:used])
    return scalars, histograms
