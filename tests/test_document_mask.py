"""Document masking (`data.document_mask`): a packed row gives each document the outputs and gradients it gets run
alone, in the reference NSA core, the whole model (NSA and dense) and a compiled block (no graph break, no recompile
as boundaries move); the loader's packing and resume; the trainer's use of it; the refusal of a source without
documents."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets reads its config

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

import train  # noqa: E402
from nsa_models import Transformer, get_flavor  # noqa: E402
from nsa_models.args import NSAArgs  # noqa: E402
from nsa_models.model import document_alignment, document_mask  # noqa: E402
from nsa_models.nsa import nsa_attention, window_mask  # noqa: E402
from nsa_models.nsa.flex import BlockMaskStorage, document_block_mask  # noqa: E402
from nsa_models.telemetry import NSA_STATS, nsa_stats  # noqa: E402
from nsa_training.config import ConfigError, DataConfig, load_config  # noqa: E402
from nsa_training.data import build_data_loader  # noqa: E402
from nsa_training.loaders import IGNORE_INDEX  # noqa: E402
from nsa_training.trainer import build_model  # noqa: E402
from tests.helpers import REPO, event_files, scalars  # noqa: E402

# l = 8, d = 4, l' = 8, n = 4 (one free choice beside the three forced blocks), w = 8; chunks of 16 queries cut
# through documents.
TINY = NSAArgs(cmp_block_size=8, cmp_stride=4, sel_block_size=8, n_selected=4, window_size=8, query_chunk=16)
# Documents per row: shorter than a block (5), longer than the window and than n selection blocks (41), and odd
# lengths, so that documents end inside compressed and selection blocks; the second row ends in padding.
ROWS, T = [[5, 41, 9], [19, 30]], 65


def pack(rows: list[list[int]], align: int, seq_len: int = T) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """doc_start [B, seq_len] of documents of the given lengths placed at multiples of `align`, and their
    (row, start, length)."""
    doc_start = torch.zeros(len(rows), seq_len, dtype=torch.int32)
    spans = []
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            doc_start[b, start:] = start
            spans.append((b, start, n))
            start = -(-(start + n) // align) * align
        assert spans[-1][1] + spans[-1][2] <= seq_len
    return doc_start, spans


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


# --- the reference NSA core ---------------------------------------------------------------------------------------

H, G, D = 2, 2, 8


def core_inputs(rows: list[list[int]], args: NSAArgs = TINY):
    """Random NSA core inputs (q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates) of documents packed as `pack`
    places them, doc_start and the documents' spans."""
    doc_start, spans = pack(rows, args.sel_block_size)
    B = len(rows)
    torch.manual_seed(0)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, args.num_cmp_blocks(T), H, D)] * 2
    # Scaled-up queries sharpen the softmaxes so the selection depends on the inputs, not on ties.
    inputs = [torch.randn(s) * (3.0 if i == 0 else 1.0) for i, s in enumerate(shapes)] + [torch.rand(B, T, H * G, 3)]
    return [x.requires_grad_() for x in inputs], doc_start, spans


