"""The `triton` NSA backend: Triton kernels for the compressed and selected branches and the selection, library
kernels for the window (and, when chosen, FlashAttention-4 for the compressed branch).

Same contract as `nsa_reference`. Branches:
- compressed attention: `triton_compressed.compressed_attention_fwd` (triton_op, deterministic backward; its
  gate applied in the op, so that its backward reads the block's dO as it is), or FlashAttention-4 over queries
  packed as heads (`cmp_backend = "flash_attn_4"`, `fa4.fa4_compressed_attention`; gated in torch); either also
  returns the log-sum-exp the selection needs;
- selection scores and top-n: `triton_selection.select_topn` (triton_op; the ranking and tie-break of the
  reference's `select_blocks`, from the same probabilities summed in another order);
- selected attention: `triton_selected.selected_attention` (custom op, deterministic backward; with
  `selected_kernels = "gluon_hopper"` its key-block-major forward and dK/dV kernels are `gluon_selected`'s);
- sliding window: FlexAttention (`window_backend = "flex"`), masked SDPA (`"sdpa"`), flash-attn 2's window_size
  (`"flash_attn"`), FlashAttention-4 (`"flash_attn_4"`, `fa4`; Hopper and newer) or the fused sweep's Gluon kernels
  without the selected branch (`"gluon_hopper"`, `triton_selected_window.window_sweep_attention`; Hopper); or, with
  `"fused_with_selected"`, in one sweep with the selected branch (`triton_selected_window.selected_window_attention`,
  shared K/V, the two branches' gates applied in the op; under `selected_kernels = "gluon_hopper"` its forward, dQ
  and dK/dV kernels are `gluon_selected_window`'s).
  FlexAttention has no CPU backward, so CPU tensors (Triton interpreter tests) take the SDPA path; flash-attn needs
  a GPU.

Packed documents (`doc_start`, starting at multiples of l'): the compressed kernels and the selection mask blocks
before each query's document, the FlexAttention and SDPA windows stop at its start, flash-attn 2 and
FlashAttention-4 run each document as one of their variable-length sequences (`varlen`, `fa4`), and the selected
branch is unchanged.

Queries at an offset (`q_start`, context parallelism's chunk of a shard): the T queries are positions
q_start .. q_start+T-1 of the keys' sequence; a pair of offsets applies to the even and the odd batch rows in turn
(a shard's two chunks as the rows of one call). The Triton kernels take them as runtime arguments (no recompile
per offset), the FlexAttention and SDPA windows in their masks; FlashAttention's windows, the fused sweep and
FlashAttention-4's compressed branch take none (refused).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from nsa_models.args import NSAArgs
from nsa_models.nsa.fa4 import fa4_compressed_attention, fa4_window_attention
from nsa_models.nsa.flex import document_block_mask, flex
from nsa_models.nsa.triton_common import query_offsets
from nsa_models.nsa.triton_compressed import compressed_attention_fwd
from nsa_models.nsa.triton_selected import selected_attention
from nsa_models.nsa.triton_selected_window import selected_window_attention, window_sweep_attention
from nsa_models.nsa.triton_selection import select_topn
from nsa_models.nsa.varlen import document_cu_seqlens

# Below 128 queries FlexAttention picks its decoding kernel, whose lowering finds no valid configuration at G = 16,
# D = 128 (torch 2.11, T = 31: "NoValidChoicesError"); the main kernel serves every length, and is what it picks
# from 128 queries on anyway.
_WINDOW_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _window_block_mask(seq_len: int, window: int, device: str, compile_mask: bool = True,
                       doc_start: Tensor | None = None, q_start: int | tuple[int, int] = 0, kv_len: int | None = None,
                       batch: int | None = None) -> BlockMask:
    """FlexAttention block mask of keys max(doc_start[b, t], t-w+1) .. t (doc_start None: 0) for the seq_len
    queries at positions t = q_start .. q_start+seq_len-1 of kv_len keys (None: seq_len), built by a compiled
    kernel outside torch.compile. A pair of offsets (even batch rows', odd rows') needs the batch size."""
    # The offsets as a tensor: the compiled mask kernel reads them as an input, where an int in the closure is a
    # constant Dynamo guards on (one compile per chunk offset under context parallelism).
    even, odd = query_offsets(q_start)
    offsets = torch.tensor((even, odd), device=device)
    per_row = even != odd
    if per_row and batch is None:
        raise ValueError(f"window mask: a q_start per row parity {q_start} needs the batch size")

    def sliding_window(b, h, q_idx, kv_idx):
        t = q_idx + (offsets[b % 2] if per_row else offsets[0])
        return (kv_idx <= t) & (t - kv_idx < window)

    def document_window(b, h, q_idx, kv_idx):
        return sliding_window(b, h, q_idx, kv_idx) & (kv_idx >= doc_start[b, q_idx])

    kv_len = seq_len if kv_len is None else kv_len
    build = torch.compile(create_block_mask) if compile_mask else create_block_mask
    if doc_start is None:
        return build(sliding_window, batch if per_row else None, None, seq_len, kv_len, device=device)
    return build(document_window, doc_start.shape[0], None, seq_len, kv_len, device=device)


_cached_window_block_mask = functools.lru_cache(maxsize=8)(_window_block_mask)


def window_block_mask(seq_len: int, window: int, device: torch.device, doc_start: Tensor | None = None,
                      q_start: int | tuple[int, int] = 0, kv_len: int | None = None,
                      batch: int | None = None) -> BlockMask:
    """The window's FlexAttention BlockMask, stopping at document starts when doc_start [B, T] is given: traced
    (no caches) inside torch.compile; in eager code built from each block's bounds with documents (their mask
    changes every batch: `flex.document_block_mask`), else cached. q_start, kv_len: the seq_len queries are
    positions q_start .. of kv_len keys (None: the queries'); a pair of offsets alternates between batch rows (even,
    odd), and then `batch` is the rows' number."""
    if torch.compiler.is_compiling():
        return _window_block_mask(seq_len, window, str(device), False, doc_start, q_start, kv_len, batch)
    if doc_start is not None:  # documents come with no offset (refused with one)
        return document_block_mask(doc_start, window)
    return _cached_window_block_mask(seq_len, window, str(device), True, None, q_start, kv_len, batch)


