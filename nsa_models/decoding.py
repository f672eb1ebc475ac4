"""Autoregressive decoding with a key/value cache, for every attention flavor (plain PyTorch, any device).

    logits, cache = prefill(model, prompt)                  # [B, T] ids: the ordinary full forward, cache filled
    logits = decode_step(model, next_ids, cache)            # [B] ids at position cache.length -> [B, vocab]

`prefill` runs `Transformer.forward` unchanged and records each layer's K/V projections (forward hooks), so its
logits are the model's own. `decode_step` then computes one new token per row with the reference math of
`docs/NSA_SPEC.md` read from the model's own submodules: q/k/v projections and RoPE at the token's absolute position,
a new compressed block (phi = the layer's `Compression`) whenever one just became complete, the compressed
attention and its probabilities, `select_blocks` (the reference's scores, forced blocks and tie-break), the selected
blocks' tokens <= t, the window of the last w tokens, the sigmoid gates, then wo, the residual and the MLP. Dense
layers attend over all cached keys. A step at context T costs O(T / d + n l' + w) attention work (dense: O(T)),
where recomputing the full forward per token costs T times that (bench/decode.py, docs/PERFORMANCE.md).

Rows of a batch share one position (no padding): prompts of equal length. Packed documents are not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_models.model import NSAAttention, Transformer, apply_rope
from nsa_models.nsa.reference import compressed_branch, select_blocks


@dataclass
class LayerCache:
    """One layer's cached keys and values, head-major so that each branch reads a slice without a copy."""

    keys: Tensor
    """[B, kv_sets * H, capacity, D] rotated keys of every position so far: the selected branch may pick any
    earlier block, and the window and compression read the most recent ones (kv_sets: 3 with `nsa.separate_kv`,
    in the order cmp, slc, win)."""
    values: Tensor
    """[B, kv_sets * H, capacity, D] values, as `keys`."""
    cmp_keys: Tensor | None = None
    """NSA: [B, H, num_cmp_blocks(capacity), D] compressed keys phi_K(block i); None for dense attention."""
    cmp_values: Tensor | None = None
    """NSA: compressed values phi_V(block i), as `cmp_keys`."""


@dataclass
class DecodeCache:
    """Every layer's cache and the number of positions it holds (the next token's absolute position)."""

    layers: list[LayerCache]
    length: int
    capacity: int
    """Positions the buffers hold: the model's `max_seq_len`, the end of its RoPE table."""


def new_cache(model: Transformer, batch: int) -> DecodeCache:
    """An empty cache of `model.args.max_seq_len` positions for `batch` rows, on the model's device and dtype."""
    args = model.args
    capacity = args.max_seq_len
    weight = model.tok_embeddings.weight
    layers = []
    for block in model.layers.values():
        attention = block.attention
        shape = (batch, attention.kv_sets * args.n_kv_heads, capacity, args.head_dim)
        layer = LayerCache(weight.new_zeros(shape), weight.new_zeros(shape))
        if isinstance(attention, NSAAttention):
            cmp_shape = (batch, args.n_kv_heads, args.nsa.num_cmp_blocks(capacity), args.head_dim)
            layer.cmp_keys, layer.cmp_values = weight.new_zeros(cmp_shape), weight.new_zeros(cmp_shape)
        layers.append(layer)
    return DecodeCache(layers, 0, capacity)


def prefill(model: Transformer, tokens: Tensor) -> tuple[Tensor, DecodeCache]:
    """The full forward's logits [B, T, vocab] for tokens [B, T] (1 <= T <= max_seq_len) and a cache holding their
    keys and values: the layers' K/V projections (rotated here exactly as the forward rotates them) and compressed
    blocks, recorded by forward hooks during that one forward."""
    B, T = tokens.shape
    if not 1 <= T <= model.args.max_seq_len:
        raise ValueError(f"prefill of {T} tokens: need 1 .. model.max_seq_len ({model.args.max_seq_len})")
    cache = new_cache(model, B)
    rope = model.rope[:T]
    handles = []

    def record(layer: LayerCache, name: str) -> Callable[[torch.nn.Module, tuple, Tensor], None]:
        def hook(module: torch.nn.Module, inputs: tuple, output: Tensor) -> None:
            output = output.view(B, T, -1, model.args.head_dim)
            output = apply_rope(output, rope) if name == "keys" else output
            getattr(layer, name)[:, :, :T] = output.transpose(1, 2)
        return hook

    def record_compressed(layer: LayerCache) -> Callable[[torch.nn.Module, tuple, object], None]:
        def hook(module: torch.nn.Module, inputs: tuple, output: object) -> None:
            k_cmp, v_cmp = inputs[5:7]  # `NSACore.forward`'s compressed keys and values [B, Nc, H, D]
            layer.cmp_keys[:, :, :k_cmp.shape[1]] = k_cmp.transpose(1, 2)
            layer.cmp_values[:, :, :v_cmp.shape[1]] = v_cmp.transpose(1, 2)
        return hook

    try:
        for block, layer in zip(model.layers.values(), cache.layers):
            attention = block.attention
            handles += [attention.wk.register_forward_hook(record(layer, "keys")),
                        attention.wv.register_forward_hook(record(layer, "values"))]
            if isinstance(attention, NSAAttention):
                handles.append(attention.core.register_forward_hook(record_compressed(layer)))
        logits = model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    cache.length = T
    return logits, cache


