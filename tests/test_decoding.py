"""nsa_models/decoding.py: cached decoding against the full forward (the oracle), for NSA and dense attention."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from nsa_models import get_flavor
from nsa_models.args import ModelArgs
from nsa_models.decoding import decode_step, prefill
from nsa_models.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate.py")
generate_script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(generate_script)


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding runs tiny ops: on a shared 2-core machine one thread ran them ~20x faster than two (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(flavor: str = "debug", max_seq_len: int = 320, seed: int = 0, **nsa) -> Transformer:
    """A debug-sized fp32 model (reference backend) whose RoPE table covers max_seq_len positions. Blocks of the
    debug flavor: l = 16, d = 8, l' = 16, n = 4, w = 32, so 300 positions cross every kind of boundary."""
    args: ModelArgs = get_flavor(flavor)
    args.max_seq_len = max_seq_len
    args.nsa = dataclasses.replace(args.nsa, **nsa)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("prompt_len", [100, 1, 45])
def test_cached_greedy_tokens_equal_the_recompute(prompt_len):
    # 100: past the window (32), n = 4 selection blocks (64) and many compressed blocks; 45: no multiple of 8 or 16.
    model = _model()
    prompt = torch.randint(0, model.args.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    cached = generate_script.generate(model, prompt.tolist(), 200, temperature=0)
    recomputed = generate_script.generate(model, prompt.tolist(), 200, temperature=0, use_cache=False)
    assert len(cached) == prompt_len + 200
    assert cached == recomputed


VARIANTS = {
    "debug": dict(),
    "separate_kv_mean": dict(separate_kv=True, compress="mean"),
    "l_neq_sel": dict(cmp_block_size=16, cmp_stride=8, sel_block_size=32, n_selected=3, window_size=24),
    "window_only": dict(window_only=True),
}


@pytest.mark.parametrize(("variant", "prompt_len"), [("debug", 1), ("debug", 45), ("separate_kv_mean", 23),
                                                      ("l_neq_sel", 61), ("window_only", 7), ("dense", 1),
                                                      ("dense", 45)])
def test_step_logits_equal_the_full_forward(variant, prompt_len):
    """Teacher-forced random tokens, 2 rows: every step's logits are the full forward's at that position."""
    model = _model("dense-debug") if variant == "dense" else _model(**VARIANTS[variant])
    T = 220
    tokens = torch.randint(0, model.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        logits, cache = prefill(model, tokens[:, :prompt_len])
        torch.testing.assert_close(logits, full[:, :prompt_len], rtol=0, atol=1e-5)
        for t in range(prompt_len, T):
            step = decode_step(model, tokens[:, t], cache)
            torch.testing.assert_close(step, full[:, t], rtol=0, atol=1e-5, msg=lambda m, t=t: f"position {t}: {m}")
    assert cache.length == T


def test_a_full_context_slides_as_the_recompute_does():
    """Past max_seq_len positions shift: the cached path re-prefills the last max_seq_len tokens, as the oracle."""
    model = _model(max_seq_len=48)
    prompt = list(range(40))
    assert (generate_script.generate(model, prompt, 30, temperature=0)
            == generate_script.generate(model, prompt, 30, temperature=0, use_cache=False))


def test_bad_lengths_raise_value_errors():
    model = _model(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        prefill(model, torch.zeros(1, 17, dtype=torch.long))
    _, cache = prefill(model, torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="cache is full"):
        decode_step(model, torch.zeros(1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="at least one token"):
        generate_script.generate(model, [], 4)


def test_bench_prints_a_row_per_flavor_and_context(capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--contexts", "40", "--new-tokens", "2", "--uncached-tokens", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| nsa", "| dense"))]
    assert len(rows) == 2 and rows[0].startswith("| nsa | 40 |")
