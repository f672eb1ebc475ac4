"""Model and plan behaviour against independent oracles: RoPE against complex multiplication, each activation-
checkpointing policy's recomputation counted op by op, every block compiled, the reference top-n with overlapping
blocks and fewer slots than candidates against the brute-force oracle, and the keys each window backend admits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

import nsa_models.model
from nsa_models import Transformer, get_flavor
from nsa_models.args import NSAArgs
from nsa_models.model import apply_rope, rope_cache
from nsa_models.nsa import nsa_attention
from nsa_models.nsa.reference import selection_scores
from parallelisms import apply_ac, parallelize
from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig
from tests.helpers import needs_flash_attn_4
from tests.nsa_oracle import oracle_nsa

T = 48  # tokens per sequence in these tests


def tiny_model(flavor: str = "debug", **nsa) -> Transformer:
    """The flavor at max_seq_len T on CPU, seeded; NSA keys in `nsa` override the flavor's."""
    args = get_flavor(flavor)
    args.max_seq_len = T
    for key, value in nsa.items():
        setattr(args.nsa, key, value)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


# --- RoPE ------------------------------------------------------------------------------------------------------

def complex_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, heads, D] rotated as complex numbers x[2i] + i x[2i+1] times e^(i t theta^(-2i/D)), in fp64."""
    D = x.shape[-1]
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), freqs)  # [T, D/2]
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def test_apply_rope_is_complex_rotation():
    x = torch.randn(2, T, 3, 16)
    torch.testing.assert_close(apply_rope(x, rope_cache(T, 16, 500.0)), complex_rope(x, 500.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("separate_kv", [False, True], ids=["shared_kv", "separate_kv"])
def test_nsa_rotates_queries_and_every_branchs_keys(separate_kv: bool, monkeypatch):
    model = tiny_model(separate_kv=separate_kv)
    attention, args = model.layers["0"].attention, model.args
    seen = {}

    def spy(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, nsa, **kwargs):
        seen.update(q=q, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win)
        return nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, nsa, **kwargs)

    monkeypatch.setattr(nsa_models.model, "nsa_attention", spy)
    x = torch.randn(2, T, args.dim)
    with torch.no_grad():
        attention(x, model.rope)
        q = attention.wq(x).unflatten(-1, (args.n_heads, args.head_dim))
        k = attention.wk(x).unflatten(-1, (-1, args.head_dim)).split(args.n_kv_heads, dim=2)
        v = attention.wv(x).unflatten(-1, (-1, args.head_dim)).split(args.n_kv_heads, dim=2)
    slc, win = (1, 2) if separate_kv else (0, 0)
    want = dict(q=complex_rope(q, args.rope_theta), k_slc=complex_rope(k[slc], args.rope_theta), v_slc=v[slc],
                k_win=complex_rope(k[win], args.rope_theta), v_win=v[win])  # values are never rotated
    for name, tensor in want.items():
        torch.testing.assert_close(seen[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_dense_rotates_queries_and_keys(monkeypatch):
    model = tiny_model("dense-debug")
    attention, args = model.layers["0"].attention, model.args
    seen = {}
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.update(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x = torch.randn(2, T, args.dim)
    with torch.no_grad():
        attention(x, model.rope)
        q = attention.wq(x).unflatten(-1, (args.n_heads, args.head_dim))
        k = attention.wk(x).unflatten(-1, (args.n_kv_heads, args.head_dim))
        v = attention.wv(x).unflatten(-1, (args.n_kv_heads, args.head_dim))
    want = dict(q=complex_rope(q, args.rope_theta), k=complex_rope(k, args.rope_theta), v=v)
    for name, tensor in want.items():
        torch.testing.assert_close(seen[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --- activation checkpointing: what each policy recomputes -----------------------------------------------------

class OpCounter(TorchDispatchMode):
    """Calls per aten / custom op that reach the dispatcher (an output served from a checkpoint's cache does not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


# What `selective_op` promises to keep of a reference-backend block (its matmuls and the block selection; it runs
# no fused attention); everything else of the block's forward is computed again in backward. `full` keeps only the
# block selection.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}
SELECTION = {torch.ops.nsa.select_blocks.default}


def backward_ops(model: Transformer, tokens: torch.Tensor) -> Counter:
    """The ops run by the backward of one step. Without early stop, a recomputation runs a block's whole forward
    (by default it stops once it has what backward needs, leaving out the block's last ops)."""
    with set_checkpoint_early_stop(False):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        with OpCounter() as counter:
            loss.backward()
    del counter.counts[torch.ops.aten.detach.default]  # bookkeeping: checkpointing detaches what it caches
    return counter.counts


@pytest.fixture(scope="module")
def ac_baseline() -> tuple[torch.Tensor, Counter, Counter]:
    """(tokens, the ops of one block's forward, the ops of the backward without AC)."""
    tokens = torch.randint(0, 256, (2, T + 1))
    model = tiny_model()
    h = model.tok_embeddings(tokens[:, :-1])
    with OpCounter() as forward:
        model.layers["0"](h, model.rope)
    del forward.counts[torch.ops.aten.detach.default]
    return tokens, forward.counts, backward_ops(tiny_model(), tokens)


@pytest.mark.parametrize("cfg, recomputed_blocks, kept", [
    (ActivationCheckpointConfig(mode="none"), 0, set()),
    (ActivationCheckpointConfig(mode="full"), 2, SELECTION),
    (ActivationCheckpointConfig(mode="every_n", every_n=2), 1, SELECTION),
    (ActivationCheckpointConfig(mode="selective_op"), 2, SELECTION | MATMULS),
], ids=["none", "full", "every_2", "selective_op"])
def test_each_ac_policy_recomputes_exactly_what_it_says(cfg, recomputed_blocks: int, kept: set, ac_baseline):
    tokens, block_forward, plain_backward = ac_baseline
    model = tiny_model()
    apply_ac(model, cfg)
    extra = backward_ops(model, tokens)
    extra.subtract(plain_backward)
    recomputed = {op: n for op, n in extra.items() if n}
    want = {op: recomputed_blocks * n for op, n in block_forward.items() if op not in kept and recomputed_blocks}
    assert recomputed == want
    if cfg.mode != "none":
        assert any(op in MATMULS for op in block_forward) and SELECTION <= set(block_forward)  # the test means it


# --- compile ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ac", ["none", "full", "selective_op"])
def test_parallelize_compiles_every_block(ac: str):
    model = tiny_model()
    plain = dict(model.layers.named_children())
    parallelize(model, ParallelismConfig(), ActivationCheckpointConfig(mode=ac), CompileConfig(enable=True),
                Float8Config(), mesh=None, mixed_precision_dtype=torch.float32)
    for name, block in model.layers.named_children():
        assert isinstance(block, OptimizedModule), f"block {name} is not compiled"
        inner = block._orig_mod
        if ac != "none":  # AC applies first, so that compile traces the checkpointed block
            assert isinstance(inner, CheckpointWrapper), f"block {name}: compile does not wrap the checkpointed block"
            inner = inner._checkpoint_wrapped_module
        assert inner is plain[name]


def test_parallelize_compiles_the_whole_forward_in_model_scope():
    model = tiny_model()
    forward = model.forward
    parallelize(model, ParallelismConfig(), ActivationCheckpointConfig(), CompileConfig(enable=True, scope="model"),
                Float8Config(), mesh=None, mixed_precision_dtype=torch.float32)
    assert getattr(model.forward, "_torchdynamo_orig_callable", None) == forward


# --- selection: overlapping compressed / selection blocks, fewer slots than candidates --------------------------

def cmp_block_count(seq_len: int, l: int, d: int) -> int:
    """Compressed blocks [i*d, i*d + l) inside seq_len tokens, counted."""
    return len(range(0, seq_len - l + 1, d))


def overlap_matrix(n_cmp: int, n_sel: int, l: int, d: int, lp: int) -> torch.Tensor:
    """|cmp block i ∩ selection block j| / d, counted token by token."""
    overlap = [[len(set(range(i * d, i * d + l)) & set(range(j * lp, (j + 1) * lp))) / d for j in range(n_sel)]
               for i in range(n_cmp)]
    return torch.tensor(overlap, dtype=torch.float64).reshape(n_cmp, n_sel)


@pytest.mark.parametrize("l, d, lp", [(16, 16, 16), (32, 16, 64), (32, 8, 32), (64, 16, 32), (48, 16, 64)])
@pytest.mark.parametrize("seq_len", [63, 64, 200])
def test_selection_scores_are_the_overlap_weighted_sum(l: int, d: int, lp: int, seq_len: int):
    args = NSAArgs(cmp_block_size=l, cmp_stride=d, sel_block_size=lp)
    n_cmp, n_sel = cmp_block_count(seq_len, l, d), -(-seq_len // lp)
    p_cmp = torch.rand(2, 2, 3, 5, n_cmp, dtype=torch.float64)  # [B, H, G, C, Nc]
    want = p_cmp.sum(2) @ overlap_matrix(n_cmp, n_sel, l, d, lp)
    torch.testing.assert_close(selection_scores(p_cmp, seq_len, args), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hyper, seq_len", [
    (dict(cmp_block_size=32, cmp_stride=16, sel_block_size=32, n_selected=4, window_size=16), 256),
    (dict(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=4, window_size=16), 448),
    (dict(cmp_block_size=64, cmp_stride=16, sel_block_size=32, n_selected=5, window_size=16), 256),
], ids=["l=l'=2d", "l'=2l=4d", "l=2l'=4d"])
def test_reference_top_n_with_overlapping_blocks_matches_brute_force(hyper: dict, seq_len: int):
    args = NSAArgs(**hyper, query_chunk=96)
    n_cmp, H, G, D = cmp_block_count(seq_len, args.cmp_block_size, args.cmp_stride), 2, 2, 8
    torch.manual_seed(0)
    shapes = [(1, seq_len, H * G, D)] + [(1, seq_len, H, D)] * 4 + [(1, n_cmp, H, D)] * 2
    # Scaled-up queries sharpen the compressed softmax, so the ranking depends on the inputs, not on ties.
    inputs = [torch.randn(s, dtype=torch.float64) * (4.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]
    gates = torch.rand(1, seq_len, H * G, 3, dtype=torch.float64)
    out, idx, _ = nsa_attention(*inputs, gates, args)
    want, want_idx = oracle_nsa(*inputs, gates, args)
    candidates = seq_len // args.sel_block_size
    assert candidates > args.n_selected  # later queries must drop candidates
    assert torch.equal(idx, want_idx), "selected blocks differ from the brute-force oracle's"
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)


# --- sliding window: exactly keys t-w < u <= t, for every window backend ----------------------------------------

W = 5


def admitted_keys(window_attention) -> torch.Tensor:
    """[T, T] bool: the keys each query attends. With zero queries every admitted key gets the same weight, and
    one-hot values (value u = e_u) make the output row of query t that weight at each admitted key."""
    D = 64  # >= T, and a head size every backend takes
    q = torch.zeros(1, T, 2, D)
    v = torch.eye(T, D).expand(1, 2, T, D).transpose(1, 2)  # [B, T, H, D]
    out = window_attention(q, torch.randn(1, T, 2, D), v)[0, :, :, :T].float()  # [T, H, T]
    assert torch.equal(out[:, 0] > 0.5 / T, out[:, 1] > 0.5 / T)
    return out[:, 0] > 0.5 / T


def expected_window() -> torch.Tensor:
    t = torch.arange(T)
    return (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W)


def test_reference_window_admits_exactly_the_window():
    args = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=2, window_size=W)
    n_cmp = cmp_block_count(T, 16, 8)

    def window_only(q, k, v):
        kv_cmp = torch.randn(1, n_cmp, 2, q.shape[-1])
        gates = torch.tensor([0.0, 0.0, 1.0]).expand(1, T, 2, 3)
        return nsa_attention(q, torch.randn_like(k), torch.randn_like(v), k, v, kv_cmp, kv_cmp, gates, args)[0]

    assert torch.equal(admitted_keys(window_only), expected_window())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: it runs on CPU
