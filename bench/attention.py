"""Attention-core timings at the kernel benchmark shape of NSA_SPEC.md: B=1, HQ=64, H=4, D=128, bf16, CUDA.

    python bench/attention.py                       # T = 8k, 16k, 32k, 64k, then G = 1, 4, 16 at 32k
    python bench/attention.py --seq-lens 8192 --groups
    python bench/attention.py --window-backend flash_attn_4   # the core's window through FlashAttention-4
    python bench/attention.py --window-backend flash_attn_4 --cmp-backend flash_attn_4   # and its compressed branch
    python bench/attention.py --selected-kernels gluon_hopper   # the selected branch's Gluon kernels (Hopper)
    python bench/attention.py --selected --seq-lens 1024 2048 65536   # the selected branch alone, ours and fla's,
                                # beside cuDNN's dense causal attention: wall clock, GPU kernel time, the fwd+bwd
                                # replayed as one CUDA graph and its model TFLOP/s
    python bench/attention.py --core-only --documents 1 16 --seq-lens 8192 65536   # what document masking costs
    python bench/attention.py --fused --batch 16 --heads 12 --head-dim 64 --seq-lens 2048   # nsa-125m's selected and
                                # window branches, separately and in one sweep (window_backend fused_with_selected)

Rows, milliseconds (medians of triton.testing.do_bench), forward and forward+backward, NSA at 32/16/64/16/512:
- per branch of the `triton` backend: compressed attention (--cmp-backend: Triton, or FlashAttention-4 over
  queries packed as heads), selection (scores + top-n, forward only: not differentiated), selected attention (n=16
  random valid blocks; eager, compiled, and fla's selected kernels on the same blocks), sliding window
  (--window-backend: FlexAttention by default, or FlashAttention-4); the FA4
  backwards are deterministic unless --float-atomics;
- `NSA triton backend`: the whole core (all of the above plus gating); compressed keys/values are inputs; eager,
  and `compiled` (torch.compile, fullgraph, the window mask built once outside, as the model runs it: the gating,
  softmax-delta and cast glue fuse). The ratios, the group sweep and --profile use the compiled core;
- dense causal baselines: SDPA flash and cuDNN (K/V expanded to HQ heads), compiled FlexAttention (GQA);
- fla's `parallel_nsa` (package fla-core, when installed; G >= 16 only): compression + selection at
  l = l' = d = 64 with mean pooling, alone and plus the FlexAttention window (the spec's comparison).
Ratios after each length; with --groups, the whole core at G = 1, 4, 16 (HQ = 64) and its model-FLOP rate;
with --profile, where one fwd+bwd of the whole core spends its GPU time, per kernel (torch.profiler), and the
compiler's resource report of each Triton kernel variant launched (registers per thread, spills, shared memory)
and its occupancy.
`oom` marks a row that ran out of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from triton.runtime.jit import JITFunction

from nsa_models.args import MAX_FUSED_BLOCKS, ModelArgs, NSAArgs
from nsa_models.flops import mean_keys_per_query
from nsa_models.nsa import (
    check_backend,
    triton_compressed,
    triton_selected,
    triton_selected_window,
    triton_selection,
    window_mask,
)
from nsa_models.nsa.triton_backend import compressed_attention, nsa_triton, window_attention
from nsa_models.nsa.triton_selected import selected_attention
from nsa_models.nsa.triton_selected_window import selected_window_attention
from nsa_models.nsa.triton_selection import select_topn

# backend = "triton" also makes `window_mask` build the FlexAttention mask outside the compiled core, as the model
# does; with the default ("reference") it returned None and the core rebuilt the mask on every call (O(T^2)).
NSA = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512, backend="triton")
FLEX_WINDOW = dataclasses.replace(NSA, window_backend="flex")  # fla's window (the spec's comparison), whatever NSA's
CORE = "NSA triton backend, compiled"


def random_block_indices(B: int, H: int, T: int, n: int, block: int, device: torch.device | str,
                         chunk: int = 4096) -> Tensor:
    """Valid selections [B, H, T, n]: block 0 and the two most recent blocks, random older ones, -1 padding.
    Drawn `chunk` queries at a time: the scores are [B, H, chunk, blocks], not T x blocks (9.7 GB at 196k)."""
    n_blocks = triton.cdiv(T, block)
    j = torch.arange(n_blocks, device=device)
    chunks = []
    for t0 in range(0, T, chunk):
        current = (torch.arange(t0, min(t0 + chunk, T), device=device) // block)[:, None]
        score = torch.rand(B, H, current.shape[0], n_blocks, device=device)
        score = score.masked_fill((j == 0) | (j == current) | (j == current - 1), 2.0).masked_fill(j > current, -1.0)
        top = score.topk(min(n, n_blocks), dim=-1)
        chunks.append(torch.where(top.values < 0, -1, top.indices))
    return F.pad(torch.cat(chunks, 2), (0, n - min(n, n_blocks)), value=-1)


def time_ms(fn, grad_inputs: list[Tensor], backward: bool = True) -> tuple[float | str, float | str]:
    """Median forward and forward+backward milliseconds of fn() (a tensor function of grad_inputs)."""
    try:
        fwd = triton.testing.do_bench(fn)
        if not backward:
            return fwd, "-"
        cotangent = torch.randn_like(fn())
        fwd_bwd = triton.testing.do_bench(lambda: fn().backward(cotangent), grad_to_none=grad_inputs)
        return fwd, fwd_bwd
    except torch.OutOfMemoryError:
        return "oom", "oom"
    finally:
        release(grad_inputs)


def release(grad_inputs: list[Tensor]) -> None:
    """After a timer: drop the gradients it accumulated and return its memory, so the next row starts clean."""
    for x in grad_inputs:
        x.grad = None
    torch.cuda.empty_cache()


def nsa_inputs(B: int, T: int, HQ: int, H: int, D: int) -> list[Tensor]:
    """q, k, v, compressed k, v, gates (bf16, requiring grad) for the whole core; K/V shared by the branches."""
    n_cmp = NSA.num_cmp_blocks(T)
    shapes = [(B, T, HQ, D), (B, T, H, D), (B, T, H, D), (B, n_cmp, H, D), (B, n_cmp, H, D), (B, T, HQ, 3)]
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]


def run_nsa(q, k, v, k_cmp, v_cmp, gates, window_mask: BlockMask | None = None,
            doc_start: Tensor | None = None) -> Tensor:
    return nsa_triton(q, k, v, k, v, k_cmp, v_cmp, gates.sigmoid(), NSA, window_mask=window_mask,
                      doc_start=doc_start)[0]


compiled_nsa = torch.compile(run_nsa, fullgraph=True, dynamic=False)


def nsa_core(inputs: list[Tensor], doc_start: Tensor | None = None):
    """The compiled whole core on these inputs (with document masking when doc_start is given), as a function of
    nothing (for the timers)."""
    mask = window_mask(inputs[0].shape[1], NSA, inputs[0].device, doc_start)  # as `Transformer.forward` builds it
    return lambda: compiled_nsa(*inputs, mask, doc_start)


def equal_documents(B: int, T: int, n_docs: int, device: torch.device | str) -> Tensor:
    """doc_start [B, T] int32 of n_docs documents of equal length per row, each starting on a selection block (as
    the data pipeline aligns them under document masking)."""
    step = max(NSA.sel_block_size, T // n_docs // NSA.sel_block_size * NSA.sel_block_size)
    t = torch.arange(T, device=device)
    return (torch.clamp(t // step, max=n_docs - 1) * step).to(torch.int32).expand(B, T).contiguous()


compiled_selected = torch.compile(selected_attention, fullgraph=True, dynamic=False)


def selected_functions(q: Tensor, k: Tensor, v: Tensor) -> dict[str, Callable[[], Tensor]]:
    """The selected branch alone on random valid blocks: ours eager (its work lists built by torch ops one launch
    at a time), ours compiled (as the model runs it: the work lists fused by inductor), and, where fla is
    installed and G >= 16, fla's selected-attention kernels (`ParallelNSAFunction`) on the same blocks."""
    B, T, HQ, _ = q.shape
    H, block = k.shape[2], NSA.sel_block_size
    idx = random_block_indices(B, H, T, NSA.n_selected, block, q.device)
    kernels = NSA.selected_kernels
    functions = {f"selected ({kernels})": lambda: selected_attention(q, k, v, idx, block, kernels=kernels),
                 f"selected ({kernels}), compiled": lambda: compiled_selected(q, k, v, idx, block, kernels=kernels)}
    if importlib.util.find_spec("fla") is not None and HQ // H >= 16:
        from fla.ops.nsa.parallel import ParallelNSAFunction

        fla_idx = idx.transpose(1, 2).contiguous()  # [B, T, H, n]; fla skips the -1 padding as ours does
        scale = q.shape[-1] ** -0.5
        functions["fla selected (ParallelNSAFunction)"] = lambda: ParallelNSAFunction.apply(
            q, k, v, fla_idx, NSA.n_selected, block, scale, None)
    return functions