def document_rows(b: int, s: int, n: int, args: NSAArgs = TINY) -> list[tuple[int, slice]]:
    """Where the document at row b, position s, of n tokens lies in each core input (its compressed blocks too)."""
    tokens, blocks = slice(s, s + n), slice(s // args.cmp_stride, s // args.cmp_stride + args.num_cmp_blocks(n))
    return [(b, tokens)] * 5 + [(b, blocks)] * 2 + [(b, tokens)]


def alone(inputs: list[torch.Tensor], b: int, s: int, n: int) -> list[torch.Tensor]:
    """The document's own core inputs, as leaves of their own."""
    return [x[row:row + 1, r].detach().clone().requires_grad_() for x, (row, r) in zip(inputs, document_rows(b, s, n))]


def test_reference_core_gives_each_packed_document_its_alone_outputs_and_gradients():
    args = TINY
    inputs, doc_start, spans = core_inputs(ROWS)
    out, idx, _ = nsa_attention(*inputs, args, doc_start=doc_start)
    cotangent = torch.zeros_like(out)  # padding rows' outputs are free: no gradient flows from them
    for b, s, n in spans:
        cotangent[b, s:s + n] = torch.randn(n, H * G, D)
    grads = torch.autograd.grad((out * cotangent).sum(), inputs)

    # The packed gradients must be the documents' alone gradients in their rows and exactly 0 everywhere else.
    want_grads = [torch.zeros_like(x) for x in inputs]
    for b, s, n in spans:
        own = alone(inputs, b, s, n)
        alone_out, alone_idx, _ = nsa_attention(*own, args)
        assert rel_err(out[b:b + 1, s:s + n], alone_out) <= 1e-5, f"document at {b}:{s}"
        first_block = s // args.sel_block_size
        assert torch.equal(idx[b:b + 1, :, s:s + n], torch.where(alone_idx >= 0, alone_idx + first_block, -1))
        alone_grads = torch.autograd.grad((alone_out * cotangent[b:b + 1, s:s + n]).sum(), own)
        for want, (row, r), g in zip(want_grads, document_rows(b, s, n), alone_grads):
            want[row:row + 1, r] = g
    names = ["q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates"]
    for name, g, want in zip(names, grads, want_grads):
        assert rel_err(g, want) <= 1e-5, f"grad of {name}: rel err {rel_err(g, want):.2e}"


def test_nsa_telemetry_of_packed_documents_pools_their_alone_telemetry():
    """The forced-block share and the compressed entropy of a packed batch are those of its documents run alone,
    pooled (rows without padding: every query belongs to a document)."""
    rows = [[16, 24, 25], [8, 57]]
    inputs, doc_start, spans = core_inputs(rows)
    forced = selected = entropy = seeing = 0.0
    with torch.no_grad():
        _, idx, cmp_entropy = nsa_attention(*inputs, TINY, doc_start=doc_start)
        packed = dict(zip(NSA_STATS, nsa_stats(inputs[-1], idx, cmp_entropy, TINY, doc_start).tolist()))
        for b, s, n in spans:
            own = alone(inputs, b, s, n)
            _, own_idx, own_entropy = nsa_attention(*own, TINY)
            stats = dict(zip(NSA_STATS, nsa_stats(own[-1], own_idx, own_entropy, TINY).tolist()))
            chosen, queries = (own_idx >= 0).sum().item(), max(0, n - TINY.cmp_block_size + 1) * H * G
            forced, selected = forced + stats["forced_share"] * chosen, selected + chosen
            entropy, seeing = entropy + stats["cmp_entropy"] * queries, seeing + queries
    assert packed["forced_share"] == pytest.approx(forced / selected, rel=1e-5)
    assert packed["cmp_entropy"] == pytest.approx(entropy / seeing, rel=1e-5)


# --- the whole model ----------------------------------------------------------------------------------------------

def build(flavor: str, nsa: NSAArgs = TINY, device: str = "cpu") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(get_flavor(flavor), nsa=nsa))
    with torch.no_grad():
        model.init_weights()
    return model.to(device)


# On a GPU: the debug flavor's blocks (l = 16, d = 8, l' = 16, n = 4, w = 32) through the Triton kernels and the
# FlexAttention window; the dense twin through FlexAttention; fp32, held to 1e-3 there.
GPU_NSA = dataclasses.replace(get_flavor("debug").nsa, backend="triton")
GPU_LAYOUTS, GPU_T = [[[5, 41, 9, 150], [19, 30, 180]], [[256], [16] * 15 + [7]], [[100, 100], [1, 200]]], 256
MODELS = [pytest.param("debug", TINY, "cpu", id="nsa"),
          pytest.param("debug", dataclasses.replace(TINY, separate_kv=True, compress="mean"), "cpu",
                       id="nsa-separate-kv-mean"),
          pytest.param("dense-debug", TINY, "cpu", id="dense"),
          pytest.param("debug", GPU_NSA, "cuda", marks=pytest.mark.gpu, id="nsa-triton-cuda"),
          pytest.param("dense-debug", TINY, "cuda", marks=pytest.mark.gpu, id="dense-cuda")]