def test_flex_window_mask_mod_admits_exactly_the_window():
    from torch.nn.attention.flex_attention import flex_attention

    from nsa_models.nsa.triton_backend import _window_block_mask

    block_mask = _window_block_mask(T, W, "cpu", compile_mask=False)
    t = torch.arange(T)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(block_mask.mask_mod(zero, zero, t[:, None], t[None, :]), expected_window())

    def flex_window(q, k, v):  # the mask through FlexAttention itself (eager, forward: it runs on CPU)
        out = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)

    assert torch.equal(admitted_keys(flex_window), expected_window())


@pytest.mark.parametrize("window_backend, device", [
    ("flex", "cpu"), ("sdpa", "cpu"),
    *(pytest.param(name, "cuda", marks=pytest.mark.gpu) for name in ("flex", "sdpa", "flash_attn", "flash_attn_4")),
])
def test_triton_backend_window_admits_exactly_the_window(window_backend: str, device: str):
    """Every window backend of the `triton` NSA backend where it runs: off the GPU, `flex` and `sdpa` take the
    masked-SDPA path; FlexAttention's kernel and the flash-attn ones need a GPU."""
    if window_backend == "flash_attn":
        pytest.importorskip("flash_attn", reason="flash-attn 2 is not installed")
    if window_backend == "flash_attn_4":
        needs_flash_attn_4()
    from nsa_models.nsa.triton_backend import window_attention

    args = NSAArgs(window_size=W, window_backend=window_backend)
    dtype = torch.bfloat16 if window_backend.startswith("flash_attn") else torch.float32

    def on_device(q, k, v):
        return window_attention(*(x.to(device, dtype) for x in (q, k, v)), args).cpu()

    assert torch.equal(admitted_keys(on_device), expected_window())