def _separate_branches(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, mask: BlockMask | None) -> Tensor:
    return (selected_attention(q, k, v, idx, NSA.sel_block_size, kernels=NSA.selected_kernels)
            + window_attention(q, k, v, FLEX_WINDOW, mask))


def _fused_branches(q: Tensor, k: Tensor, v: Tensor, idx: Tensor) -> Tensor:
    return selected_window_attention(q, k, v, q.new_ones(*q.shape[:3], 2), idx, NSA.sel_block_size,
                                     NSA.window_size, kernels=NSA.selected_kernels)


compiled_separate = torch.compile(_separate_branches, fullgraph=True, dynamic=False)
compiled_fused = torch.compile(_fused_branches, fullgraph=True, dynamic=False)


def branch_pair_rows(q: Tensor, k: Tensor, v: Tensor) -> list[tuple[str, float | str, float | str]]:
    """The selected and window branches on random valid blocks, their outputs summed, compiled: separately (the
    selected kernels and the FlexAttention window, as the model runs them) and in one sweep
    (`window_backend = "fused_with_selected"`, up to MAX_FUSED_BLOCKS selection blocks)."""
    B, T, _, _ = q.shape
    idx = random_block_indices(B, k.shape[2], T, NSA.n_selected, NSA.sel_block_size, q.device)
    mask = window_mask(T, FLEX_WINDOW, q.device)
    rows = [("separate", *time_ms(lambda: compiled_separate(q, k, v, idx, mask), [q, k, v]))]
    fits = triton.cdiv(T, NSA.sel_block_size) <= MAX_FUSED_BLOCKS
    rows.append(("fused", *(time_ms(lambda: compiled_fused(q, k, v, idx), [q, k, v]) if fits else ("-", "-"))))
    return rows