@pytest.mark.parametrize("flavor, nsa, device", MODELS)
def test_model_gives_each_packed_document_its_alone_logits_and_parameter_gradients(flavor, nsa, device):
    model = build(flavor, nsa, device)
    rows, seq_len, tolerance = (ROWS, T, 1e-5) if device == "cpu" else (GPU_LAYOUTS[0], GPU_T, 1e-3)
    doc_start, spans = pack(rows, document_alignment(model.args), seq_len)
    doc_start = doc_start.to(device)
    params = [p for p in model.parameters()]
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (len(rows), seq_len), device=device)  # random padding: nothing may read it
    labels = torch.full_like(tokens, IGNORE_INDEX)
    for b, s, n in spans:
        labels[b, s:s + n] = torch.randint(0, vocab, (n,), device=device)
    logits = model(tokens, doc_start)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    grads = torch.autograd.grad(loss, params)

    alone_loss = 0.0
    for b, s, n in spans:
        alone_logits = model(tokens[b:b + 1, s:s + n])
        assert rel_err(logits[b:b + 1, s:s + n], alone_logits) <= tolerance, f"document at {b}:{s}"
        alone_loss = alone_loss + F.cross_entropy(alone_logits[0], labels[b, s:s + n], reduction="sum")
    want = torch.autograd.grad(alone_loss, params)
    # Relative to each gradient, or to a thousandth of the whole one for gradients that are 0 up to rounding (a bias
    # added to every compressed key shifts a query's scores alike: the softmax ignores it).
    floor = 1e-3 * torch.cat([w.flatten() for w in want]).norm().item()
    for (param_name, _), g, w in zip(model.named_parameters(), grads, want):
        err = (g - w).norm().item() / max(w.norm().item(), floor)
        assert err <= tolerance, f"grad of {param_name}: rel err {err:.2e}"


