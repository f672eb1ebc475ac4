"""Helpers shared by the test modules (no test module imports another): running train.py / run.sh and reading its
tensorboard events, skipping without optional packages, packed documents, the compressed op ungated, judging a top-n
block selection, and one model block's logits and gradients.

The brute-force NSA oracle lives beside this, in `tests/nsa_oracle.py`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_models import get_flavor
from nsa_models.args import NSAArgs
from nsa_models.model import Transformer
from nsa_models.nsa import check_backend
from nsa_models.nsa.reference import compressed_branch, selection_scores

REPO = Path(__file__).resolve().parents[1]
# Small steps of the debug recipe: 4 sequences of 128 tokens.
FAST = ["--data.seq_len", "128", "--training.global_batch_tokens", "512", "--training.micro_batch_size", "4",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--training.eval_interval", "5",
        "--training.eval_batches", "1"]


# --- train.py / run.sh runs ------------------------------------------------------------------------------------

def merged(*argvs: list[str] | tuple[str, ...]) -> list[str]:
    """Command lines joined into one, a later `--key value` (or `--key=value`) replacing an earlier value of the same
    key where it stood: train.py refuses a key given twice, and tests change FAST's keys. Other arguments (a recipe,
    --print-config) stay as they are."""
    out: list[str] = []
    where: dict[str, int] = {}  # key -> index of its value in out
    words = iter(word for argv in argvs for word in argv)
    for word in words:
        if not word.startswith("--") or word == "--print-config":  # a recipe, or the one flag without a value
            out.append(word)
            continue
        key, has_value, value = word[2:].partition("=")
        value = value if has_value else next(words)
        if key in where:
            out[where[key]] = value
        else:
            out += [f"--{key}", value]
            where[key] = len(out) - 1
    return out


def env() -> dict[str, str]:
    """The environment of a train.py / run.sh subprocess: offline datasets, unbuffered output, one process."""
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "NGPU": "1"}


def scalars(event_file: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of one tensorboard event file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict[str, dict[int, float]] = {}
    for event in EventFileLoader(str(event_file)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "scalars":  # the loader yields scalars as tensors
                out.setdefault(value.tag, {})[event.step] = value.tensor.float_val[0]
    return out


def event_files(run_dir: Path) -> list[Path]:
    """The run's tensorboard event files, oldest first."""
    return sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)


def needs_flash_attn_4() -> None:
    """Skip unless flash-attn-4 (an optional package: pyproject's `flash4` extra) is installed; device runs carry it."""
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")


# --- packed documents ------------------------------------------------------------------------------------------
# Per row, the lengths of its documents: shorter than a compressed and a selection block (5), odd lengths, longer than
# the window (90, 100), and a tail of padding after the last one. With l' = 16 they start at 0, 32, 128 and 0, 16,
# 128; compressed blocks of l = 2d straddle each start. At d = 4 the document at 32 starts inside the first 16
# compressed blocks, after some of the first document's, and runs past the queries that see all 16 causally (the
# unmasked query steps of dK/dV's first key tile must not reach it).
ROWS, T_CPU = [[20, 90, 29], [5, 100, 20]], 160


def rel_err(a: Tensor, b: Tensor, floor_rms: float | None = None) -> float:
    """||a - b|| / ||b||; the RMS of a - b where b is numerically zero (no compressed block, say). floor_rms: the
    RMS below which b counts as zero instead, then ||a - b|| / (floor_rms sqrt(numel)): a slice of a gradient that
    is zero up to rounding is measured against the whole gradient's scale, not against its own noise."""
    diff, scale, root_n = (a.double() - b.double()).norm().item(), b.double().norm().item(), max(1, b.numel()) ** 0.5
    if floor_rms is not None:
        return diff / max(scale, floor_rms * root_n)
    return diff / scale if scale > 1e-6 * root_n else diff / root_n


