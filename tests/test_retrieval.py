"""The retrieval demonstration: passkey training rows (data.source = "passkey"), the window-only ablation
(model.nsa.window_only), recipes/retrieval_nsa.toml and bench/retrieval.py (its table, and a tiny run on CPU)."""

from __future__ import annotations

import functools
import pickle
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.retrieval import ARMS, accuracy_grid, arm_table
from nsa_models.args import ModelArgs, NSAArgs
from nsa_models.model import NSAAttention, apply_rope, rope_cache
from nsa_training.config import ConfigError, DataConfig, config_to_dict, load_config
from nsa_training.data import build_data_loader
from nsa_training.passkey import NEEDLE, QUESTION, PasskeyScore
from tests.helpers import REPO, env

RECIPE = REPO / "recipes" / "retrieval_nsa.toml"


def loader(data: DataConfig, split: str = "train", seed: int = 0, rank: int = 0, world: int = 1, batch_size: int = 8):
    return build_data_loader(data, split=split, batch_size=batch_size, dp_rank=rank, dp_world_size=world, seed=seed)


def rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[list[int]]:
    """The seq_len+1 tokens of each row of an (inputs, labels) batch, after checking that labels are inputs
    shifted by one."""
    inputs, labels = batch
    assert inputs.shape == labels.shape and torch.equal(inputs[:, 1:], labels[:, :-1])
    return torch.cat([inputs, labels[:, -1:]], dim=1).tolist()


def parse_row(row: list[int]) -> tuple[str, int, int]:
    """(key, the needle's first position, the position of the query that predicts the key's first token) of a
    passkey row, read back independently of how it was built: it must end in QUESTION + key and hold that key's
    needle once."""
    text = "".join(map(chr, row))  # one character per byte token (the needle and question are ASCII)
    match = re.search(re.escape(QUESTION) + r"(\d+)$", text)
    assert match, text[-80:]
    key = match.group(1)
    needle = NEEDLE.format(key=key)
    assert text.count(needle) == 1
    return key, text.index(needle), match.start(1) - 1


# --- data.source = "passkey" ------------------------------------------------------------------------------------

def test_rows_hold_needle_and_key_mostly_beyond_the_window():
    """The recipe's rows: each ends in the question and its key, whose needle lies at a random depth, beyond the
    recipe's window in about 9 rows of 10 (uniform depths: (n_filler + question - window) / n_filler)."""
    config, _ = load_config([str(RECIPE)])
    window, train = config.model.nsa.window_size, loader(config.data, batch_size=32)
    keys, depths, beyond = [], [], []
    for _ in range(4):
        for row in rows(next(train)):
            assert len(row) == config.data.seq_len + 1
            key, at, query = parse_row(row)
            keys.append(key)
            depths.append(at / query)
            beyond.append(at + len(NEEDLE.format(key=key)) <= query - window + 1)
    assert {len(k) for k in keys} == set(range(1, 19)) and len(set(keys)) > 0.9 * len(keys)  # every key length
    assert min(depths) < 0.1 and max(depths) > 0.8  # spread over the row, not one depth
    assert 0.8 <= sum(beyond) / len(beyond) <= 0.97, sum(beyond) / len(beyond)  # some within the window too


def test_rows_are_seeded_per_run_and_rank():
    data = DataConfig(source="passkey", seq_len=256)
    first = rows(next(loader(data)))
    assert rows(next(loader(data))) == first
    for other in (loader(data, seed=1), loader(data, rank=1, world=2)):
        assert [parse_row(r)[0] for r in rows(next(other))] != [parse_row(r)[0] for r in first]


def test_resume_yields_exactly_the_next_batches():
    data = DataConfig(source="passkey", seq_len=256)
    original = loader(data)
    next(original)
    state = pickle.loads(pickle.dumps(original.state_dict()))  # as a checkpoint keeps it
    expected = [rows(next(original)) for _ in range(3)]
    resumed = loader(data)
    resumed.load_state_dict(state)
    assert [rows(next(resumed)) for _ in range(3)] == expected


def test_eval_split_is_plain_held_out_text():
    """Evaluation (and the [passkey] haystacks drawn from it) reads held-out text without needles."""
    data = DataConfig(source="passkey", seq_len=256)
    text = "".join(map(chr, sum(rows(next(loader(data, split="eval"))), [])))
    train_text = "".join(map(chr, sum(rows(next(loader(data))), [])))
    assert "pass key" in train_text and "pass key" not in text


