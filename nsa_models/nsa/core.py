"""The functional NSA core with an explicit backend choice (no silent fallback): the backends, the one check that
the chosen ones can run (`check_backend`), and the ops that activation checkpointing must treat specially."""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from nsa_models.args import BUILT_IN_BACKENDS, LIBRARY_PACKAGES, NSAArgs
from nsa_models.nsa.reference import nsa_reference

BACKENDS = {"reference": nsa_reference}
# Activation checkpointing (applied from outside: `parallelisms/`) must always save the block selection: recomputing
# it could pick other blocks (bf16 ties, non-deterministic kernels), and the backward would then differentiate an
# attention that forward never ran.
_selection_ops = [torch.ops.nsa.select_blocks.default]
# The fused attention kernels: costly to recompute, so selective checkpointing saves their outputs too.
_attention_ops = []
try:  # triton ships with CUDA builds of torch; a CPU-only install may lack it, then "triton" is not offered
    from nsa_models.nsa.triton_backend import nsa_triton

    BACKENDS["triton"] = nsa_triton
    _selection_ops.append(torch.ops.nsa.select_topn.default)
    _attention_ops += [torch.ops.nsa.compressed_attention_fwd.default, torch.ops.nsa.selected_attention_fwd.default,
                       torch.ops.nsa.selected_window_fwd.default]
except ImportError:
    pass
AC_ALWAYS_SAVE_OPS = frozenset(_selection_ops)
AC_SELECTIVE_SAVE_OPS = frozenset(_attention_ops)


def _importable(module: str) -> bool:
    """Whether `module` (dotted) is installed, without importing it (its parent package is imported; a missing
    parent counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _gluon_import_error() -> str | None:
    """Why the Gluon selected kernels (`gluon_selected`: triton.experimental.gluon and its Hopper ops) do not
    import here, in one line, or None when they do."""
    try:
        importlib.import_module("nsa_models.nsa.gluon_selected")
    except ImportError as error:
        return (str(error).splitlines() or [type(error).__name__])[0]
    return None


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA `device`, or None when no CUDA GPU is visible."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


def check_backend(args: NSAArgs, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError (one line naming the key and the fix) unless the backends `args` chooses can run on `device`
    with compute dtype `dtype`: no silent fallback to another one.
    The one availability check: call it once before building a model; the kernels do not check again."""
    if args.backend == "reference":
        return
    if args.backend not in BACKENDS:
        raise ValueError(f"model.nsa.backend = {args.backend!r} is not available here (built: {', '.join(BACKENDS)}; "
                         "'triton' needs the triton package): install triton or set --model.nsa.backend reference")
    if device.type != "cuda":
        raise ValueError(f"model.nsa.backend = {args.backend!r} needs a CUDA GPU (device is {device.type}): set "
                         "--model.nsa.backend reference")
    for key, built_in in BUILT_IN_BACKENDS.items():  # the keys that may name a library
        choice = getattr(args, key)
        if choice in LIBRARY_PACKAGES and not _importable(LIBRARY_PACKAGES[choice][0]):
            package = LIBRARY_PACKAGES[choice][1]
            raise ValueError(f"model.nsa.{key} = {choice!r} needs the {package} package (pip install {package}); or "
                             "set it to " + " or ".join(map(repr, built_in)))
        if choice == "flash_attn_4" and dtype != torch.bfloat16:
            raise ValueError(f"model.nsa.{key} = 'flash_attn_4' runs bf16 only: set training.mixed_precision = "
                             f"'bf16' (or 'auto'), or {key} = {built_in[0]!r}")
    for key, default in (("selected_kernels", "triton"), ("window_backend", "flex")):
        if getattr(args, key) != "gluon_hopper":  # the shapes are ModelArgs.validate's
            continue
        gluon, fix = f"model.nsa.{key} = 'gluon_hopper'", f"set model.nsa.{key} = {default!r}"
        capability = _cuda_capability(device)
        if capability is None or capability[0] != 9:
            found = "no CUDA GPU here" if capability is None else "this one is {}.{}".format(*capability)
            raise ValueError(f"{gluon} needs a CUDA GPU of capability 9.x (Hopper; {found}): {fix}")
        if dtype != torch.bfloat16:
            raise ValueError(f"{gluon} runs bf16 only: set training.mixed_precision = 'bf16' (or 'auto'), or {fix}")
        why = _gluon_import_error()
        if why is not None:
            raise ValueError(f"{gluon} needs triton.experimental.gluon (triton 3.6 or newer), which does not import "
                             f"here ({why}): {fix}")


def nsa_attention(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
                  v_cmp: Tensor, gates: Tensor, args: NSAArgs, block_indices: Tensor | None = None,
                  window_mask: BlockMask | None = None, doc_start: Tensor | None = None,
                  q_start: int | tuple[int, int] = 0) -> tuple[Tensor, Tensor, Tensor]:
    """NSA output [B, T, HQ, D], selected block indices [B, H, T, n] (int64, -1 = padding) and the entropy
    [B, T, HQ] (fp32, detached, nats) of each query head's compressed-attention distribution, 0 for a query that
    sees no compressed block (telemetry: `nsa_models.telemetry.nsa_stats`).

    q: [B, T, HQ, D] rotated queries; k_*/v_*: [B, T, H, D] per-branch keys/values (the same tensors when the
    projection is shared); k_cmp/v_cmp: [B, Nc, H, D] compressed keys/values; gates: [B, T, HQ, 3] sigmoid
    gates for (cmp, slc, win). Pass block_indices to attend to given blocks instead of selecting, and the
    `window_mask` of this length (and these documents) to reuse it (built inside otherwise). doc_start: int32
    [B, T], the position of each token's document's first token (a multiple of `sel_block_size`): every packed
    document then attends as if run alone; None: one sequence per row. q_start: the T queries (and their gates,
    block indices, doc_start and window_mask) are positions q_start .. q_start+T-1 of the sequence that the keys
    and values span whole (context parallelism's chunks of a shard), or a pair of offsets for the even and the odd
    batch rows (a shard's two chunks as the rows of one call); the triton backend takes it with the kernels that
    `triton_backend.check_query_offset` accepts. `check_backend` says whether args' backends can run here.
    """
    return BACKENDS[args.backend](q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, args, block_indices,
                                  window_mask, doc_start, q_start)


def window_mask(seq_len: int, args: NSAArgs, device: torch.device, doc_start: Tensor | None = None,
                q_start: int | tuple[int, int] = 0, kv_len: int | None = None,
                batch: int | None = None) -> BlockMask | None:
    """The FlexAttention BlockMask of the window (stopping at document starts when doc_start [B, T] is given) when
    the triton backend runs it through FlexAttention on a GPU, else None. Build it once per forward outside
    activation-checkpointed regions (building it inside a checkpointed compiled block fails in Dynamo: "HOP:
    unsafe side effect") and pass it to every layer. q_start, kv_len: the mask of seq_len queries at positions
    q_start .. of kv_len keys (`nsa_attention`'s q_start; None: seq_len keys); a pair of offsets needs the batch
    rows' number."""
    if args.backend != "triton" or args.window_backend != "flex" or device.type != "cuda":
        return None
    from nsa_models.nsa.triton_backend import window_block_mask

    return window_block_mask(seq_len, args.window_size, device, doc_start, q_start, kv_len, batch)