def pack(rows: list[list[int]], seq_len: int, align: int, device: str = "cpu") -> tuple[Tensor, list]:
    """doc_start [B, T] int32 of documents of these lengths packed from position 0 of each row, each starting at a
    multiple of `align` (the padding after a document, and the row's tail, count as part of it), and each row's
    documents as (start, length)."""
    doc_start = torch.zeros(len(rows), seq_len, dtype=torch.int32)
    spans = []
    for b, lengths in enumerate(rows):
        start, row = 0, []
        for length in lengths:
            assert start + length <= seq_len
            doc_start[b, start:] = start
            row.append((start, length))
            start = -(-(start + length) // align) * align
        spans.append(row)
    return doc_start.to(device), spans


def real_tokens(spans: list, seq_len: int, device: str = "cpu") -> Tensor:
    """[B, T, 1, 1] float: 1 on the documents' tokens, 0 on padding (no loss reads a padding row's output)."""
    mask = torch.zeros(len(spans), seq_len, 1, 1, device=device)
    for b, row in enumerate(spans):
        for start, length in row:
            mask[b, start:start + length] = 1
    return mask


def ungated_compressed(q: Tensor, k: Tensor, v: Tensor, block: int, stride: int, scale: float,
                       *args) -> tuple[Tensor, Tensor]:
    """The compressed branch's o and lse through `compressed_attention_fwd` with every gate 1 (the op applies the
    model's gate; these tests check the attention alone). args: the op's after scale (doc_start, q_start, ...)."""
    from nsa_models.nsa.triton_compressed import compressed_attention_fwd  # only here: Triton is optional

    return compressed_attention_fwd(q, k, v, q.new_ones(q.shape[:3]), block, stride, scale, *args)[:2]


# --- top-n block selection -------------------------------------------------------------------------------------
# Two implementations that sum the same probabilities in different orders may rank blocks whose scores differ by
# rounding differently; anything else (a missing forced block, a future block, a clearly lower-scored block kept
# over a higher one, wrong padding) is an error.

def reference_scores(q: Tensor, k_cmp: Tensor, args: NSAArgs, start: int = 0, seq_len: int | None = None) -> Tensor:
    """[B, H, C, Ns] fp64 selection scores of queries start .. start+C-1 (q [B, C, HQ, D]) of a sequence of
    seq_len tokens (default: start + C), with forced blocks at +inf and future blocks at -inf."""
    B, C, HQ, D = q.shape
    H = k_cmp.shape[2]
    T = start + C if seq_len is None else seq_len
    qh = q.detach().double().view(B, C, H, HQ // H, D).permute(0, 2, 3, 1, 4)
    k = k_cmp.detach().double().transpose(1, 2)
    _, p_cmp = compressed_branch(qh, k, k, start, args)
    score = selection_scores(p_cmp, T, args)
    j = torch.arange(score.shape[-1], device=q.device)
    current = (torch.arange(start, start + C, device=q.device) // args.sel_block_size)[:, None]
    forced = (j == 0) | (j == current) | (j == current - 1)
    return score.masked_fill(forced, float("inf")).masked_fill(j > current, float("-inf"))


def assert_valid_selection(idx: Tensor, scores: Tensor, n: int, tol: float) -> None:
    """idx [B, H, T, n] (ascending, -1 padding last) must keep the forced blocks (n of them if n is smaller), pick
    min(n, candidates) blocks, and no unchosen candidate may beat a chosen one by more than `tol` (relative to the
    row's scale)."""
    assert idx.shape == scores.shape[:3] + (n,)
    valid = idx >= 0
    padded = torch.where(valid, idx, torch.iinfo(torch.int64).max)
    assert torch.equal(padded, padded.sort(-1).values), "indices are not ascending with -1 padding last"
    n_sel = scores.shape[-1]
    chosen = torch.zeros(scores.shape[:3] + (n_sel + 1,), dtype=torch.bool, device=idx.device)
    chosen = chosen.scatter(-1, torch.where(valid, idx, n_sel), True)[..., :n_sel]  # padding: a spare column
    assert torch.equal(valid.sum(-1), chosen.sum(-1)), "a block is chosen twice"
    candidates = scores > float("-inf")
    assert torch.equal(valid.sum(-1), candidates.sum(-1).clamp_max(n)), "wrong number of chosen blocks"
    assert not (chosen & ~candidates).any(), "a future block is chosen"
    forced = scores == float("inf")
    assert torch.equal((forced & chosen).sum(-1), forced.sum(-1).clamp_max(n)), "a forced block is missing"
    finite = scores.masked_fill(~torch.isfinite(scores), 0)
    scale = finite.amax(-1).clamp_min(1e-30)
    worst_kept = torch.where(chosen & torch.isfinite(scores), finite, float("inf")).amin(-1)  # forced aside
    best_left = torch.where(candidates & ~chosen, finite, float("-inf")).amax(-1)
    excess = ((best_left - worst_kept) / scale).max().item()
    assert excess <= tol, f"an unchosen block scores {excess:.2e} (relative) above a chosen one"


# --- one model block -------------------------------------------------------------------------------------------

def one_block_run(flavor: str, tokens: Tensor, dtype: torch.dtype = torch.bfloat16,
                  **nsa) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits and parameter gradients of one block of `flavor` (random init, seed 0) on `tokens`, in `dtype`, the
    triton backend with the `nsa` keys given (checked as a run's start checks them)."""
    args = dataclasses.replace(get_flavor(flavor), n_layers=1, vocab_size=512, max_seq_len=tokens.shape[1])
    args.nsa = dataclasses.replace(args.nsa, backend="triton", **nsa)
    check_backend(args.nsa, tokens.device, dtype)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=tokens.device)
    model.init_weights()
    model = model.to(dtype)
    logits = model(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}