def test_rows_too_short_for_the_longest_key_name_data_seq_len():
    with pytest.raises(ConfigError, match="data.seq_len = 64.*raise data.seq_len"):
        loader(DataConfig(source="passkey", seq_len=64))


def test_document_mask_is_refused_with_passkey_rows():
    with pytest.raises(ConfigError, match="data.document_mask = true would cut data.source = 'passkey'"):
        load_config([str(RECIPE), "--data.document_mask", "true"])


# --- model.nsa.window_only --------------------------------------------------------------------------------------

def window_branch(attn: NSAAttention, x: torch.Tensor, rope: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window branch alone, times its gate, computed densely from the module's projections: query t
    attends keys t-window+1 .. t of its GQA group's K/V head."""
    B, T, _ = x.shape
    HQ, H, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rope(attn.wq(x).view(B, T, HQ, D), rope)
    k = apply_rope(attn.wk(x).view(B, T, H, D), rope).repeat_interleave(HQ // H, dim=2)
    v = attn.wv(x).view(B, T, H, D).repeat_interleave(HQ // H, dim=2)
    t = torch.arange(T, device=x.device)
    visible = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    gate_win = torch.sigmoid(attn.gate(x)).view(B, T, HQ, 3)[..., 2:]
    return attn.wo((out * gate_win).reshape(B, T, -1))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.gpu)])
def test_window_only_is_the_window_branch_alone(backend: str):
    """window_only: the output is the gated window branch (fp32; the triton backend within its fp32 bound), and the
    compressed branch learns nothing; without it the same weights give another output (the other branches count
    at this length: 5 selection blocks, 19 compressed ones)."""
    device = torch.device("cuda" if backend == "triton" else "cpu")
    nsa = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=4, window_size=64, backend=backend,
                  window_only=True)
    args = ModelArgs(dim=128, n_heads=4, n_kv_heads=2, head_dim=64, nsa=nsa)
    torch.manual_seed(0)
    with torch.device(device):
        attn = NSAAttention(args)
        attn.init_weights(0.1, 0.1)
        torch.nn.init.normal_(attn.gate.bias)  # gates away from 0.5, different per head
        x = torch.randn(2, 320, args.dim)
    rope = rope_cache(320, args.head_dim, args.rope_theta, device)
    out, _ = attn(x, rope)
    want = window_branch(attn, x, rope, nsa.window_size)
    assert rel_err(out, want) <= (1e-3 if backend == "triton" else 1e-5), rel_err(out, want)
    out.square().sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in attn.compress_k.parameters())
    attn.nsa.window_only = False
    assert rel_err(attn(x, rope)[0], want) > 1e-2


# --- recipes/retrieval_nsa.toml ---------------------------------------------------------------------------------

def test_recipe_and_its_commands_load():
    """The recipe validates as an NSA run on passkey rows with the [passkey] heat map, its window beyond most
    needles; every train.py command in its header loads; the window-only twin differs in window_only alone."""
    config, _ = load_config([str(RECIPE)])
    nsa = config.model.nsa
    assert config.model.attention == "nsa" and not nsa.window_only and config.data.source == "passkey"
    assert config.passkey.enable and config.passkey.min_length <= config.data.seq_len
    assert nsa.window_size < config.passkey.min_length  # some depths lie beyond the window at every length
    commands = [shlex.split(line.lstrip("# ")) for line in RECIPE.read_text().splitlines()
                if line.startswith("#   python train.py")]
    assert len(commands) == 2
    twin = None
    for command in commands:
        loaded, _ = load_config([str(REPO / command[2]), *command[3:]])
        twin = loaded if loaded.model.nsa.window_only else twin
    differs = {k for k, v in config_to_dict(twin).items() if config_to_dict(config)[k] != v}
    assert differs == {"model.nsa.window_only", "job.run_dir"}


# --- bench/retrieval.py -----------------------------------------------------------------------------------------

