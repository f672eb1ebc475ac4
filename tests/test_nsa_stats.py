"""NSA telemetry: per-layer stats against brute force, compiled + checkpointed blocks, train.py's tensorboard tags."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nsa_models import get_flavor
from nsa_models.args import NSAArgs
from nsa_models.model import Transformer
from nsa_models.telemetry import NSA_STATS, nsa_metrics
from nsa_training.config import ConfigError, load_config
from parallelisms import apply_ac, apply_compile, compile_counters
from parallelisms.config import ActivationCheckpointConfig, CompileConfig
from tests.nsa_oracle import masked_attention

REPO = Path(__file__).resolve().parents[1]
# Queries 0..6 see no compressed block, early ones select fewer than n blocks (-1 padding), late ones choose.
TINY_NSA = NSAArgs(cmp_block_size=8, cmp_stride=4, sel_block_size=8, n_selected=4, window_size=8, query_chunk=16)


def build(flavor: str = "debug", dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(get_flavor(flavor), nsa=TINY_NSA))
    model.init_weights()
    return model.to(dtype)


def brute_force_stats(q, k_cmp, v_cmp, gates, block_indices, args: NSAArgs):
    """The telemetry by Python loops and the oracle's explicit compressed probabilities: (means, distance counts
    per bin, entropy [B, T, HQ])."""
    B, T, HQ, _ = gates.shape
    lp, l = args.sel_block_size, args.cmp_block_size
    distances, forced = [], 0
    for per_head in block_indices.tolist():
        for per_query in per_head:
            for t, chosen in enumerate(per_query):
                current = t // lp
                for j in (j for j in chosen if j >= 0):
                    distances.append(current - j)
                    forced += j in (0, current, current - 1)
    n_bins = 1 + ((T - 1) // lp).bit_length()  # bin 0: distance 0; bin k: [2^(k-1), 2^k)
    counts = [sum(1 for d in distances if d.bit_length() == k) for k in range(n_bins)]

    visible = torch.tensor([[i * args.cmp_stride + l - 1 <= t for i in range(k_cmp.shape[1])] for t in range(T)])
    _, p = masked_attention(q.double(), k_cmp.double(), v_cmp.double(), visible.expand(B, HQ, T, -1),
                             HQ // k_cmp.shape[2])
    entropy = torch.where(p > 0, -p * p.log(), torch.zeros_like(p)).sum(-1).transpose(1, 2)  # [B, T, HQ]
    gate_means = gates.double().mean((0, 1, 2)).tolist()
    means = dict(zip(("gate_cmp", "gate_slc", "gate_win"), gate_means),
                 forced_share=forced / len(distances), slc_distance_blocks=sum(distances) / len(distances),
                 slc_distance_sq=sum(d * d for d in distances) / len(distances), slc_distance_max=max(distances),
                 cmp_entropy=entropy[:, l - 1:].mean().item())
    return means, counts, entropy


def test_stats_match_brute_force(monkeypatch):
    import nsa_models.model

    calls = []

    def recording(*args, **kwargs):
        result = nsa_models.nsa.nsa_attention(*args, **kwargs)
        calls.append((args, result))
        return result

    monkeypatch.setattr(nsa_models.model, "nsa_attention", recording)
    model = build(dtype=torch.float64)
    T = 57
    model(torch.randint(0, 256, (2, T)))
    assert model.nsa_stats.dtype == torch.float32 and model.nsa_stats.shape[0] == len(calls) == 2

    scalars, histograms = nsa_metrics(model.nsa_stats.tolist())
    for layer, ((q, _, _, _, _, k_cmp, v_cmp, gates, args), (_, idx, entropy)) in enumerate(calls):
        assert entropy.dtype == torch.float32 and not entropy.requires_grad
        means, counts, want_entropy = brute_force_stats(q, k_cmp, v_cmp, gates, idx, args)
        torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-6)
        # Queries before l - 1 see no compressed block (entropy 0): the mean must leave them out.
        assert (want_entropy[:, :args.cmp_block_size - 1] == 0).all() and (want_entropy[:, -1] > 0).all()
        row = dict(zip(NSA_STATS, model.nsa_stats[layer].tolist()))
        assert row == pytest.approx(means, rel=1e-5)
        assert 0 < means["forced_share"] < 1 and means["slc_distance_max"] > 1  # the case exercises a choice
        assert model.nsa_stats[layer, len(NSA_STATS):].tolist() == counts
        histogram = histograms[f"nsa/slc_distance_hist/layer{layer}"]
        used = max(k for k, c in enumerate(counts) if c) + 1
        assert histogram.bucket_counts == counts[:used] and histogram.num == sum(counts)
        assert histogram.bucket_limits == [0.5, 1.5, 3.5, 7.5][:used - 1] + [means["slc_distance_max"]]
        assert histogram.sum == pytest.approx(means["slc_distance_blocks"] * sum(counts))
        for name in ("gate_cmp", "gate_slc", "gate_win", "forced_share", "slc_distance_blocks",
                     "slc_distance_max", "cmp_entropy"):
            assert scalars[f"nsa/{name}/layer{layer}"] == pytest.approx(means[name], rel=1e-5)
    assert len(scalars) == 2 * 7


def test_rows_are_computed_only_when_read(monkeypatch):
    """The forward (and backward) leave the layers' telemetry inputs, detached; reading `nsa_stats` computes the
    rows, one `nsa_stats` call per layer, equal to the rows of the attention's own outputs."""
    import nsa_models.model
    from nsa_models.telemetry import nsa_stats

    attended, computed = [], []

    def recording_attention(*args, **kwargs):
        result = nsa_models.nsa.nsa_attention(*args, **kwargs)
        attended.append((args[7], *result[1:]))  # gates, block indices, entropy
        return result

    def recording_stats(*args, **kwargs):
        computed.append([*args, *kwargs.values()])
        return nsa_stats(*args, **kwargs)

    monkeypatch.setattr(nsa_models.model, "nsa_attention", recording_attention)
    monkeypatch.setattr(nsa_models.model, "nsa_stats", recording_stats)
    model = build()
    assert model.nsa_stats is None
    tokens = torch.randint(0, 256, (2, 41))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert computed == []
    rows = model.nsa_stats
    assert len(computed) == len(attended) == 2
    assert not any(value.requires_grad for values in computed for value in values if isinstance(value, torch.Tensor))
    want = torch.stack([nsa_stats(gates, idx, entropy, TINY_NSA) for gates, idx, entropy in attended])
    assert torch.equal(rows, want)


