"""Sample text from a run's latest checkpoint, with the run's own model settings and tokenizer.

    python scripts/generate.py runs/debug --prompt "def main(" --max-new-tokens 200
    python scripts/generate.py runs/debug --prompts-file prompts.txt --temperature 0   # greedy, one prompt a line

The prompt runs through one full forward; each new token then costs one step with a key/value cache
(`nsa_models.decoding`: the same reference math, the layers' cached keys, values and compressed blocks).
`--no-cache` computes every token with a full forward over the context instead (the oracle: the model's
training-time computation). Either way the context is the last `model.max_seq_len` tokens: once it is full, each
token needs a full forward, as positions shift. An empty prompt starts from the tokenizer's end-of-text token,
which precedes every document in training (GPT-2's convention). `--temperature 0` is greedy decoding;
otherwise logits are divided by the temperature, cut to the `--top-k` most likely tokens (0: all) and sampled
with a generator seeded by `--seed` (the same command prints the same text).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from nsa_models.decoding import decode_step, prefill
from nsa_models.model import Transformer
from nsa_training.config import ConfigError
from nsa_training.inference import load_run
from nsa_training.watchdog import report_failure

PROGRESS_MIN_TOKENS = 256  # longer generations show a progress bar on stderr


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from the last position's logits [vocab]."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        cutoff = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None, use_cache: bool = True) -> list[int]:
    """`prompt` (at least one id) followed by up to `max_new_tokens` sampled ids (fewer if `eos_id` comes).
    use_cache: decode with a key/value cache; False recomputes a full forward per token."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token id")
    device = model.tok_embeddings.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    window = model.args.max_seq_len
    tokens = list(prompt)
    cache = None
    steps = tqdm(range(max_new_tokens), desc="tokens", unit="tok", file=sys.stderr, leave=False,
                 disable=max_new_tokens < PROGRESS_MIN_TOKENS)
    for _ in steps:
        if cache is not None and cache.length < window:
            logits = decode_step(model, torch.tensor([tokens[-1]], device=device), cache)[0]
        else:  # the first token, a full context (positions restart: the window slides) or --no-cache
            context = torch.tensor([tokens[-window:]], device=device)
            if use_cache:
                logits, cache = prefill(model, context)
                logits = logits[0, -1]
            else:
                logits = model(context)[0, -1]
        token = next_token(logits, temperature, top_k, generator)
        tokens.append(token)
        if token == eos_id:
            break
    steps.close()
    return tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the job.run_dir of a training run")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts-file", type=Path, help="a UTF-8 file with one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute a full forward per token (the oracle of the cached decoding)")
    args = parser.parse_args(argv)
    if args.prompts_file is not None:
        try:
            args.prompt += [line for line in args.prompts_file.read_text(encoding="utf-8").splitlines() if line]
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--prompts-file {str(args.prompts_file)!r}: {e}")
    if not args.prompt:
        parser.error("give --prompt TEXT or --prompts-file FILE")
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("--max-new-tokens must be >= 1, --temperature and --top-k >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model, tokenizer, _, path = load_run(args.run_dir, torch.device(args.device))
        print(f"# {path}", file=sys.stderr)
        for prompt in args.prompt:
            ids = tokenizer.encode(prompt) or [tokenizer.eos_id]  # empty: start a document, as after an EOS
            out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           seed=args.seed, eos_id=tokenizer.eos_id, use_cache=not args.no_cache)
            print(prompt + tokenizer.decode(out[len(ids):]), flush=True)
    except ConfigError as e:
        return report_failure(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