def window_attention(q: Tensor, k: Tensor, v: Tensor, args: NSAArgs, block_mask: BlockMask | None = None,
                     doc_start: Tensor | None = None, q_start: int | tuple[int, int] = 0) -> Tensor:
    """Sliding-window attention over keys max(doc_start[b, t], t-w+1) .. t (doc_start None: 0); [B, T, HQ, D]
    for the queries at positions t = q_start .. q_start+T-1 of k, v [B, TK, H, D] (a pair of offsets: the even
    batch rows' and the odd ones'). block_mask: the FlexAttention window mask (`window_block_mask`, of the same
    documents and offsets), built here when None."""
    T, w = q.shape[1], args.window_size
    if args.window_backend == "flash_attn":
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        # deterministic unless the recipe opts in to atomics: a bitwise-repeatable backward, as every NSA kernel's
        deterministic = not args.float_atomics
        if doc_start is None:
            return flash_attn_func(q, k, v, causal=True, window_size=(w - 1, 0), deterministic=deterministic)
        cu_seqlens = document_cu_seqlens(doc_start, args.sel_block_size)  # one sequence per document
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, cu_seqlens, T, T,
                                     causal=True, window_size=(w - 1, 0), deterministic=deterministic)
        return out.view(q.shape)
    if args.window_backend == "flash_attn_4":
        return fa4_window_attention(q, k, v, w, not args.float_atomics, doc_start, args.sel_block_size)
    if args.window_backend == "gluon_hopper":
        return window_sweep_attention(q, k, v, w, doc_start=doc_start)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if args.window_backend == "flex" and q.is_cuda:
        if block_mask is None:
            block_mask = window_block_mask(T, w, q.device, doc_start, q_start, k.shape[2], q.shape[0])
        out = flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=_WINDOW_KERNEL_OPTIONS)
    else:
        even, odd = query_offsets(q_start)
        t = torch.arange(T, device=q.device)[:, None] + even
        if odd != even:  # [B, 1, T, 1]: each row's own offset
            t = t + (torch.arange(q.shape[0], device=q.device) % 2 * (odd - even))[:, None, None, None]
        u = torch.arange(k.shape[2], device=q.device)
        mask = (u <= t) & (t - u < w)
        if doc_start is not None:  # [B, 1, T, TK]: each key at or after its query's document start
            mask = mask & (u >= doc_start[:, :, None]).unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, gate: Tensor, args: NSAArgs, scale: float,
                         doc_start: Tensor | None = None, q_start: int | tuple[int, int] = 0) -> tuple[Tensor, Tensor]:
    """The compressed branch through `args.cmp_backend`, weighted by its gate [B, T, HQ] (dtype of q): g_cmp o
    [B, T, HQ, D] and the natural-log lse [B, T, HQ] of o."""
    if args.cmp_backend == "flash_attn_4":
        o, lse = fa4_compressed_attention(q, k_cmp, v_cmp, args.cmp_block_size, args.cmp_stride, scale,
                                          not args.float_atomics, doc_start, args.sel_block_size)
        return gate[..., None] * o, lse
    return compressed_attention_fwd(q, k_cmp, v_cmp, gate, args.cmp_block_size, args.cmp_stride, scale, doc_start,
                                    *query_offsets(q_start))[:2]