def test_dense_model_has_no_stats():
    model = build("dense-debug")
    model(torch.randint(0, 256, (2, 16)))
    assert model.nsa_stats.shape == (2, 0)


@pytest.mark.parametrize("scope, ac", [("block", "full"), ("model", "none")])
def test_compiled_stats_equal_eager_without_graph_breaks(scope, ac):
    """aot_eager: the graphs, graph breaks and recompiles are Dynamo's and AOTAutograd's (inductor's CPU codegen
    added a minute per case in a fresh clone; test_model and test_parallelisms compile with inductor)."""
    eager = build()
    compiled = copy.deepcopy(eager)
    apply_ac(compiled, ActivationCheckpointConfig(mode=ac))
    apply_compile(compiled, CompileConfig(enable=True, scope=scope, fullgraph=True, backend="aot_eager"))
    tokens = torch.randint(0, 256, (2, 41))
    before = compile_counters()
    loss = F.cross_entropy(compiled(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    first = compile_counters()
    eager(tokens[:, :-1])
    torch.testing.assert_close(compiled.nsa_stats, eager.nsa_stats, rtol=1e-5, atol=1e-6)
    compiled(tokens[:, :-1])  # same shapes: no recompile
    assert compile_counters() == first
    assert first["graphs_compiled"] > before["graphs_compiled"] and first["graph_breaks"] == before["graph_breaks"]


def test_nsa_stats_freq_is_validated():
    with pytest.raises(ConfigError, match=r"^metrics\.nsa_stats_freq = -1: must be >= 0$"):
        load_config(["--metrics.nsa_stats_freq", "-1"])


def test_train_writes_nsa_scalars_and_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    run_dir = tmp_path / "run"
    B, T = 4, 128
    result = subprocess.run(
        [sys.executable, "train.py", "recipes/debug.toml", "--job.run_dir", str(run_dir), "--training.steps", "4",
         "--data.seq_len", str(T), "--training.micro_batch_size", str(B), "--training.global_batch_tokens",
         str(B * T), "--lr_scheduler.warmup_steps", "1", "--training.eval_interval", "0",
         "--metrics.nsa_stats_freq", "2", "--checkpoint.export_weights", "false"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    scalars, histograms = {}, {}
    (events,) = (run_dir / "tb").glob("events.out.tfevents.*")
    for event in EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            plugin = value.metadata.plugin_data.plugin_name
            if value.tag.startswith("nsa/") and plugin == "scalars":
                scalars.setdefault(value.tag, {})[event.step] = value.tensor.float_val[0]
            elif value.tag.startswith("nsa/") and plugin == "histograms":
                histograms.setdefault(value.tag, {})[event.step] = tensor_util.make_ndarray(value.tensor)
    names = ("gate_cmp", "gate_slc", "gate_win", "forced_share", "slc_distance_blocks", "slc_distance_max",
             "cmp_entropy")
    assert set(scalars) == {f"nsa/{name}/layer{i}" for name in names for i in (0, 1)}
    assert set(histograms) == {f"nsa/slc_distance_hist/layer{i}" for i in (0, 1)}
    assert all(sorted(steps) == [2, 4] for steps in [*scalars.values(), *histograms.values()])
    # The debug flavor's l' = 16, n = 4: how many blocks are selected, and how many of them are forced, depends
    # only on the positions, not on the weights.
    nsa = get_flavor("debug").nsa
    current = [t // nsa.sel_block_size for t in range(T)]
    n_selected = sum(min(nsa.n_selected, c + 1) for c in current)
    n_forced = sum(min(3, c + 1) for c in current)
    H = get_flavor("debug").n_kv_heads
    for i in (0, 1):
        assert scalars[f"nsa/forced_share/layer{i}"][4] == pytest.approx(n_forced / n_selected)
        assert 0 < scalars[f"nsa/gate_slc/layer{i}"][4] < 1 and scalars[f"nsa/cmp_entropy/layer{i}"][4] > 0
        buckets = histograms[f"nsa/slc_distance_hist/layer{i}"][4]  # rows [left, right, count]
        assert buckets[:, 2].sum() == B * H * n_selected
        assert buckets[0, 2] == B * H * T  # every query selects its own block: distance 0


def test_stats_of_a_shard_count_from_its_global_positions():
    """A context-parallel shard (rows 0-15 and 48-63 of 64): given their positions and the sequence's length, the
    telemetry is the brute-force one of those rows at those positions, histogram bins included; counted from 0
    instead, the distances come out otherwise."""
    from nsa_models.telemetry import nsa_stats

    gen = torch.Generator().manual_seed(0)
    B, T, H, HQ, n = 1, 64, 2, 4, 4
    args, lp, l = TINY_NSA, TINY_NSA.sel_block_size, TINY_NSA.cmp_block_size
    idx = torch.full((B, H, T, n), -1, dtype=torch.int64)
    for h in range(H):
        for t in range(T):
            chosen = torch.randperm(t // lp + 1, generator=gen)[:n]
            idx[0, h, t, :len(chosen)] = chosen.sort().values
    gates = torch.rand(B, T, HQ, 3, generator=gen)
    entropy = torch.rand(B, T, HQ, generator=gen) * (torch.arange(T) >= l - 1)[None, :, None]
    rows = torch.cat([torch.arange(0, 16), torch.arange(48, 64)])

    got = nsa_stats(gates[:, rows], idx[:, :, rows], entropy[:, rows], args, positions=rows, seq_len=T)
    distances, forced = [], 0
    for h in range(H):
        for t in rows.tolist():
            for j in (j for j in idx[0, h, t].tolist() if j >= 0):
                distances.append(t // lp - j)
                forced += j in (0, t // lp, t // lp - 1)
    counts = [sum(1 for d in distances if d.bit_length() == k) for k in range(1 + ((T - 1) // lp).bit_length())]
    seeing = rows[rows >= l - 1]
    want = [*gates[:, rows].mean((0, 1, 2)).tolist(), forced / len(distances), sum(distances) / len(distances),
            sum(d * d for d in distances) / len(distances), max(distances), entropy[:, seeing].mean().item(), *counts]
    assert got.tolist() == pytest.approx(want, rel=1e-5)
    local = nsa_stats(gates[:, rows], idx[:, :, rows], entropy[:, rows], args)
    assert local[NSA_STATS.index("slc_distance_blocks")] != pytest.approx(want[NSA_STATS.index("slc_distance_blocks")])