def selected_rows(q: Tensor, k: Tensor, v: Tensor) -> list[tuple[str, float | str, float | str]]:
    return [(name, *time_ms(fn, [q, k, v])) for name, fn in selected_functions(q, k, v).items()]


def gpu_kernel_ms(fn, grad_inputs: list[Tensor], repeats: int = 5) -> float:
    """GPU time of one fn() forward + backward: the sum of its kernels' durations (torch.profiler), without the
    host's launch gaps that wall-clock timers count at small sizes."""
    cotangent = torch.randn_like(fn())
    fn().backward(cotangent)  # warm (compiles, autotunes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn().backward(cotangent)
        torch.cuda.synchronize()
    for x in grad_inputs:
        x.grad = None
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3 / repeats


def cuda_graph_ms(fn, grad_inputs: list[Tensor]) -> float | str:
    """Median milliseconds of one fn() forward + backward replayed as one CUDA graph, as a training step runs on
    one GPU or under DDP with `compile.mode = "auto"`: the GPU's time without the host's launches."""
    cotangent = torch.randn_like(fn())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # warm: compiles, autotunes, and makes the .grad the graph accumulates into
            for _ in range(3):
                fn().backward(cotangent)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn().backward(cotangent)
        return triton.testing.do_bench(graph.replay)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a function that cannot be captured
        return f"not capturable ({type(e).__name__})"
    finally:
        release(grad_inputs)