def check_query_offset(args: NSAArgs) -> None:
    """Raise ValueError (one line naming the key and the fix) unless `args`' kernels take queries at an offset
    (`q_start`): FlashAttention's windows and compressed branch, and the fused sweep, align queries with keys."""
    for key, choice, offsets in (("window_backend", args.window_backend, ("flex", "sdpa")),
                                 ("cmp_backend", args.cmp_backend, ("triton",))):
        if choice not in offsets:
            raise ValueError(f"model.nsa.{key} = {choice!r} takes no query offset (queries that start mid-sequence, "
                             f"as context parallelism's): set it to {' or '.join(map(repr, offsets))}")


def selected_is_window(batch: int, seq_len: int, args: NSAArgs, device: torch.device,
                       doc_start: Tensor | None = None, q_start: int | tuple[int, int] = 0) -> Tensor:
    """[batch, seq_len] bool: the queries whose selected branch attends exactly their window's keys (shared K/V),
    doc_start .. t: at most n candidate blocks from the document's first to the query's own (all chosen, as
    `select_topn` and the reference choose every candidate when there are at most n) and t - doc_start < w."""
    even, odd = query_offsets(q_start)
    t = torch.arange(seq_len, device=device) + (even + torch.arange(batch, device=device)[:, None] % 2 * (odd - even))
    first = torch.zeros_like(t) if doc_start is None else doc_start
    l = args.sel_block_size
    return (t - first < args.window_size) & (t // l - first // l < args.n_selected)


def nsa_triton(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
               v_cmp: Tensor, gates: Tensor, args: NSAArgs, block_indices: Tensor | None = None,
               window_mask: BlockMask | None = None, doc_start: Tensor | None = None,
               q_start: int | tuple[int, int] = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gated sum of the three NSA branches. Returns (out [B, T, HQ, D], block indices [B, H, T, n], compressed-
    attention entropy [B, T, HQ] fp32, detached). doc_start [B, T] int32 (multiples of `sel_block_size`): each
    packed document attends as if run alone; the selected branch needs no mask, as every block chosen within a
    document lies inside it. q_start: the queries are positions q_start .. q_start+T-1 of the keys' sequence, or
    a pair (the even batch rows', the odd ones': a context-parallel shard's two chunks in one call), as
    `nsa_reference`'s; `check_query_offset` says which kernels take it."""
    if any(query_offsets(q_start)):
        check_query_offset(args)
    scale = q.shape[-1] ** -0.5
    g = gates.to(q.dtype)
    gated_cmp, lse = compressed_attention(q, k_cmp, v_cmp, g[..., 0], args, scale, doc_start, q_start)
    # The selection is not differentiated (the spec's top-n is piecewise constant): detached inputs.
    chosen, entropy = select_topn(q.detach(), k_cmp.detach(), lse.detach(), args.cmp_block_size, args.cmp_stride,
                                  args.sel_block_size, args.n_selected, scale, doc_start, *query_offsets(q_start))
    block_indices = chosen if block_indices is None else block_indices
    if args.window_backend == "fused_with_selected":
        if k_win is not k_slc or v_win is not v_slc:
            raise ValueError("model.nsa.window_backend = 'fused_with_selected' needs the window's keys and values to "
                             "be the selected branch's: set model.nsa.separate_kv = false")
        # The sweep applies the selected and window gates itself (its backward shares dP and dV between them).
        o_sw = selected_window_attention(q, k_slc, v_slc, g[..., 1:], block_indices, args.sel_block_size,
                                         args.window_size, scale, doc_start, args.selected_kernels)
        return gated_cmp + o_sw, block_indices, entropy
    o_win = window_attention(q, k_win, v_win, args, window_mask, doc_start, q_start)
    # Chosen here (not given), so rows with at most n candidates hold them all.
    if args.selected_from_window and block_indices is chosen and k_win is k_slc and v_win is v_slc:
        window_rows = selected_is_window(q.shape[0], q.shape[1], args, q.device, doc_start, q_start)
        o_slc = selected_attention(q, k_slc, v_slc, chosen.masked_fill(window_rows[:, None, :, None], -1),
                                   args.sel_block_size, scale, q_start,  # those rows: no work in the kernels
                                   kernels=args.selected_kernels)
        o_slc = torch.where(window_rows[:, :, None, None], o_win, o_slc)
    else:
        o_slc = selected_attention(q, k_slc, v_slc, block_indices, args.sel_block_size, scale, q_start,
                                   kernels=args.selected_kernels)
    out = gated_cmp + g[..., 1, None] * o_slc + g[..., 2, None] * o_win
    return out, block_indices, entropy