def test_arm_table_gives_each_cell_the_seeds_mean_and_range():
    seed0 = [PasskeyScore(L, d, 0.5 if (L, d) == (512, 0.5) else 1.0, -0.1) for L in (256, 512) for d in (0, 0.5, 1)]
    seed1 = [PasskeyScore(L, d, d * 0.9 + 0.1, -2.0) for L in (512, 256) for d in (1.0, 0.5, 0.0)]
    assert arm_table(accuracy_grid([seed0, seed1])).splitlines() == [
        "| length | depth 0.00 | depth 0.50 | depth 1.00 | mean |",
        "|---|---|---|---|---|",
        "| 256 | 0.55 (0.10-1.00) | 0.78 (0.55-1.00) | 1.00 (1.00-1.00) | 0.77 (0.55-1.00) |",
        "| 512 | 0.55 (0.10-1.00) | 0.53 (0.50-0.55) | 1.00 (1.00-1.00) | 0.69 (0.55-0.83) |"]
    assert arm_table(accuracy_grid([seed0])).splitlines()[3] == "| 512 | 1.00 | 0.50 | 1.00 | 0.83 |"
    with pytest.raises(ValueError, match="different lengths or depths"):
        accuracy_grid([seed0, seed1[:-1]])


# Debug-sized runs on CPU: one block of width 64, 2 rows of 256 per step, [passkey] at 128 and 256.
TINY = {"training.device": "cpu", "training.mixed_precision": "fp32", "compile.enable": "false",
        "model.nsa.backend": "reference", "model.dim": "64", "model.n_layers": "1", "model.n_heads": "2",
        "model.n_kv_heads": "1", "model.head_dim": "32", "model.max_seq_len": "256", "data.seq_len": "256",
        "model.nsa.cmp_block_size": "16", "model.nsa.cmp_stride": "8", "model.nsa.sel_block_size": "16",
        "model.nsa.n_selected": "4", "model.nsa.window_size": "32", "training.micro_batch_size": "2",
        "training.global_batch_tokens": "512", "lr_scheduler.warmup_steps": "1", "training.eval_interval": "2",
        "training.eval_batches": "1", "passkey.min_length": "128", "passkey.samples": "1", "checkpoint.interval": "2",
        "metrics.nsa_stats_freq": "0"}


def accuracy_rows(table: str) -> dict[str, list[str]]:
    """length -> the cells of its row, of a markdown table printed by scripts/eval_passkey.py or bench/retrieval.py."""
    return {cells[0]: cells[1:] for line in table.splitlines() if re.match(r"\| \d", line)
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_bench_trains_every_arm_and_tabulates_their_checkpoints(tmp_path):
    """2-step runs of the three arms (NSA, window-only, dense), one seed: each arm's table is what
    scripts/eval_passkey.py prints for its run's final checkpoint, and each arm has a labelled heat map."""
    out = tmp_path / "out"
    command = [sys.executable, "bench/retrieval.py", "--steps", "2", "--seeds", "1", "--out", str(out), "--depths",
               "3", "--samples", "2", *(a for k, v in TINY.items() for a in ("--set", f"{k}={v}"))]
    run = functools.partial(subprocess.run, cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=900)
    result = run(command)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / "retrieval.md").read_text()
    assert "window_size 32, data.seq_len 256" in report and report in result.stdout
    tables = report.split("\n\n")[1:]  # each arm: its title line, then its table
    for arm, overrides, title, table in zip(ARMS, ARMS.values(), tables[::2], tables[1::2]):
        run_dir = out / ",".join(f"{k}={v}" for k, v in {**overrides, "training.seed": "0"}.items())
        assert title.strip().startswith(f"{arm} (")
        assert f"attention = \"{overrides['model.attention']}\"" in (run_dir / "config.toml").read_text()
        single = run([sys.executable, "scripts/eval_passkey.py", str(run_dir), "--min-length", "128", "--depths", "3",
                      "--samples", "2", "--device", "cpu"])
        assert single.returncode == 0, single.stderr
        assert accuracy_rows(table) == accuracy_rows(single.stdout)
        assert list(accuracy_rows(table)) == ["128", "256"] and len(accuracy_rows(table)["128"]) == 4  # 3 depths, mean
        from PIL import Image

        with Image.open(out / f"heat_map_{arm}.png") as image:  # drawn with axes, values and a colour bar
            assert image.format == "PNG" and image.size[0] > 200 and image.size[1] > 150


def test_bench_bad_input_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "bench/retrieval.py", "--out", str(tmp_path / "out"), "--set",
                             "data.document_mask=true"], cwd=REPO, env=env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and result.stderr.startswith("error: data.document_mask = true would cut")
    assert len(result.stderr.splitlines()) == 1 and not Path(tmp_path / "out").exists()