def blocks(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A BlockMask's (count, indices) of partial or full blocks as a dense boolean [B, H, Nq, Nkv]."""
    listed = torch.arange(indices.shape[-1]) < num[..., None]
    return torch.zeros(indices.shape, dtype=torch.bool).scatter_(-1, indices.long(), listed)


@pytest.mark.parametrize("window", [None, 1, 100, 128, 300])
def test_flex_block_mask_admits_exactly_each_document_causally(window: int | None):
    """The FlexAttention BlockMask of packed documents built from per-block bounds (the dense baseline's on CUDA,
    and with a window NSA's sliding window): the same partial and full blocks as FlexAttention's own builder finds
    from the whole [T, T] mask, and compiled FlexAttention under it (forward: no CPU backward) equals SDPA under
    the exact mask, also for a length that ends inside a block. Documents within a block, across blocks, starting
    inside a key block that a later query block reaches, and blocks wholly inside one document; windows shorter
    than a block, of one block and of several."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = [[3, 1, 200, 7, 130, 43], [100, 200, 84], [128, 128, 1, 127], [384]]
    doc_start, _ = pack(rows, 1, seq_len=384)
    got = document_block_mask(doc_start, window)

    def exact(starts: torch.Tensor) -> torch.Tensor:  # [B, 1, T, T]
        t = torch.arange(starts.shape[1])
        mask = (t[None, :] <= t[:, None]) & (t[None, None, :] >= starts[..., None])
        return (mask & (t[:, None] - t[None, :] < (window or starts.shape[1])))[:, None]

    def document_window(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (kv_idx >= doc_start[b, q_idx])
                & (q_idx - kv_idx < (window or doc_start.shape[1])))

    # (FlexAttention's builder counts a last query block that ends before 128 as partial: 384 tokens have none.)
    want = create_block_mask(document_window, len(rows), None, 384, 384, device="cpu")
    assert torch.equal(blocks(got.kv_num_blocks, got.kv_indices), blocks(want.kv_num_blocks, want.kv_indices))
    assert torch.equal(blocks(got.full_kv_num_blocks, got.full_kv_indices),
                       blocks(want.full_kv_num_blocks, want.full_kv_indices))
    torch.manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=False)  # eager FlexAttention would not notice a missing block
    for length in (384, 370):
        starts = doc_start[:, :length]
        q, k, v = (torch.randn(len(rows), heads, length, 8) for heads in (4, 2, 2))
        want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=exact(starts), enable_gqa=True)
        got_out = flex(q, k, v, block_mask=document_block_mask(starts, window), enable_gqa=True)
        assert rel_err(got_out, want_out) <= 1e-5


# --- compile ------------------------------------------------------------------------------------------------------

LAYOUTS = [ROWS, [[40, 25], [1, 8, 8, 33]], [[65], [16, 16, 16, 17]]]


COMPILED = [pytest.param("nsa", "debug", TINY, "cpu", id="nsa"),
            pytest.param("dense", "dense-debug", TINY, "cpu", id="dense"),
            pytest.param("dense-flex", "dense-debug", TINY, "cpu", id="dense-flex"),
            pytest.param("nsa", "debug", GPU_NSA, "cuda", marks=pytest.mark.gpu, id="nsa-triton-cuda"),
            pytest.param("dense", "dense-debug", TINY, "cuda", marks=pytest.mark.gpu, id="dense-cuda")]


@pytest.mark.parametrize("name, flavor, nsa, device", COMPILED)
def test_compiled_block_has_no_graph_break_and_no_recompile_as_boundaries_move(name, flavor, nsa, device):
    """One compiled graph serves every layout of documents (boundaries are data), and it equals the eager block,
    whose dense attention runs SDPA under the exact mask. dense-flex: the FlexAttention path that CUDA takes, on CPU
    (forward only: FlexAttention has no CPU backward)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(flavor, nsa, device)
    block = model.layers["0"]
    # The NSA block on the CPU through aot_eager: Dynamo's graphs, breaks and recompiles are what it checks (inductor's
    # CPU codegen of the reference NSA added a minute in a fresh clone). The dense cases keep inductor, whose kernel
    # dense-flex exercises; the GPU cases take inductor, as training does.
    backend = "aot_eager" if name == "nsa" and device == "cpu" else "inductor"
    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend=backend)
    grad = name != "dense-flex"
    layouts, seq_len = (LAYOUTS, T) if device == "cpu" else (GPU_LAYOUTS, GPU_T)
    graphs = []
    for rows in layouts:
        doc_start = pack(rows, document_alignment(model.args), seq_len)[0].to(device)
        rope = model.rope[torch.arange(seq_len, device=device) - doc_start]  # as Transformer.forward computes them
        exact = document_mask(doc_start.cpu()).to(device)  # the boolean [B, 1, T, T] mask
        if model.args.attention == "nsa":
            mask = window_mask(seq_len, model.args.nsa, doc_start.device, doc_start=doc_start)
        else:
            mask = document_block_mask(doc_start) if name == "dense-flex" else document_mask(doc_start)
        x = torch.randn(len(rows), seq_len, model.args.dim, device=device, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            out, _ = compiled(x, rope, mask, doc_start)
            eager, _ = block(x, rope, mask if model.args.attention == "nsa" else exact, doc_start)
        tolerance = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out, eager, **tolerance)
        if grad:
            (got,) = torch.autograd.grad(out.square().sum(), x)
            (want,) = torch.autograd.grad(eager.square().sum(), x)
            torch.testing.assert_close(got, want, **tolerance)
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0
    # The eager triton block compiles its FlexAttention window once, on the first layout: only later rises count.
    assert graphs == [graphs[0]] * len(layouts) and (graphs[0] == 1 or device == "cuda")


def test_block_mask_storage_keeps_its_addresses_and_takes_each_masks_blocks():
    """BlockMaskStorage: a second batch's mask of the same shapes comes back in the first one's tensors (CUDA graphs
    see the same addresses) holding the second's blocks; a mask of other shapes gets tensors of its own and leaves
    the first shape's in place."""
    storage = BlockMaskStorage()
    first = storage.keep(document_block_mask(pack(ROWS, 1)[0], 8))
    addresses = [t.data_ptr() for t in first.as_tuple() if isinstance(t, torch.Tensor)]
    for rows in LAYOUTS[1:]:
        doc_start = pack(rows, 1)[0]
        kept = storage.keep(document_block_mask(doc_start, 8))
        assert [t.data_ptr() for t in kept.as_tuple() if isinstance(t, torch.Tensor)] == addresses
        want = document_block_mask(doc_start, 8)
        for name in ("kv", "full_kv", "q", "full_q"):
            assert torch.equal(blocks(getattr(kept, f"{name}_num_blocks"), getattr(kept, f"{name}_indices")),
                               blocks(getattr(want, f"{name}_num_blocks"), getattr(want, f"{name}_indices"))), name
    other = storage.keep(document_block_mask(pack(ROWS, 1, seq_len=300)[0], 8))
    assert other.kv_indices.data_ptr() not in addresses
    again = storage.keep(document_block_mask(pack(ROWS, 1)[0], 8))
    assert [t.data_ptr() for t in again.as_tuple() if isinstance(t, torch.Tensor)] == addresses