def decode_step(model: Transformer, tokens: Tensor, cache: DecodeCache) -> Tensor:
    """Logits [B, vocab] of the next token after tokens [B] (ids at position `cache.length`, which they join)."""
    t = cache.length
    if t >= cache.capacity:
        raise ValueError(f"the cache is full ({cache.capacity} positions = model.max_seq_len): prefill the last "
                         "max_seq_len tokens again (positions restart) or build the model with a larger max_seq_len")
    h = model.tok_embeddings(tokens[:, None])  # [B, 1, dim]
    rope = model.rope[t:t + 1]
    for block, layer in zip(model.layers.values(), cache.layers):
        x = block.attention_norm(h)
        if isinstance(block.attention, NSAAttention):
            out = _nsa_step(block.attention, x, rope, layer, t)
        else:
            out = _dense_step(block.attention, x, rope, layer, t)
        h = h + out
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.length = t + 1
    return model.output(model.norm(h))[:, 0]


def _project(attention: torch.nn.Module, x: Tensor, rope: Tensor, layer: LayerCache, t: int) -> Tensor:
    """q [B, 1, HQ, D] of the new token x [B, 1, dim]; its rotated k and its v are written to the cache at t."""
    B = x.shape[0]
    D = attention.head_dim
    q = apply_rope(attention.wq(x).view(B, 1, attention.n_heads, D), rope)
    layer.keys[:, :, t] = apply_rope(attention.wk(x).view(B, 1, -1, D), rope)[:, 0]
    layer.values[:, :, t] = attention.wv(x).view(B, -1, D)
    return q


def _dense_step(attention: torch.nn.Module, x: Tensor, rope: Tensor, layer: LayerCache, t: int) -> Tensor:
    """Dense attention of the new token over positions 0 .. t: every cached key is visible."""
    q = _project(attention, x, rope, layer, t)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), layer.keys[:, :, :t + 1], layer.values[:, :, :t + 1],
                                         enable_gqa=True)  # [B, HQ, 1, D]
    return attention.wo(out.transpose(1, 2).flatten(2))


def _nsa_step(attention: NSAAttention, x: Tensor, rope: Tensor, layer: LayerCache, t: int) -> Tensor:
    """The three NSA branches and their gates for the new token at position t (spec steps 1-6)."""
    args = attention.nsa
    l, d, lp, n, w = args.cmp_block_size, args.cmp_stride, args.sel_block_size, args.n_selected, args.window_size
    q = _project(attention, x, rope, layer, t)
    B, _, HQ, D = q.shape
    H = attention.n_kv_heads
    G = HQ // H
    cmp, slc, win = (0, 1, 2) if attention.kv_sets == 3 else (0, 0, 0)
    kv_set = [slice(i * H, (i + 1) * H) for i in range(attention.kv_sets)]

    # 1. Block i covers [i*d, i*d + l): the one ending at t (if any) is complete now. phi sees exactly the block the
    # full forward's unfold gives it, so the compressed keys match the forward's.
    n_cmp = args.num_cmp_blocks(t + 1)
    if t + 1 >= l and (t + 1 - l) % d == 0:
        i = n_cmp - 1
        block_k = layer.keys[:, kv_set[cmp], i * d:i * d + l].transpose(1, 2)  # [B, l, H, D]
        block_v = layer.values[:, kv_set[cmp], i * d:i * d + l].transpose(1, 2)
        layer.cmp_keys[:, :, i] = attention.compress_k(block_k)[:, 0]
        layer.cmp_values[:, :, i] = attention.compress_v(block_v)[:, 0]
    qh = q.view(B, 1, H, G, D).permute(0, 2, 3, 1, 4)  # [B, H, G, 1, D], as the reference's layout
    o_cmp, p_cmp = compressed_branch(qh, layer.cmp_keys[:, :, :n_cmp], layer.cmp_values[:, :, :n_cmp], t, args)

    # 2-3. The reference's scores and top-n (forced blocks, tie-break to the lower index): [B, H, 1, n].
    chosen = select_blocks(p_cmp, t, t + 1, l, d, lp, n)

    # 4. Selected: the chosen blocks' tokens u <= t; the group's G heads are SDPA's query rows over shared keys.
    pos = (chosen.clamp_min(0)[..., None] * lp + torch.arange(lp, device=q.device)).flatten(-2)  # [B, H, 1, n*l']
    visible = (chosen[..., None] >= 0).expand(-1, -1, -1, -1, lp).flatten(-2) & (pos <= t)
    index = pos.clamp_max(t)[..., 0, :, None].expand(-1, -1, -1, D)  # [B, H, n*l', D]
    k_sel = layer.keys[:, kv_set[slc]].gather(2, index)
    v_sel = layer.values[:, kv_set[slc]].gather(2, index)
    o_slc = F.scaled_dot_product_attention(qh[:, :, :, 0], k_sel, v_sel, attn_mask=visible)  # [B, H, G, D]

    # 5. Window: keys t-w+1 .. t, all visible.
    k0 = max(0, t - w + 1)
    o_win = F.scaled_dot_product_attention(q.transpose(1, 2), layer.keys[:, kv_set[win], k0:t + 1],
                                           layer.values[:, kv_set[win], k0:t + 1], enable_gqa=True)  # [B, HQ, 1, D]

    # 6. Gates, per query head and branch (the window-only ablation keeps g_win alone, as the forward does).
    gates = torch.sigmoid(attention.gate(x)).view(B, HQ, 3).to(q.dtype)
    if args.window_only:
        gates = F.pad(gates[..., 2:], (2, 0))
    out = (gates[..., 0:1] * o_cmp.reshape(B, HQ, D) + gates[..., 1:2] * o_slc.reshape(B, HQ, D)
           + gates[..., 2:3] * o_win.reshape(B, HQ, D))
    return attention.wo(out.reshape(B, 1, HQ * D))
