"""Model hyper-parameters and the named flavors.

`ModelArgs` is also the `[model]` section of a recipe: every field below is a recipe key (`model.dim`,
`model.nsa.sel_block_size`, ...). A flavor names a complete set of values; keys a recipe sets explicitly
override the flavor's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class NSAArgs:
    """Native Sparse Attention hyper-parameters (`docs/NSA_SPEC.md`, symbols in brackets)."""

    cmp_block_size: int = 32
    """[l] tokens per compressed block."""
    cmp_stride: int = 16
    """[d] stride between consecutive compressed blocks; must divide cmp_block_size and sel_block_size."""
    sel_block_size: int = 64
    """[l'] tokens per selection block."""
    n_selected: int = 16
    """[n] selection blocks attended per query, the forced ones (block 0 and the two most recent) included."""
    window_size: int = 512
    """[w] sliding-window length: query t attends keys t-w+1 .. t."""
    compress: Literal["mlp", "mean"] = "mlp"
    """Compression function phi: `mlp` (learned, with an intra-block position embedding) or `mean` pooling."""
    cmp_mlp_hidden: int = 0
    """Hidden width of the `mlp` phi; 0 means max(head_dim, cmp_block_size * head_dim / 8)."""
    separate_kv: bool = False
    """Give each branch (cmp, slc, win) its own K/V projection, as the paper does; False shares one."""
    backend: Literal["reference", "triton"] = "reference"
    """Implementation of the attention core: `reference` (vectorised PyTorch, any device) or `triton`."""
    window_backend: Literal["flex", "sdpa", "flash_attn", "flash_attn_4"] = "flex"
    """Sliding-window implementation of the `triton` backend: FlexAttention, masked SDPA, flash-attn 2's
    window_size, or FlashAttention-4 (package flash-attn-4; Hopper or newer GPUs; the fastest measured, see
    docs/PERFORMANCE.md). The `reference` backend computes the window itself and ignores this key."""
    cmp_backend: Literal["triton", "flash_attn_4"] = "triton"
    """Compressed-attention kernels of the `triton` backend: our Triton kernels, or FlashAttention-4's causal
    kernel (package flash-attn-4; Hopper or newer, bf16), which serves the compressed branch once each run of d
    consecutive queries is packed as heads (`fa4.fa4_compressed_attention`). Measured (H200, the compiled core at
    64 heads of 128, G = 16, one run): 4% faster at 64k, even at 32k, 11% slower at 8k (docs/PERFORMANCE.md,
    session 28)."""
    float_atomics: bool = False
    """Let the library backwards (window_backend `flash_attn` or `flash_attn_4`, cmp_backend `flash_attn_4`)
    accumulate their gradients with float atomics: faster at 64 heads of 128 (FA4 window, 8k: NSA core 8.16 ->
    7.97 ms fwd+bwd; no gain measured for nsa-125m end to end; docs/PERFORMANCE.md session 26), but no longer
    bitwise repeatable, so the same seed and recipe may give other losses. Off: every NSA backward kernel is
    deterministic. The Triton kernels have no atomic variant (measured slower, session 20)."""
    query_chunk: int = 512
    """Queries processed together by the reference backend; bounds its peak memory, not its result."""

    def cmp_hidden(self, head_dim: int) -> int:
        """Hidden width of the `mlp` phi."""
        return self.cmp_mlp_hidden or max(head_dim, self.cmp_block_size * head_dim // 8)


# window_backend / cmp_backend -> (the module it imports, the pip package that provides it), for the optional ones
LIBRARY_PACKAGES = {"flash_attn": ("flash_attn", "flash-attn"), "flash_attn_4": ("flash_attn.cute", "flash-attn-4")}
# the choices of each library-backed key that need no extra package (what its errors offer instead)
BUILT_IN_BACKENDS = {"window_backend": ("flex", "sdpa"), "cmp_backend": ("triton",)}


def missing_package(key: str, backend: str) -> str:
    """The one-line error for model.nsa.<key> = backend (window_backend or cmp_backend) whose package
    (LIBRARY_PACKAGES) is not installed."""
    package = LIBRARY_PACKAGES[backend][1]
    return (f"model.nsa.{key} = {backend!r} needs the {package} package (pip install {package}); or set it to "
            + " or ".join(map(repr, BUILT_IN_BACKENDS[key])))


@dataclass
class ModelArgs:
    """A LLaMA-style decoder whose attention is NSA (or dense causal attention for the baselines)."""

    flavor: str = "debug"
    """Named preset (see FLAVORS) that supplies every value a recipe does not set."""
    attention: Literal["nsa", "dense"] = "nsa"
    """`nsa`: Native Sparse Attention; `dense`: full causal attention through SDPA (the baseline twin)."""
    dim: int = 128
    """Model width d_model."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads HQ."""
    n_kv_heads: int = 2
    """Key/value heads H; must divide n_heads (GQA group size G = n_heads / n_kv_heads)."""
    head_dim: int = 32
    """Per-head dimension (dk = dv)."""
    vocab_size: int = 264
    """Embedding rows; must be at least the tokenizer's vocabulary."""
    ffn_hidden: int = 0
    """SwiGLU hidden width; 0 means 8/3 * dim rounded up to a multiple of 256 (of 64 below dim 512)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    max_seq_len: int = 256
    """Longest sequence the RoPE table covers; training seq_len must not exceed it."""
    init_std: float = 0.02
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
        """Raise ValueError naming the field when the combination cannot be built."""
        checks = [
            (self.n_heads % self.n_kv_heads == 0, "n_kv_heads", "must divide model.n_heads"),
            (self.dim > 0 and self.n_layers > 0 and self.head_dim > 0, "dim", "dim, n_layers, head_dim must be > 0"),
        ]
        if self.attention == "nsa":
            a = self.nsa
            checks += [
                (a.cmp_block_size % a.cmp_stride == 0, "nsa.cmp_stride", "must divide model.nsa.cmp_block_size"),
                (a.sel_block_size % a.cmp_stride == 0, "nsa.cmp_stride", "must divide model.nsa.sel_block_size"),
                (a.n_selected >= 3, "nsa.n_selected", "must be >= 3 (block 0 and the two most recent are forced)"),
                (a.window_size >= 1, "nsa.window_size", "must be >= 1"),
                (a.query_chunk >= 1, "nsa.query_chunk", "must be >= 1"),
                (a.cmp_backend == "triton" or a.backend == "triton", "nsa.cmp_backend",
                 "= 'flash_attn_4' needs backend = 'triton' (the reference computes every branch itself)"),
                (not a.float_atomics or (a.backend == "triton" and (a.window_backend in LIBRARY_PACKAGES
                                                                    or a.cmp_backend in LIBRARY_PACKAGES)),
                 "nsa.float_atomics", "= true needs backend = 'triton' with window_backend = 'flash_attn' or "
                 "'flash_attn_4', or cmp_backend = 'flash_attn_4' (the only kernels with an atomic backward); set it "
                 "to false"),
            ]
        for ok, key, why in checks:
            if not ok:
                raise ValueError(f"model.{key} {why}")


def _flavor(attention: str, nsa: NSAArgs | None = None, **kw) -> ModelArgs:
    return ModelArgs(attention=attention, nsa=nsa or NSAArgs(), **kw)


_SIZES: dict[str, dict] = {
    # Tiny: trains on 2 CPU cores in minutes. Block sizes shrunk so that T=256 exercises every branch.
    "debug": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=264, max_seq_len=256),
    # GPT-2-small-sized: 12 query heads of 64, 4 KV heads (G=3), vocab 50304.
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, vocab_size=50304, max_seq_len=2048),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, head_dim=64, vocab_size=50304, max_seq_len=2048),
    "1b": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=4, head_dim=128, ffn_hidden=5632, vocab_size=50304,
               max_seq_len=4096),
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