def branch_rows(inputs: list[Tensor]) -> list[tuple[str, float | str, float | str]]:
    """Each branch of the triton backend alone, then the whole backend eager."""
    q, k, v, k_cmp, v_cmp, gates = inputs
    scale = q.shape[-1] ** -0.5
    cmp = (NSA.cmp_block_size, NSA.cmp_stride)
    g_cmp = gates.detach()[..., 0].sigmoid()  # the branch's gate, applied in its op (as `run_nsa`'s)
    rows = [(f"compressed ({NSA.cmp_backend}), gated",
             *time_ms(lambda: compressed_attention(q, k_cmp, v_cmp, g_cmp, NSA, scale)[0], [q, k_cmp, v_cmp]))]
    with torch.no_grad():
        lse = compressed_attention(q, k_cmp, v_cmp, g_cmp, NSA, scale)[1]
    rows.append(("selection: scores + top-n (triton)", *time_ms(
        lambda: select_topn(q, k_cmp, lse, *cmp, NSA.sel_block_size, NSA.n_selected, scale)[0], [], False)))
    lse = None  # free it before the next rows
    if NSA.window_backend == "fused_with_selected":
        idx = random_block_indices(q.shape[0], k.shape[2], q.shape[1], NSA.n_selected, NSA.sel_block_size, q.device)
        rows.append(("selected + window 512 (fused), both outputs summed", *time_ms(
            lambda: _fused_branches(q, k, v, idx), [q, k, v])))
    else:
        rows += selected_rows(q, k, v)
        rows.append((f"window 512 ({NSA.window_backend})",
                     *time_ms(lambda: window_attention(q, k, v, NSA), [q, k, v])))
    rows.append(("NSA triton backend, eager", *time_ms(lambda: run_nsa(*inputs), inputs)))
    return rows


def bench_length(T: int, B: int, HQ: int, H: int, D: int, documents: Sequence[int] = (), core_only: bool = False
                 ) -> list[tuple[str, float | str, float | str]]:
    """Rows (name, fwd ms, fwd+bwd ms) at length T: each branch, the core eager and compiled (and masked, for each
    count of equal `documents` per row), then the dense baselines and fla's; `core_only`: the compiled core rows
    alone."""
    device = torch.device("cuda")
    inputs = nsa_inputs(B, T, HQ, H, D)
    q, k, v, k_cmp, v_cmp, gates = inputs
    rows = [] if core_only else branch_rows(inputs)
    rows.append((CORE, *time_ms(nsa_core(inputs), inputs)))
    for n_docs in documents:
        rows.append((f"{CORE}, {n_docs} document{'s' if n_docs > 1 else ''} masked",
                     *time_ms(nsa_core(inputs, equal_documents(B, T, n_docs, device)), inputs)))
    if core_only:
        return rows

    for name, backend in (("SDPA flash (dense)", SDPBackend.FLASH_ATTENTION),
                          ("SDPA cuDNN (dense)", SDPBackend.CUDNN_ATTENTION)):
        rows.append((name, *time_ms(*dense_causal(q, k, v, backend))))
    qh, kh, vh = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))  # [B, heads, T, D]
    causal = torch.compile(create_block_mask)(lambda b, h, i, j: j <= i, None, None, T, T, device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    rows.append(("FlexAttention (dense)",
                 *time_ms(lambda: flex(qh, kh, vh, block_mask=causal, enable_gqa=True), [qh, kh, vh])))
    if importlib.util.find_spec("fla") is not None and HQ // H >= 16:
        from fla.ops.nsa import parallel_nsa

        g_cmp, g_slc = (x.detach().sigmoid().requires_grad_() for x in (gates[..., 0], gates[..., 1]))

        def fla_nsa():
            return parallel_nsa(q, k, v, g_cmp, g_slc, None, block_counts=NSA.n_selected, block_size=64)
        rows.append(("fla parallel_nsa (cmp+slc, 64/64/64)", *time_ms(fla_nsa, [q, k, v, g_cmp, g_slc])))
        def fla_with_window():
            return fla_nsa() + window_attention(q, k, v, FLEX_WINDOW)
        rows.append(("fla parallel_nsa + flex window", *time_ms(fla_with_window, [q, k, v, g_cmp, g_slc])))
    return rows


def dense_causal(q: Tensor, k: Tensor, v: Tensor, backend: SDPBackend) -> tuple[Callable[[], Tensor], list[Tensor]]:
    """Dense causal SDPA through `backend` on the heads of q, k, v [B, T, heads, D] (K/V repeated to the query
    heads), and the leaves it differentiates."""
    qh, kh, vh = (x.detach().transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
    kh, vh = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=1) for x in (kh, vh))
    leaves = [x.requires_grad_() for x in (qh, kh, vh)]

    def sdpa() -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*leaves, is_causal=True)
    return sdpa, leaves


