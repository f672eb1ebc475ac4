"""Forward+backward time and peak memory of one transformer block, NSA against its dense twin.

    python bench/layer.py --device cpu --seq-lens 2048 8192
    python bench/layer.py --device cuda --seq-lens 2048 8192 32768 --compile

Prints a markdown table (one row per flavor x T) for docs/PERFORMANCE.md. Host fwd / bwd: the time the host takes
to enqueue the forward / backward (on a GPU, without waiting for it; compiled, without CUDA graphs): where their sum
nears the fwd+bwd time, the host bounds the block, as it does a step under FSDP2. On CPU the peak is the process's
maximum RSS, which never decreases: measure one flavor and T per process for exact CPU peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch

from nsa_models import get_flavor
from nsa_models.model import TransformerBlock, rope_cache
from nsa_models.nsa import check_backend, window_mask


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    # The process's peak RSS (Linux: KiB): it never goes down, so on CPU only a process's first row is its own.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def time_block(flavor: str, T: int, device: torch.device, dtype: torch.dtype, repeats: int, compile: bool,
               query_chunk: int, profile: bool = False, backend: str = "reference", batch: int = 1,
               window_backend: str | None = None) -> tuple[float, float, float, float]:
    """Median fwd+bwd milliseconds, the host's median fwd and bwd enqueue milliseconds, and peak memory (GiB) of
    block 0 of `flavor` on a [batch, T, dim] input."""
    args = get_flavor(flavor)
    nsa = dataclasses.replace(args.nsa, query_chunk=query_chunk, backend=backend)
    if window_backend is not None:
        nsa = dataclasses.replace(nsa, window_backend=window_backend)
    args = dataclasses.replace(args, max_seq_len=max(T, args.max_seq_len), nsa=nsa)
    if args.attention == "nsa":
        check_backend(args.nsa, device, dtype)
    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(device)
    block.init_weights(args.init_std, args.n_layers)
    rope = rope_cache(T, args.head_dim, args.rope_theta, device)
    # Built once outside the block, as Transformer.forward does (inside, the compiled block would rebuild it).
    mask = window_mask(T, args.nsa, device) if args.attention == "nsa" else None
    fn = torch.compile(block, fullgraph=True, dynamic=False) if compile else block
    x = torch.randn(batch, T, args.dim, device=device, requires_grad=True)

    def step() -> float:
        """fwd+bwd; returns when the forward was enqueued."""
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out, _ = fn(x, rope, mask)
        loss = out.float().square().mean()
        enqueued = time.perf_counter()
        loss.backward()
        return enqueued

    for _ in range(2):  # warm-up (and compilation)
        step()
    if profile:
        with torch.profiler.profile() as prof:
            step()
        sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=15))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    times, host_fwd, host_bwd = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        forward_enqueued = step()
        backward_enqueued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        host_fwd.append((forward_enqueued - start) * 1e3)
        host_bwd.append((backward_enqueued - forward_enqueued) * 1e3)
    return (statistics.median(times), statistics.median(host_fwd), statistics.median(host_bwd),
            peak_bytes(device) / 2**30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--flavors", nargs="+", default=["nsa-125m", "dense-125m"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=1, help="sequences per input")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--query-chunk", type=int, default=512, help="reference backend's query chunk")
    parser.add_argument("--compile", action="store_true", help="torch.compile the block (fullgraph)")
    parser.add_argument("--profile", action="store_true", help="also print the top ops of one step")
    parser.add_argument("--backend", default="reference", help="NSA backend (model.nsa.backend)")
    parser.add_argument("--window-backend", default=None, help="model.nsa.window_backend (default: the flavor's)")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# one block, B={opts.batch}, {str(dtype).removeprefix('torch.')}, {name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads, compile={opts.compile}, nsa backend={opts.backend}, "
          f"window backend={opts.window_backend or 'default'}")
    print("| flavor | T | fwd+bwd ms | host fwd ms | host bwd ms | peak GiB |")
    print("|---|---|---|---|---|---|")
    for flavor in opts.flavors:
        for T in opts.seq_lens:
            ms, fwd, bwd, gib = time_block(flavor, T, device, dtype, opts.repeats, opts.compile, opts.query_chunk,
                                           opts.profile, opts.backend, opts.batch, opts.window_backend)
            print(f"| {flavor} | {T} | {ms:.1f} | {fwd:.2f} | {bwd:.2f} | {gib:.2f} |", flush=True)


if __name__ == "__main__":
    main()
