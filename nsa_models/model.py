"""A plain single-device LLaMA-style decoder with NSA (or dense causal) attention.

Nothing here knows about parallelism: DDP, FSDP2, activation checkpointing, compile and float8 are applied
from outside (`parallelisms/`). Blocks live in `layers` (a ModuleDict keyed "0".."N-1") so that checkpoints and
per-block wrapping address them by stable names. `__init__` only allocates (it works on the meta device);
`init_weights()` fills parameters and buffers after materialisation, sharded (DTensor) or not, with the values one
process draws from the seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.flex_attention import BlockMask

from nsa_models.args import ModelArgs, NSAArgs
from nsa_models.nsa import nsa_attention, window_mask
from nsa_models.nsa.flex import BlockMaskStorage, document_block_mask, flex
from nsa_models.telemetry import TelemetryInputs, nsa_stats

# Rows of NSAAttention's query-and-gate product are padded to a multiple of this (`_query_and_gate_logits`).
_PRODUCT_ROWS = 64


def normal_(param: Tensor, std: float) -> None:
    """Fill `param` from N(0, std^2) as one process would draw it whole, however it is sharded: a DTensor
    (FSDP2 / HSDP) draws the full tensor with the default generator and keeps its own shard. DTensor's own random
    ops would give each mesh other numbers, so the same seed would start FSDP on 4 GPUs, HSDP 2 x 2 and one GPU
    from different weights. Every rank must make the same calls in the same order (same seed)."""
    if not isinstance(param, DTensor):
        nn.init.normal_(param, std=std)
        return
    full = nn.init.normal_(torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device), std=std)
    # src_data_rank=None: each rank keeps its slice of its own identical draw, no communication.
    param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                           .to_local())


def rope_cache(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """[seq_len, head_dim // 2, 2] cos/sin table (real-valued: friendlier to inductor than complex)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, cache: Tensor) -> Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x [B, T, heads, D] by the positions' angles. cache: the table
    (positions 0 .. T-1) or per-token rows [B, T, head_dim // 2, 2] (`Transformer.forward` with documents)."""
    if cache.dim() == 3:
        cache = cache[:x.shape[1]]
    xr = x.float().unflatten(-1, (-1, 2))
    cos, sin = cache[..., None, :, 0], cache[..., None, :, 1]
    out = torch.stack([xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 1] * cos + xr[..., 0] * sin], dim=-1)
    return out.flatten(-2).type_as(x)


def document_alignment(args: ModelArgs) -> int:
    """Packed documents must start at multiples of this (`doc_start`): NSA's selection block, so that every
    compressed and selection block of a document is a block of the row (l' is a multiple of d) and no selected block
    straddles two documents; 1 for dense attention."""
    return args.nsa.sel_block_size if args.attention == "nsa" else 1


def document_mask(doc_start: Tensor) -> BlockMask | Tensor:
    """The dense baseline's mask for packed documents, where query t sees keys doc_start[b, t] .. t: on CUDA the
    FlexAttention `document_block_mask`; elsewhere a boolean [B, 1, T, T] mask for SDPA, as FlexAttention has no CPU
    backward (CPU runs are small). Build it once per forward, outside the blocks."""
    if doc_start.device.type == "cuda":
        return document_block_mask(doc_start)
    t = torch.arange(doc_start.shape[1], device=doc_start.device)
    return ((t[None, :] <= t[:, None]) & (t[None, None, :] >= doc_start[..., None]))[:, None]


class Compression(nn.Module):
    """phi: blocks [i*d, i*d + l) of keys (or values) [B, T, H, D] -> [B, Nc, H, D]."""

    def __init__(self, args: NSAArgs, head_dim: int):
        super().__init__()
        self.nsa = args
        self.block, self.stride, self.kind = args.cmp_block_size, args.cmp_stride, args.compress
        if self.kind == "mlp":
            self.pos_emb = nn.Parameter(torch.empty(self.block, head_dim))
            hidden = args.cmp_hidden(head_dim)
            self.fc1 = nn.Linear(self.block * head_dim, hidden)
            self.fc2 = nn.Linear(hidden, head_dim)

    def forward(self, x: Tensor) -> Tensor:
        return compress((self,), x[None])[0]

    def init_weights(self, std: float) -> None:
        if self.kind == "mlp":
            normal_(self.pos_emb, std=std)
            for fc in (self.fc1, self.fc2):
                normal_(fc.weight, std=std)
                nn.init.zeros_(fc.bias)


def compress(modules: tuple[Compression, ...], x: Tensor) -> Tensor:
    """phi of S stacked inputs x [S, B, T, H, D] -> [S, B, Nc, H, D], input s through modules[s] (S modules of one
    configuration): the S MLPs run as one batched product per MLP layer, not S of each, and so do their
    backward's (a layer's keys and values: S = 2)."""
    first = modules[0]
    T = x.shape[2]
    n_blocks = first.nsa.num_cmp_blocks(T)
    if T < first.block:  # no complete block: an empty result that still carries phi in the graph
        x = F.pad(x, (0, 0, 0, 0, 0, first.block - T))
    if first.kind == "mean":
        return x.unfold(2, first.block, first.stride)[:, :, :n_blocks].mean(-1)  # a view of [S, B, Nc, H, D, l]
    stacked = {name: torch.stack([m.get_parameter(name) for m in modules])
               for name in ("pos_emb", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    blocks = _fc1_of_blocks(x, n_blocks, first.stride, stacked)  # [S, B, Nc, H, hidden]
    activations = F.silu(blocks).flatten(1, -2)  # [S, B Nc H, hidden]
    out = torch.baddbmm(stacked["fc2.bias"][:, None], activations, stacked["fc2.weight"].transpose(1, 2))
    return out.unflatten(1, blocks.shape[1:-1])


def _fc1_of_blocks(x: Tensor, n_blocks: int, d: int, stacked: dict[str, Tensor]) -> Tensor:
    """fc1(block i + pos_emb, flattened) [S, B, Nc, H, hidden] without the blocks themselves. Block i is the m = l/d
    chunks of d tokens i .. i+m-1 (d divides l), so fc1 splits into m products of a chunk with its columns of
    fc1.weight, summed over shifted chunks, and pos_emb into a bias: unfolded blocks would copy every key twice
    (at l = 2d) and their backward adds the copies back."""
    S, B, _, H, D = x.shape
    weight = stacked["fc1.weight"]  # [S, hidden, l D]: columns (token of the block, dim)
    m = weight.shape[-1] // (d * D)
    chunks = x[:, :, :(n_blocks + m - 1) * d].unflatten(2, (-1, d)).transpose(3, 4)  # [S, B, Nc+m-1, H, d, D]
    per_chunk = torch.bmm(chunks.flatten(-2).flatten(1, -2),  # [S, B (Nc+m-1) H, m hidden]
                          torch.cat(weight.split(d * D, dim=2), dim=1).transpose(1, 2))
    per_chunk = per_chunk.view(S, B, -1, H, m, weight.shape[1])
    bias = stacked["fc1.bias"] + torch.bmm(weight, stacked["pos_emb"].flatten(1)[..., None])[..., 0]  # [S, hidden]
    blocks = per_chunk[:, :, :n_blocks, :, 0] + bias[:, None, None, None]
    for j in range(1, m):
        blocks = blocks + per_chunk[:, :, j:j + n_blocks, :, j]
    return blocks


class DenseAttention(nn.Module):
    """Causal GQA attention through SDPA (with packed documents: `document_mask`): the baseline twin."""

    def __init__(self, args: ModelArgs, kv_sets: int = 1):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.kv_sets = kv_sets  # K/V projections fused into wk / wv (NSA: one per branch with separate_kv)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_sets * args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_sets * args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, mask: BlockMask | Tensor | None = None,
                doc_start: Tensor | None = None) -> tuple[Tensor, TelemetryInputs | None]:
        """Output [B, T, dim] and this layer's telemetry inputs: None, dense attention has no telemetry.
        mask: `document_mask` with packed documents, None for causal attention; doc_start is NSA's (the mask
        carries the documents here)."""
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, self.n_heads, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(self.wk(x).view(B, T, self.n_kv_heads, self.head_dim), rope).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if isinstance(mask, BlockMask):
            # contiguous: Inductor's CPU lowering of flex_attention fails on the rotated views (torch 2.13: "too
            # many values to unpack").
            out = flex(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1)), None

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            normal_(lin.weight, std=std)
        normal_(self.wo.weight, std=out_std)


class SequenceKV(nn.Module):
    """The keys and values [B, T, heads, D] that a layer's queries attend to: in the plain model the layer's own
    (identity). A parameter-free module, so that a plan can swap it from outside: context parallelism all-gathers
    the shards of the sequence here (parallelisms/context_parallel.py)."""

    def forward(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


class NSACore(nn.Module):
    """`nsa_attention` and its telemetry inputs (`TelemetryInputs`) as a parameter-free module, so that a plan can
    swap it from outside: context parallelism gives the queries of a shard their positions in the gathered sequence."""

    def __init__(self, args: NSAArgs):
        super().__init__()
        self.nsa = args

    def forward(self, q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
                v_cmp: Tensor, gates: Tensor, window_mask: BlockMask | None = None,
                doc_start: Tensor | None = None) -> tuple[Tensor, TelemetryInputs]:
        """`nsa_attention`'s output for its inputs, with this layer's `NSAArgs`, and the layer's telemetry inputs."""
        out, block_indices, cmp_entropy = nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, self.nsa,
                                                        window_mask=window_mask, doc_start=doc_start)
        return out, TelemetryInputs(gates.detach(), block_indices, cmp_entropy, doc_start)


class NSAAttention(DenseAttention):
    """Native Sparse Attention: compressed + selected + sliding-window branches mixed by sigmoid gates.

    K/V come from one shared projection, or one per branch (cmp, slc, win) with `separate_kv`; the
    projections of all branches are one fused Linear either way.
    """

    def __init__(self, args: ModelArgs):
        super().__init__(args, kv_sets=3 if args.nsa.separate_kv else 1)
        self.nsa = args.nsa
        self.compress_k = Compression(args.nsa, args.head_dim)
        self.compress_v = Compression(args.nsa, args.head_dim)
        self.gate = nn.Linear(args.dim, 3 * args.n_heads)
        # Two parameter-free seams instead of one: the whole sequence's keys must exist before compression (its
        # blocks of length l and stride d straddle any split of the sequence), and the queries' positions matter
        # only to the core. A single module spanning both would own the compression MLPs and so rename their
        # state_dict keys; these two add none.
        self.kv = SequenceKV()
        self.core = NSACore(args.nsa)

    def forward(self, x: Tensor, rope: Tensor, mask: BlockMask | None = None,
                doc_start: Tensor | None = None) -> tuple[Tensor, TelemetryInputs]:
        """Output [B, T, dim] and this layer's telemetry inputs; mask: `nsa.window_mask`; doc_start:
        int32 [B, T] first position of each token's document, or None."""
        B, T, _ = x.shape
        H, D = self.n_kv_heads, self.head_dim
        q, gate_logits = self._query_and_gate_logits(x)
        q = apply_rope(q.view(B, T, self.n_heads, D), rope)
        k, v = self.kv(apply_rope(self.wk(x).view(B, T, self.kv_sets * H, D), rope),
                       self.wv(x).view(B, T, self.kv_sets * H, D))
        k, v = k.split(H, dim=2), v.split(H, dim=2)
        cmp, slc, win = (0, 1, 2) if self.kv_sets == 3 else (0, 0, 0)
        k_cmp, v_cmp = compress((self.compress_k, self.compress_v), torch.stack([k[cmp], v[cmp]])).unbind()
        gates = torch.sigmoid(gate_logits).view(B, T, self.n_heads, 3)
        if self.nsa.window_only:  # the ablation: (cmp, slc, win) gates (0, 0, g_win), for every backend alike
            gates = F.pad(gates[..., 2:], (2, 0))
        out, telemetry = self.core(q, k[slc], v[slc], k[win], v[win], k_cmp, v_cmp, gates, window_mask=mask,
                                   doc_start=doc_start)
        return self.wo(out.reshape(B, T, -1)), telemetry

    def _query_and_gate_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """wq(x) [B, T, HQ D] and gate(x) [B, T, 3 HQ] as one product with the two weights stacked: the gate's
        3 HQ outputs alone make a narrow GEMM (forward and both backward products). A float8 wq (torchao's
        Float8Linear: the gate stays high precision) keeps its own product."""
        if type(self.wq) is not nn.Linear:
            return self.wq(x), self.gate(x)
        widths = [self.wq.out_features, self.gate.out_features]
        # Zero rows up to a multiple of _PRODUCT_ROWS: with rows of 804 bf16 (nsa-125m) the output's rows are not
        # 16-byte aligned, and cuBLAS leaves its Hopper kernels for sm80 ones, 3x slower (H100, [32768, 768]
        # fwd+bwd: 804 rows 0.564 ms, 832 rows 0.189; wq and gate apart 0.172 + 0.093).
        pad = -sum(widths) % _PRODUCT_ROWS
        weight = torch.cat([self.wq.weight, self.gate.weight, self.wq.weight.new_zeros(pad, x.shape[-1])])
        q, logits, _ = F.linear(x, weight).split([*widths, pad], dim=-1)
        return q, logits + self.gate.bias.to(logits.dtype)

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        self.compress_k.init_weights(std)
        self.compress_v.init_weights(std)
        normal_(self.gate.weight, std=std)
        nn.init.zeros_(self.gate.bias)  # every branch starts at gate 0.5


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        normal_(self.w1.weight, std=std)
        normal_(self.w3.weight, std=std)
        normal_(self.w2.weight, std=out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = NSAAttention(args) if args.attention == "nsa" else DenseAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: Tensor, rope: Tensor, mask: BlockMask | Tensor | None = None,
                doc_start: Tensor | None = None) -> tuple[Tensor, TelemetryInputs | None]:
        """Output [B, T, dim] and the attention's telemetry inputs, returned rather than stored: a side effect inside
        an activation-checkpointed compiled block fails in Dynamo. rope, mask, doc_start: as `Transformer.forward`
        passes them."""
        out, telemetry = self.attention(self.attention_norm(x), rope, mask, doc_start)
        h = x + out
        return h + self.feed_forward(self.ffn_norm(h)), telemetry

    def init_weights(self, std: float, n_layers: int) -> None:
        # Residual-output projections shrink with depth (as TorchTitan) so early training stays stable.
        out_std = std / math.sqrt(2 * (self.layer_id + 1))
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


# Modules kept in high precision whatever their size (float8 training converts no Linear under these names): the NSA
# gate and the compression MLPs are small and steer which blocks are attended; the output head feeds the loss.
HIGH_PRECISION_MODULES = frozenset({"gate", "compress_k", "compress_v", "output"})


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from args, rebuilt by init_weights() on the real device.
        self.register_buffer("rope", rope_cache(args.max_seq_len, args.head_dim, args.rope_theta), persistent=False)
        # Per layer, what the latest forward left for its telemetry (`nsa_stats`); None before the first forward.
        self._telemetry_inputs: tuple[TelemetryInputs | None, ...] | None = None
        # Set by the compile plan where CUDA graphs replay the blocks: packed documents' masks then keep their
        # addresses from batch to batch (`BlockMaskStorage`). None: each batch's mask is its own.
        self.mask_storage: BlockMaskStorage | None = None

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer (call after moving off the meta device / sharding)."""
        device = buffer_device or self.tok_embeddings.weight.device
        with torch.no_grad():
            self.rope = rope_cache(self.args.max_seq_len, self.args.head_dim, self.args.rope_theta, device)
        std = self.args.init_std
        normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std, self.args.n_layers)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            normal_(self.output.weight, std=self.args.dim ** -0.5)

    def forward(self, tokens: Tensor, doc_start: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] for tokens [B, T]; the layers' telemetry inputs are left for `self.nsa_stats`.

        doc_start: int32 [B, T], the position of each token's document's first token (packed documents,
        `data.document_mask`): each document then gets the outputs it would get alone. None: one sequence per row.
        positions: int64 [T], each token's position in its sequence, when `tokens` hold a part of it (context
        parallelism's shard, whose plan passes them); None: 0 .. T-1.
        """
        h = self.tok_embeddings(tokens)
        T = tokens.shape[1]
        if positions is None and doc_start is None:
            rope = self.rope
        else:  # rows of the table, a gather (no data-dependent shape); positions restart at each document
            t = torch.arange(T, device=tokens.device) if positions is None else positions
            rope = self.rope[t if doc_start is None else t - doc_start]
        # Masks are built here, outside the (possibly checkpointed) blocks, and shared by all of them. Tokens that
        # are a part of their sequence (positions given) get none: their window depends on where the part's queries
        # sit among the gathered keys, which only the core that attends them knows (context parallelism's cores
        # build their chunks' masks).
        if self.args.attention == "nsa":
            mask = window_mask(T, self.args.nsa, tokens.device, doc_start=doc_start) if positions is None else None
        else:
            mask = None if doc_start is None else document_mask(doc_start)
        if doc_start is not None and isinstance(mask, BlockMask) and self.mask_storage is not None:
            mask = self.mask_storage.keep(mask)
        # The previous forward's inputs go now rather than at the end: held through this forward, they would add
        # to its peak memory.
        self._telemetry_inputs = None
        telemetry = []
        for block in self.layers.values():
            h, inputs = block(h, rope, mask, doc_start)
            telemetry.append(inputs)
        self._telemetry_inputs = tuple(telemetry)
        return self.output(self.norm(h))

    @property
    def nsa_stats(self) -> Tensor | None:
        """The latest forward's telemetry, [n_layers, row] fp32 (`nsa_stats`; [n_layers, 0] for dense attention),
        computed now: read it before the next forward replaces (with CUDA graphs, overwrites) its inputs. None
        before the first forward."""
        if self._telemetry_inputs is None:
            return None
        if self.args.attention != "nsa":
            return torch.zeros(len(self._telemetry_inputs), 0, device=self.rope.device)
        return torch.stack([nsa_stats(**inputs._asdict(), args=self.args.nsa) for inputs in self._telemetry_inputs])