@pytest.mark.gpu
@pytest.mark.parametrize("flavor", ["debug", "dense-debug"])
def test_cuda_graphs_replay_as_documents_change(tmp_path, jsonl, monkeypatch, capsys, flavor):
    """Trained with CUDA graphs (compile.mode = reduce-overhead, two micro-batches a step) on packed documents that
    change with every batch: no graph is recorded again after warm-up (the trainer would warn), and the losses are
    those of compile.mode = default. Without the kept mask storage (each batch's mask as built, kept alive so that
    its tensors cannot come back at the same addresses), the trainer warns that step 3 recorded CUDA graphs again:
    checked, so that this test can fail."""
    def run(mode: str, name: str) -> tuple[dict[int, float], list[str]]:
        argv = [str(REPO / "recipes/debug.toml"), "--job.run_dir", str(tmp_path / name), "--model.flavor", flavor,
                "--training.device", "cuda", "--data.source", str(jsonl), "--data.seq_len", "64",
                "--data.document_mask", "true", "--training.micro_batch_size", "2",
                "--training.global_batch_tokens", "256", "--training.steps", "6", "--lr_scheduler.warmup_steps", "0",
                "--training.eval_interval", "0", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
                "--compile.enable", "true", "--compile.mode", mode, "--model.nsa.backend", "triton"]
        assert train.main(argv) == 0
        warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
        return scalars(event_files(tmp_path / name)[0])["train/loss"], warnings

    graphs, warnings = run("reduce-overhead", "graphs")
    assert warnings == []
    plain, _ = run("default", "plain")
    assert sorted(graphs) == sorted(plain) and all(graphs[s] == pytest.approx(plain[s], rel=1e-4) for s in plain)
    masks = []
    monkeypatch.setattr(BlockMaskStorage, "keep", lambda self, mask: masks.append(mask) or mask)
    _, warnings = run("reduce-overhead", "moved")
    assert [w.split(" (")[0] for w in warnings] == ["warning: step 3 recorded CUDA graphs again after warm-up"]


# --- data ---------------------------------------------------------------------------------------------------------

EOS, SEQ_LEN, ALIGN = 256, 40, 8
# Lengths in bytes + EOS: shorter than ALIGN, odd, one longer than a row (continues on the next).
DOCS = [f"d{i}:" + "x" * (i * 7 % 23) + ("y" * 90 if i % 9 == 4 else "") for i in range(36)]


def make_loader(source, align: int = ALIGN, document_mask: bool = True, part: str = "train"):
    cfg = DataConfig(source=str(source), seq_len=SEQ_LEN, eval_fraction=0.25, document_mask=document_mask)
    return build_data_loader(cfg, split=part, batch_size=3, dp_rank=0, dp_world_size=1, seed=3, doc_align=align)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return path


def document_pairs(loader, n_batches: int) -> list[list[tuple[int, int]]]:
    """The (input, label) pairs of each document of the loader's token stream without document_mask: the pairs a
    document-masked loader must place, in this order."""
    stream = []
    for _ in range(n_batches):
        inputs, labels = next(loader)
        stream += torch.cat([inputs[:, :1], labels], 1).flatten().tolist()
    documents, current = [], []
    for token in stream:
        current.append(token)
        if token == EOS:
            documents.append(list(zip(current[:-1], current[1:])))
            current = []
    return documents