def kernel_times(fn, grad_inputs: list[Tensor], top: int = 12) -> str:
    """Markdown: the GPU kernels of one fn() forward + backward (after a warm-up), by their time: ms, share, calls."""
    out = fn()  # the warm-up, and the cotangent's shape
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    for x in grad_inputs:  # else the profile adds gradient accumulation that the timed runs do not have
        x.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn().backward(cotangent)
        torch.cuda.synchronize()
    for x in grad_inputs:
        x.grad = None
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    lines = ["| kernel | ms | share | calls |", "|---|---|---|---|"]
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        lines.append(f"| {e.key[:70]} | {e.self_device_time_total / 1e3:.2f} | "
                     f"{e.self_device_time_total / total:.0%} | {e.count} |")
    return "\n".join(lines) + f"\n(total {total / 1e3:.2f} ms of GPU time)\n"


def programs_per_sm(warps: int, registers: int, shared_bytes: int, sm: dict[str, int]) -> tuple[int, str]:
    """Occupancy by arithmetic, as the CUDA occupancy calculator counts it: how many programs of a kernel one SM
    holds at once, and the limit that binds. sm: the SM's "threads", "registers" and "shared" (bytes).
    Registers are allocated per warp in units of 256; the driver reserves 1 KiB of shared memory per program."""
    registers_per_warp = -(-registers * 32 // 256) * 256
    limits = {"programs": 32,  # the most resident programs (thread blocks) of one SM, sm_80 to sm_90
              "threads": sm["threads"] // (32 * warps),
              "registers": sm["registers"] // (registers_per_warp * warps),
              "shared memory": sm["shared"] // (shared_bytes + 1024)}
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def kernel_resources() -> str:
    """Markdown: per compiled variant of the backend's Triton kernels launched so far, its warps, pipeline stages,
    registers per thread, spilled registers, shared memory (the compiler's metadata) and occupancy."""
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    # Triton's per-program register limit; on sm_80 and sm_90 it equals the SM's register file.
    sm = {"threads": props.max_threads_per_multi_processor, "shared": props.shared_memory_per_multiprocessor,
          "registers": triton.runtime.driver.active.utils.get_device_properties(device)["max_num_regs"]}
    lines = ["| Triton kernel | warps | stages | registers | spills | shared KiB | programs / SM (limit) |",
             "|---|---|---|---|---|---|---|"]
    for module in (triton_compressed, triton_selection, triton_selected, triton_selected_window):
        for name, fn in vars(module).items():
            if not isinstance(fn, JITFunction):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():  # the compiled variants of this kernel
                    meta = kernel.metadata
                    programs, limit = programs_per_sm(meta.num_warps, kernel.n_regs, meta.shared, sm)
                    lines.append(f"| {module.__name__.rsplit('.', 1)[-1]}.{name} | {meta.num_warps} | "
                                 f"{meta.num_stages} | {kernel.n_regs} | {kernel.n_spills} | "
                                 f"{meta.shared / 1024:.1f} | {programs} ({limit}) |")
    return "\n".join(lines) + "\n"


DENSE_CUDNN = "SDPA cuDNN (dense causal)"


def selected_names() -> list[str]:
    """The --selected table's columns: `selected_functions`' names for this run's selected kernels, and cuDNN's
    dense causal attention at the same shape (its model TFLOP/s: every causal pair)."""
    kernels = NSA.selected_kernels
    return [f"selected ({kernels})", f"selected ({kernels}), compiled", "fla selected (ParallelNSAFunction)",
            DENSE_CUDNN]


def _ms(x: float | str) -> str:
    return x if isinstance(x, str) else f"{x:.3f}"


def ratio(a: float | str, b: float | str) -> str:
    return f"{a / b:.3f}" if isinstance(a, float) and isinstance(b, float) else "n/a"


def nsa_tflops(B: int, T: int, HQ: int, H: int, D: int, ms: float | str,
               branches: tuple[str, ...] = ("cmp", "slc", "win")) -> str:
    """Model FLOP rate of a fwd+bwd of the branches (3 x the forward's q.k and p.v products, real key counts);
    branches ("dense",): causal attention over every key up to the query."""
    if not isinstance(ms, float):
        return "n/a"
    keys = mean_keys_per_query(ModelArgs(n_heads=HQ, n_kv_heads=H, head_dim=D, nsa=NSA), T) | {"dense": (T + 1) / 2}
    return f"{3 * 4 * D * HQ * sum(keys[b] for b in branches) * B * T / ms / 1e9:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--groups", action="store_true", help="also the GQA group sweep (G = 1, 4, 16) at 32k")
    parser.add_argument("--window-backend", choices=["flex", "flash_attn_4", "gluon_hopper", "fused_with_selected"],
                        default="flex",
                        help="the NSA core's window (model.nsa.window_backend); fla's comparison keeps flex")
    parser.add_argument("--cmp-backend", choices=["triton", "flash_attn_4"], default="triton",
                        help="the NSA core's compressed-attention kernels (model.nsa.cmp_backend)")
    parser.add_argument("--selected-kernels", choices=["triton", "gluon_hopper"], default="triton",
                        help="the selected branch's kernels (model.nsa.selected_kernels; gluon_hopper: Hopper, bf16)")
    parser.add_argument("--float-atomics", action="store_true",
                        help="the FA4 backwards with float atomics (model.nsa.float_atomics; FA4 window or "
                             "compressed branch only)")
    parser.add_argument("--documents", type=int, nargs="*", default=[], metavar="N",
                        help="also time the compiled core with document masking: N equal documents per row (1: "
                             "the masking's own cost)")
    parser.add_argument("--core-only", action="store_true",
                        help="only the compiled core (and its --documents rows): no branch, baseline or fla rows")
    parser.add_argument("--selected", action="store_true",
                        help="only the selected branch: ours eager and compiled, and fla's kernels (G >= 16)")
    parser.add_argument("--fused", action="store_true",
                        help="only the selected and window branches: separate kernels against one fused sweep")
    parser.add_argument("--profile", action="store_true",
                        help="also, per length, the GPU time of one whole-core fwd+bwd per kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/attention.py needs a CUDA GPU")
    # Every (T, heads) recompiles the compiled FlexAttention; past the limit it would run eagerly with T^2 memory.
    torch._dynamo.config.recompile_limit = 64
    HQ, H, D = args.heads, args.kv_heads, args.head_dim
    # before the core compiles
    NSA.window_backend, NSA.cmp_backend, NSA.float_atomics = args.window_backend, args.cmp_backend, args.float_atomics
    NSA.selected_kernels = args.selected_kernels
    try:  # the recipe's rules for these keys (--float-atomics needs an atomic backward) and their packages
        ModelArgs(n_heads=HQ, n_kv_heads=H, head_dim=D, nsa=NSA).validate()
        check_backend(NSA, torch.device("cuda"), torch.bfloat16)
    except ValueError as e:
        parser.error(f"{e} (--window-backend, --cmp-backend, --selected-kernels, --float-atomics)")
    fla = importlib.util.find_spec("fla")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, fla "
          f"{'not installed' if fla is None else __import__('fla').__version__}; B={args.batch} HQ={HQ} H={H} "
          f"D={D} bf16, window {args.window_backend}, compressed {args.cmp_backend}, selected {args.selected_kernels}"
          f"{', float atomics' if args.float_atomics else ''}, ms",
          flush=True)
    if args.selected:  # per T and function: wall-clock fwd / fwd+bwd, its GPU kernel time, and as a CUDA graph
        names = selected_names()
        columns = " | ".join(f"{name}: fwd / fwd+bwd / kernels / graph / model TFLOP/s" for name in names)
        print(f"\n| T | {columns} |\n|---|" + "---|" * len(names))
        for T in args.seq_lens:
            q, k, v = nsa_inputs(args.batch, T, HQ, H, D)[:3]
            functions = {name: (fn, [q, k, v]) for name, fn in selected_functions(q, k, v).items()}
            functions[DENSE_CUDNN] = dense_causal(q, k, v, SDPBackend.CUDNN_ATTENTION)
            times = {name: (*time_ms(fn, leaves), gpu_kernel_ms(fn, leaves), cuda_graph_ms(fn, leaves))
                     for name, (fn, leaves) in functions.items()}
            # the rate of the fwd+bwd as a CUDA graph: what a training step pays without the host's launches
            cells = {name: (*map(_ms, t), nsa_tflops(args.batch, T, HQ, H, D, t[3],
                                                     ("dense",) if name == DENSE_CUDNN else ("slc",)))
                     for name, t in times.items()}
            print(f"| {T} | " + " | ".join(" / ".join(cells.get(name, ("-",) * 5)) for name in names) + " |",
                  flush=True)
        return
    if args.fused:  # per T: the two branches separately and fused, fwd / fwd+bwd, and fused over separate
        print("\n| T | separate: fwd / fwd+bwd | fused: fwd / fwd+bwd | fused / separate (fwd+bwd) |\n"
              "|---|---|---|---|")
        for T in args.seq_lens:
            q, k, v = nsa_inputs(args.batch, T, HQ, H, D)[:3]
            (_, *separate), (_, *fused) = branch_pair_rows(q, k, v)
            print(f"| {T} | {' / '.join(map(_ms, separate))} | {' / '.join(map(_ms, fused))} | "
                  f"{ratio(fused[1], separate[1])} |", flush=True)
        return
    for T in args.seq_lens:
        rows = bench_length(T, args.batch, HQ, H, D, args.documents, args.core_only)
        print(f"\n| T={T} | fwd | fwd+bwd |\n|---|---|---|")
        for name, fwd, fwd_bwd in rows:
            print(f"| {name} | {fwd if isinstance(fwd, str) else f'{fwd:.2f}'} | "
                  f"{fwd_bwd if isinstance(fwd_bwd, str) else f'{fwd_bwd:.2f}'} |")
        by_name = {name: fwd_bwd for name, _, fwd_bwd in rows}
        nsa = by_name[CORE]
        print(f"ratios (fwd+bwd): NSA / SDPA cuDNN = {ratio(nsa, by_name.get('SDPA cuDNN (dense)', 'n/a'))}; "
              f"(fla + flex window) / NSA = {ratio(by_name.get('fla parallel_nsa + flex window', 'n/a'), nsa)}; "
              f"NSA model TFLOP/s {nsa_tflops(args.batch, T, HQ, H, D, nsa)}", flush=True)
        for name, _, fwd_bwd in rows:
            if name.startswith(f"{CORE}, "):
                print(f"{name.removeprefix(CORE + ', ')} / unmasked (fwd+bwd) = {ratio(fwd_bwd, nsa)}", flush=True)
        if args.profile:
            inputs = nsa_inputs(args.batch, T, HQ, H, D)
            print(f"\nwhere one fwd+bwd of the NSA core spends its time, T={T}:\n"
                  f"{kernel_times(nsa_core(inputs), inputs)}\n{kernel_resources()}", flush=True)
            del inputs
    if args.groups:
        T = 32768
        print(f"\n| G (HQ={HQ}, T={T}) | NSA fwd | NSA fwd+bwd | model TFLOP/s |\n|---|---|---|---|")
        for G in (1, 4, 16):
            inputs = nsa_inputs(args.batch, T, HQ, HQ // G, D)
            fwd, fwd_bwd = time_ms(nsa_core(inputs), inputs)
            del inputs
            print(f"| {G} | {fwd if isinstance(fwd, str) else f'{fwd:.2f}'} | "
                  f"{fwd_bwd if isinstance(fwd_bwd, str) else f'{fwd_bwd:.2f}'} | "
                  f"{nsa_tflops(args.batch, T, HQ, HQ // G, D, fwd_bwd)} |", flush=True)


if __name__ == "__main__":
    main()
