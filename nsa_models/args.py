"""Model hyper-parameters and the named flavors.

`ModelArgs` is also the `[model]` section of a recipe: every field below is a recipe key (`model.dim`,
`model.nsa.sel_block_size`, ...). A flavor names a complete set of values; keys a recipe sets explicitly
override the flavor's.

Most fields say what the model computes, so a resumed run that changes one names another model than its checkpoint's
and is refused. A field typed `Annotated[T, RESUMABLE]` says only how it computes (a kernel, a chunk size, the
initialisation the checkpoint replaces): a resume may change it. Unmarked is the default, so a new field is safe until
someone decides otherwise; `resumable_keys()` collects the marks (the mark sits in the type because `metadata` holds
the value's bounds, each entry of which the recipe loader checks as one).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args, get_origin, get_type_hints


class _Resumable:
    """The type of RESUMABLE."""

    def __repr__(self) -> str:
        return "RESUMABLE"


# A field's mark, `name: Annotated[T, RESUMABLE] = ...`: a resumed run may change its value (see the module docstring).
RESUMABLE = _Resumable()


@dataclass
class NSAArgs:
    """Native Sparse Attention hyper-parameters (`docs/NSA_SPEC.md`, symbols in brackets)."""

    cmp_block_size: int = field(default=32, metadata={"gt": 0})
    """[l] tokens per compressed block."""
    cmp_stride: int = field(default=16, metadata={"gt": 0})
    """[d] stride between consecutive compressed blocks; must divide cmp_block_size and sel_block_size."""
    sel_block_size: int = field(default=64, metadata={"gt": 0})
    """[l'] tokens per selection block."""
    n_selected: int = field(default=16, metadata={"ge": 3})
    """[n] selection blocks attended per query, the forced ones (block 0 and the two most recent) included."""
    window_size: int = field(default=512, metadata={"gt": 0})
    """[w] sliding-window length: query t attends keys t-w+1 .. t."""
    compress: Literal["mlp", "mean"] = "mlp"
    """Compression function phi: `mlp` (learned, with an intra-block position embedding) or `mean` pooling."""
    cmp_mlp_hidden: int = field(default=0, metadata={"ge": 0})
    """Hidden width of the `mlp` phi; 0 means max(head_dim, cmp_block_size * head_dim / 8)."""
    separate_kv: bool = False
    """Give each branch (cmp, slc, win) its own K/V projection, as the paper does; False shares one."""
    backend: Annotated[Literal["reference", "triton"], RESUMABLE] = "reference"
    """Implementation of the attention core: `reference` (vectorised PyTorch, any device) or `triton`."""
    window_backend: Annotated[Literal["flex", "sdpa", "flash_attn", "flash_attn_4", "gluon_hopper",
                                      "fused_with_selected"], RESUMABLE] = "flex"
    """Sliding-window implementation of the `triton` backend: FlexAttention, masked SDPA, flash-attn 2's
    window_size, FlashAttention-4 (package flash-attn-4; Hopper or newer GPUs; see docs/PERFORMANCE.md),
    `gluon_hopper` (the fused sweep's Gluon kernels without the selected branch: Hopper, bf16, head dim 64 or 128, no
    context parallelism; nsa-125m at 8k on an H200: NSA / dense 0.89 against flex's 0.86 without documents, 0.83
    against 0.82 with them), or `fused_with_selected`: one sweep computes the selected and window branches together
    (shared K/V only, and sequences of at most MAX_FUSED_BLOCKS selection blocks: its work grows as T^2;
    docs/KERNELS.md; the nsa_125m recipes' choice: NSA / dense 0.84 against flex's 0.78-0.80 at 2k on documents).
    Any value but `flex` needs backend `triton` (the reference computes the window itself)."""
    cmp_backend: Annotated[Literal["triton", "flash_attn_4"], RESUMABLE] = "triton"
    """Compressed-attention kernels of the `triton` backend: our Triton kernels, or FlashAttention-4's causal
    kernel (package flash-attn-4; Hopper or newer, bf16), which serves the compressed branch once each run of d
    consecutive queries is packed as heads (`fa4.fa4_compressed_attention`). Measured (H200, the compiled core at
    64 heads of 128, G = 16, one run): 4% faster at 64k, even at 32k, 11% slower at 8k (docs/PERFORMANCE.md)."""
    float_atomics: Annotated[bool, RESUMABLE] = False
    """Let the library backwards (window_backend `flash_attn` or `flash_attn_4`, cmp_backend `flash_attn_4`)
    accumulate their gradients with float atomics: faster at 64 heads of 128 (FA4 window, 8k: NSA core 8.16 ->
    7.97 ms fwd+bwd; no gain measured for nsa-125m end to end; docs/PERFORMANCE.md), but no longer
    bitwise repeatable, so the same seed and recipe may give other losses. Off: every NSA backward kernel is
    deterministic. The Triton kernels have no atomic variant (measured slower, docs/KERNELS.md)."""
    selected_from_window: Annotated[bool, RESUMABLE] = True
    """The triton backend's exact shortcut for shared K/V (`separate_kv = false`, any window_backend but
    `fused_with_selected`): a query whose causal prefix in its document holds at most n selection blocks selects
    them all, so its selected branch attends keys doc_start .. t, and while t - doc_start < w so does its window.
    Those rows take the window's output as their selected output, and the selected kernels skip them (at T = 2048
    without documents the first w queries; on real text most of a short document's). False: every row runs the
    selected kernels (the A/B)."""
    selected_kernels: Annotated[Literal["triton", "gluon_hopper"], RESUMABLE] = "triton"
    """Key-block-major kernels of the `triton` backend's selected branch: the forward's item kernel and the
    backward's dK/dV kernel (`triton_selected`), or their Gluon versions written for Hopper (`gluon_selected`:
    cp.async gathers double-buffered, wgmma products); with window_backend = "fused_with_selected", that sweep's
    forward, dQ and dK/dV kernels too (`gluon_selected_window`: 1.05-1.55x Triton's at nsa-125m's and nsa-1b's
    heads on an H200, docs/KERNELS.md). The query-tile kernels and the rest stay Triton's. Gluon runs
    on CUDA GPUs of capability 9.x, bf16, head dim 64 or 128, sel_block_size 64 and at most 64 query heads per KV
    head; refused elsewhere, in one line at startup (no silent fallback). The Triton kernels stay the portable path.
    Measured effect (docs/PERFORMANCE.md, one H200 each): nsa-125m +1.7% tokens/s at 2k, +5.3% at 8k (NSA / dense
    0.82 -> 0.86); nsa-1b with full AC +3.2% at 8k, +2.6% at 32k; with the fused sweep at 2k NSA / dense 0.76
    against 0.70 (the nsa_125m recipes set it)."""
    query_chunk: Annotated[int, RESUMABLE] = field(default=512, metadata={"gt": 0})
    """Queries processed together by the reference backend; bounds its peak memory, not its result."""
    window_only: bool = False
    """Ablation: the attention is the sliding-window branch alone (its gate times its output); the compressed and
    selected branches get gate 0, so they add nothing and learn nothing (they still run: a step costs what NSA's
    does). Every parameter stays, so an NSA run and its window-only twin differ in this key alone
    (recipes/retrieval_nsa.toml). Any backend."""

    def on_reference(self) -> NSAArgs:
        """These settings run by the `reference` backend (a CPU): the triton backend's kernel choices, which the
        reference has none of, back at their defaults. The attention they compute is the same."""
        kernels = {f.name: f.default for f in dataclasses.fields(self) if f.name in KERNEL_KEYS}
        return dataclasses.replace(self, backend="reference", **kernels)

    def cmp_hidden(self, head_dim: int) -> int:
        """Hidden width of the `mlp` phi."""
        return self.cmp_mlp_hidden or max(head_dim, self.cmp_block_size * head_dim // 8)

    def num_cmp_blocks(self, seq_len: int) -> int:
        """[Nc] compressed blocks [i*d, i*d + l) that fit in seq_len tokens."""
        return max(0, (seq_len - self.cmp_block_size) // self.cmp_stride + 1)

    def num_sel_blocks(self, seq_len: int) -> int:
        """Selection blocks [j*l', (j+1)*l') covering seq_len tokens (the last one may be partial)."""
        return -(-seq_len // self.sel_block_size)


# The keys that choose the triton backend's kernels: how it computes, not what (the reference has none of them).
KERNEL_KEYS = ("window_backend", "cmp_backend", "float_atomics", "selected_from_window", "selected_kernels")
# window_backend / cmp_backend -> (the module it imports, the pip package that provides it), for the optional ones
LIBRARY_PACKAGES = {"flash_attn": ("flash_attn", "flash-attn"), "flash_attn_4": ("flash_attn.cute", "flash-attn-4")}
# the choices of each library-backed key that need no extra package (what its errors offer instead)
BUILT_IN_BACKENDS = {"window_backend": ("flex", "sdpa"), "cmp_backend": ("triton",)}
# The triton backend's kernels run one row of programs per (sequence, KV head) of a micro-batch, in the second or
# third dimension of the CUDA grid, which holds at most 65,535 (`training.micro_batch_size` x `n_kv_heads` at most).
TRITON_MAX_BATCH_HEADS = 65535
# Selection blocks a sequence may have under window_backend = "fused_with_selected": its sweep walks every block of
# each query's causal prefix (work ~ T^2, where the separate kernels' grows as T n l'); one int64 bitmask a query.
MAX_FUSED_BLOCKS = 64


@dataclass
class ModelArgs:
    """A LLaMA-style decoder whose attention is NSA (or dense causal attention for the baselines)."""

    flavor: Annotated[str, RESUMABLE] = "debug"
    """Named preset (see FLAVORS) that supplies every value a recipe does not set."""
    attention: Literal["nsa", "dense"] = "nsa"
    """`nsa`: Native Sparse Attention; `dense`: full causal attention through SDPA (the baseline twin)."""
    dim: int = field(default=128, metadata={"gt": 0})
    """Model width d_model."""
    n_layers: int = field(default=2, metadata={"gt": 0})
    """Number of transformer blocks."""
    n_heads: int = field(default=4, metadata={"gt": 0})
    """Query heads HQ."""
    n_kv_heads: int = field(default=2, metadata={"gt": 0})
    """Key/value heads H; must divide n_heads (GQA group size G = n_heads / n_kv_heads)."""
    head_dim: int = field(default=32, metadata={"gt": 0, "multiple_of": 2})
    """Per-head dimension (dk = dv)."""
    vocab_size: int = field(default=0, metadata={"ge": 0})
    """Embedding rows. 0: the tokenizer's vocabulary (`data.tokenizer`) rounded up to a multiple of 64, for
    GEMM shapes the GPU's tensor cores take at full speed (GPT-2's 50257 ids give 50304); the trainer resolves it and
    the run's saved config records the number. A set value must be at least the tokenizer's vocabulary."""
    ffn_hidden: int = field(default=0, metadata={"ge": 0})
    """SwiGLU hidden width; 0 means 8/3 * dim rounded up to a multiple of 256 (of 64 below dim 512)."""
    norm_eps: float = field(default=1e-5, metadata={"gt": 0})
    """RMSNorm epsilon."""
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    """RoPE base frequency."""
    max_seq_len: int = field(default=256, metadata={"gt": 0})
    """Longest sequence the RoPE table covers; training seq_len must not exceed it."""
    init_std: Annotated[float, RESUMABLE] = field(default=0.02, metadata={"gt": 0})
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    tie_embeddings: bool = False
    """Share the token embedding and the output head."""
    nsa: NSAArgs = field(default_factory=NSAArgs)
    """NSA hyper-parameters (used when attention is `nsa`)."""

    @property
    def n_groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        multiple = 256 if self.dim >= 512 else 64
        hidden = int(8 * self.dim / 3)
        return multiple * ((hidden + multiple - 1) // multiple)

    def validate(self) -> None:
        """Raise ValueError naming the field when the combination cannot be built. Each value's own bounds are
        its field's metadata (`gt`, `ge`, `multiple_of`: head_dim is even for RoPE), checked by the recipe loader."""
        checks = [(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", "must divide model.n_heads")]
        if self.attention == "nsa":
            a = self.nsa
            checks += [
                (a.cmp_block_size % a.cmp_stride == 0, "nsa.cmp_stride", "must divide model.nsa.cmp_block_size"),
                (a.sel_block_size % a.cmp_stride == 0, "nsa.cmp_stride", "must divide model.nsa.sel_block_size"),
                # The reference backend computes every branch itself: a kernel choice would be silently ignored.
                (a.window_backend == "flex" or a.backend == "triton", "nsa.window_backend",
                 f"= {a.window_backend!r} needs backend = 'triton' (the reference computes every branch itself): "
                 "set model.nsa.backend = 'triton' (a CUDA GPU), or leave window_backend at 'flex'"),
                (a.window_backend != "fused_with_selected" or not a.separate_kv, "nsa.window_backend",
                 "= 'fused_with_selected' computes the window with the selected branch's keys and values: it needs "
                 "model.nsa.separate_kv = false, or another window_backend"),
                (a.window_backend != "fused_with_selected" or -(-self.max_seq_len // a.sel_block_size)
                 <= MAX_FUSED_BLOCKS, "nsa.window_backend",
                 f"= 'fused_with_selected' runs sequences of at most {MAX_FUSED_BLOCKS} selection blocks "
                 f"({MAX_FUSED_BLOCKS * a.sel_block_size} tokens; its work grows as T^2), but model.max_seq_len = "
                 f"{self.max_seq_len}: lower model.max_seq_len, or set window_backend = 'gluon_hopper' (Hopper, "
                 "bf16) or 'flex'"),
                (a.cmp_backend == "triton" or a.backend == "triton", "nsa.cmp_backend",
                 f"= {a.cmp_backend!r} needs backend = 'triton' (the reference computes every branch itself): "
                 "set model.nsa.backend = 'triton' (a CUDA GPU), or leave cmp_backend at 'triton'"),
                (not a.float_atomics or (a.backend == "triton" and (a.window_backend in LIBRARY_PACKAGES
                                                                    or a.cmp_backend in LIBRARY_PACKAGES)),
                 "nsa.float_atomics", "= true needs backend = 'triton' with window_backend = 'flash_attn' or "
                 "'flash_attn_4', or cmp_backend = 'flash_attn_4' (the only kernels with an atomic backward); set it "
                 "to false"),
            ]
            if a.selected_kernels == "gluon_hopper":
                key, fix = "nsa.selected_kernels", "set model.nsa.selected_kernels = 'triton'"
                checks += [
                    (a.backend == "triton", key, "= 'gluon_hopper' needs backend = 'triton' (the reference computes "
                     f"every branch itself): set model.nsa.backend = 'triton' (a CUDA GPU), or {fix}"),
                    (a.sel_block_size == 64, key, "= 'gluon_hopper' runs selection blocks of 64 keys, but "
                     f"model.nsa.sel_block_size = {a.sel_block_size}: set it to 64, or {fix}"),
                ]
            for name, default in (("selected_kernels", "triton"), ("window_backend", "flex")):
                if getattr(a, name) != "gluon_hopper":
                    continue
                # the Gluon kernels' shapes (`gluon_selected.supported`, `gluon_selected_window.supported`)
                key, fix = f"nsa.{name}", f"set model.nsa.{name} = {default!r}"
                checks += [
                    (self.head_dim in (64, 128), key, "= 'gluon_hopper' runs head dim 64 or 128, but "
                     f"model.head_dim = {self.head_dim}: {fix}"),
                    (self.n_groups <= 64, key, "= 'gluon_hopper' runs at most 64 query heads per KV head, but "
                     f"model.n_heads / model.n_kv_heads = {self.n_groups}: {fix}"),
                ]
        for ok, key, why in checks:
            if not ok:
                raise ValueError(f"model.{key} {why}")


def _flavor(attention: str, nsa: NSAArgs | None = None, **kw) -> ModelArgs:
    return ModelArgs(attention=attention, nsa=nsa or NSAArgs(), **kw)


_SIZES: dict[str, dict] = {
    # Tiny: trains on 2 CPU cores in minutes. Block sizes shrunk so that T=256 exercises every branch. Its vocabulary
    # is fixed (the byte tokenizer's 257 ids, rounded up to 8) so that tests can build the model without a tokenizer;
    # recipes/debug.toml sets vocab_size = 0, so a run follows its tokenizer.
    "debug": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=264, max_seq_len=256),
    # GPT-2-small-sized: 12 query heads of 64, 4 KV heads (G=3). These follow the tokenizer (vocab_size 0).
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, max_seq_len=2048),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, head_dim=64, max_seq_len=2048),
    "1b": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=4, head_dim=128, ffn_hidden=5632, max_seq_len=4096),
    # Llama-3.2-3B's layout (24 query heads of 128, 8 KV heads: G=3) and Mistral-7B's (32 of 128, 8 KV: G=4), at the
    # 8k context the NSA paper pretrains with; NSA's settings are the paper's (NSAArgs' defaults).
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_hidden=8192, max_seq_len=8192),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden=14336, max_seq_len=8192),
}
_DEBUG_NSA = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=4, window_size=32, query_chunk=256)

FLAVORS: dict[str, ModelArgs] = {}
for _size, _kw in _SIZES.items():
    _nsa = _DEBUG_NSA if _size == "debug" else NSAArgs()
    for _attention in ("nsa", "dense"):
        _name = f"{_attention}-{_size}" if _size != "debug" else ("debug" if _attention == "nsa" else "dense-debug")
        FLAVORS[_name] = _flavor(_attention, dataclasses.replace(_nsa), flavor=_name, **_kw)


def get_flavor(name: str) -> ModelArgs:
    """A fresh copy of a named flavor (KeyError lists the valid names)."""
    if name not in FLAVORS:
        raise KeyError(f"unknown model flavor {name!r}; valid: {', '.join(FLAVORS)}")
    args = FLAVORS[name]
    return dataclasses.replace(args, nsa=dataclasses.replace(args.nsa))


@functools.cache
def resumable_keys(cls: type = ModelArgs) -> frozenset[str]:
    """The dotted keys (`flavor`, `nsa.backend`, ...) of `cls`'s fields marked RESUMABLE, its nested sections' too:
    the model keys a resumed run may change (the recipe key is `model.` + the key)."""
    hints, keys = get_type_hints(cls, include_extras=True), set()
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        marks = hint.__metadata__ if get_origin(hint) is Annotated else ()
        value_type = get_args(hint)[0] if marks else hint
        if dataclasses.is_dataclass(value_type):
            keys |= {f"{f.name}.{key}" for key in resumable_keys(value_type)}
        elif any(mark is RESUMABLE for mark in marks):
            keys.add(f.name)
    return frozenset(keys)