@pytest.mark.parametrize("align", [ALIGN, 1])
def test_loader_places_whole_documents_at_aligned_starts_with_ignored_padding(jsonl, align):
    loader = make_loader(jsonl, align)
    placed = []  # (input, label) pairs in order, padding left out
    for _ in range(12):
        inputs, labels, doc_start = next(loader)
        assert doc_start.dtype == torch.int32 and doc_start.shape == inputs.shape == labels.shape == (3, SEQ_LEN)
        t = torch.arange(SEQ_LEN)
        assert (doc_start[:, 0] == 0).all() and (doc_start <= t).all() and (doc_start % align == 0).all()
        assert (doc_start[:, 1:] >= doc_start[:, :-1]).all()
        padding = labels == IGNORE_INDEX
        assert (inputs[padding] == EOS).all() and (align > 1 or not padding.any())
        for b in range(3):
            starts = doc_start[b].unique().tolist() + [SEQ_LEN]
            for s, end in zip(starts[:-1], starts[1:]):
                real = (~padding[b, s:end]).sum().item()
                assert real > 0 and not padding[b, s:s + real].any(), "padding only after a document's tokens"
                assert end - s - real < align, "padding only up to the next aligned start"
                # within a document each label is the next input
                assert torch.equal(labels[b, s:s + real - 1], inputs[b, s + 1:s + real])
        placed += list(zip(inputs[~padding].tolist(), labels[~padding].tolist()))
    want = [pair for document in document_pairs(make_loader(jsonl, document_mask=False), 16) for pair in document]
    assert len(want) > len(placed) > 1000 and placed == want[:len(placed)]


@pytest.mark.parametrize("k", [0, 3, 7])
def test_document_loader_resumes_exactly(jsonl, k):
    original = make_loader(jsonl)
    for _ in range(k):
        next(original)
    state = pickle.loads(pickle.dumps(original.state_dict()))
    resumed = make_loader(jsonl)
    resumed.load_state_dict(state)
    for step in range(4):
        for got, want in zip(next(resumed), next(original), strict=True):
            assert torch.equal(got, want), f"batch {k + step}"


# --- config and trainer -------------------------------------------------------------------------------------------

def test_document_mask_without_documents_is_one_error_line():
    argv = ["--data.source", "synthetic", "--data.document_mask", "true"]
    with pytest.raises(ConfigError, match="data.document_mask = true needs documents"):
        load_config(argv)
    run = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["error: data.document_mask = true needs documents, but data.source = "
                                       "'synthetic' has none (random tokens, no boundaries): set data.document_mask "
                                       "= false or read real text"]


def test_trainer_feeds_document_starts_to_the_model_and_skips_padding(tmp_path, jsonl):
    """One step of the trainer with document_mask: its logged training loss is the loss of its first batches under
    the initial weights with doc_start (which differs without it), and its evaluation loss that of the final weights."""
    run_dir = tmp_path / "run"
    argv = [str(REPO / "recipes/debug.toml"), "--job.run_dir", str(run_dir), "--training.device", "cpu",
            "--training.mixed_precision", "fp32", "--data.source", str(jsonl), "--data.seq_len", "64",
            "--data.document_mask", "true",
            "--training.micro_batch_size", "2", "--training.global_batch_tokens", "256", "--training.steps", "1",
            "--lr_scheduler.warmup_steps", "0", "--training.eval_interval", "1", "--training.eval_batches", "1",
            "--metrics.log_freq", "1"]
    assert train.main(argv) == 0
    logged = scalars(event_files(run_dir)[0])
    config, _ = load_config([str(run_dir / "config.toml")])  # as the run resolved it (the tokenizer's vocabulary)
    torch.manual_seed(config.training.seed)
    model = build_model(config.model, torch.device("cpu"), lambda m: None)  # the trainer's initial weights
    loader_args = dict(batch_size=2, dp_rank=0, dp_world_size=1, seed=config.training.seed,
                       doc_align=document_alignment(config.model))
    batches = build_data_loader(config.data, split="train", **loader_args)

    def loss(inputs, labels, doc_start):
        return F.cross_entropy(model(inputs, doc_start).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    with torch.no_grad():
        first, second = next(batches), next(batches)
        assert (first[1] == IGNORE_INDEX).any() and (first[2] > 0).any()  # padding and several documents
        want = (loss(*first) + loss(*second)).item() / 2
        unmasked = (loss(*first[:2], None) + loss(*second[:2], None)).item() / 2
        assert logged["train/loss"][1] == pytest.approx(want, rel=1e-5)
        assert abs(unmasked - want) > 1e-3
        model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu"))
        eval_batch = next(build_data_loader(config.data, split="eval", **loader_args))
        assert logged["eval/loss"][1] == pytest.approx(loss(*eval_batch).item(), rel=1e-5)
