"""Decoding speed with the key/value cache (`nsa_models.decoding`) against a full forward per token.

    python bench/decode.py --contexts 1024 8192 32768 --threads 1

A debug-width model (dim 128, 2 layers, 4 query / 2 KV heads of 32, fp32, reference backend) with max_seq_len raised
to the longest context, NSA at the paper's block sizes (l/d/l'/n/w = 32/16/64/16/512) and its dense twin. Each row
prefills a random prompt of `context` tokens, then times `--new-tokens` cached steps, and full forwards over the
growing context (`--uncached-tokens`, fewer: at 32k one NSA forward of the reference backend takes about a
minute). Prints a markdown table for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time

import torch

from nsa_models import get_flavor
from nsa_models.args import NSAArgs
from nsa_models.decoding import decode_step, prefill
from nsa_models.model import Transformer


def build(attention: str, max_seq_len: int) -> Transformer:
    """The bench model: debug widths, the paper's NSA blocks, RoPE up to max_seq_len."""
    args = get_flavor("debug" if attention == "nsa" else "dense-debug")
    args = dataclasses.replace(args, max_seq_len=max_seq_len, nsa=NSAArgs())
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


@torch.no_grad()
def measure(attention: str, context: int, new_tokens: int, uncached_tokens: int) -> dict:
    """Prefill seconds and tokens/s, cached and uncached, after a prompt of `context` tokens."""
    model = build(attention, context + max(new_tokens, uncached_tokens))
    tokens = torch.randint(0, model.args.vocab_size, (1, context + max(new_tokens, uncached_tokens)))
    prefill(model, tokens[:, :64])  # warm-up: first calls pay one-time dispatch and allocation costs
    start = time.perf_counter()
    _, cache = prefill(model, tokens[:, :context])
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for t in range(context, context + new_tokens):
        decode_step(model, tokens[:, t], cache)
    cached_s = time.perf_counter() - start
    start = time.perf_counter()
    for t in range(context, context + uncached_tokens):
        model(tokens[:, :t + 1])
    uncached_s = time.perf_counter() - start
    return dict(prefill_s=prefill_s, cached=new_tokens / cached_s, uncached=uncached_tokens / uncached_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--attention", nargs="+", choices=["nsa", "dense"], default=["nsa", "dense"])
    parser.add_argument("--new-tokens", type=int, default=64, help="cached steps timed per row")
    parser.add_argument("--uncached-tokens", type=int, nargs="+", default=[16, 4, 2],
                        help="full forwards timed per row, one value per context (the last repeats)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if min(args.contexts) < 1 or args.new_tokens < 1 or min(args.uncached_tokens) < 1 or args.threads < 0:
        parser.error("--contexts, --new-tokens and --uncached-tokens must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, fp32", file=sys.stderr, flush=True)
    print("| attention | context | prefill (s) | cached tokens/s | uncached tokens/s (tokens timed) | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for attention in args.attention:
        for i, context in enumerate(args.contexts):
            uncached = args.uncached_tokens[min(i, len(args.uncached_tokens) - 1)]
            r = measure(attention, context, args.new_tokens, uncached)
            print(f"| {attention} | {context:,} | {r['prefill_s']:.2f} | {r['cached']:.1f} | {r['uncached']:.3g} "
                  f"({uncached}) | {r['cached'] / r['uncached']:.0f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
