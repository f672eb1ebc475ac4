"""Passkey retrieval scoring, checked with stand-in models whose retrieval ability is known."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from nsa_training.config import ConfigError, load_config
from nsa_training.passkey import (
    NEEDLE,
    QUESTION,
    depths,
    evaluate_passkey,
    heat_map,
    heat_map_figure,
    passkey_lengths,
    passkey_sample,
    passkey_scalars,
    table,
)
from nsa_training.tokenizer import ByteTokenizer
from tests.helpers import REPO, event_files, scalars

TOKENIZER = ByteTokenizer()
FILLER = TOKENIZER.encode("lorem ipsum dolor sit amet, " * 80)


def reader(lookback: int):
    """A stand-in model that reads the key from the needle when the needle lies within its last `lookback` input
    tokens, and then predicts the key at the positions that follow the question; elsewhere it predicts token 0."""
    def model(inputs: torch.Tensor) -> torch.Tensor:
        B, T = inputs.shape
        logits = torch.zeros(B, T, TOKENIZER.vocab_size)
        logits[..., 0] = 1.0
        for b in range(B):
            text = TOKENIZER.decode(inputs[b, -lookback:].tolist())
            found = re.search(r"The pass key is (\d+)\. Remember it", text)
            if found is None:
                continue
            key = TOKENIZER.encode(found.group(1))
            after_question = text.rindex(QUESTION) + len(QUESTION)  # bytes: chars are tokens
            for i, token in enumerate(key):  # position p predicts token p + 1
                p = T - lookback + after_question - 1 + i if T >= lookback else after_question - 1 + i
                logits[b, p] = 0.0
                logits[b, p, token] = 20.0
        return logits
    return model


def test_sample_layout():
    for depth in (0.0, 0.5, 1.0):
        ids, n_key = passkey_sample(TOKENIZER, FILLER, 400, depth, "04217")
        assert len(ids) == 401 and n_key == 5
        text = TOKENIZER.decode(ids)
        assert text.endswith(QUESTION + "04217")
        needle = NEEDLE.format(key="04217")
        at, n_filler = text.index(needle), 401 - len(needle) - len(QUESTION) - 5
        assert at == round(depth * n_filler)


def test_a_perfect_reader_scores_one_and_a_blind_model_zero():
    lengths, depth_values = [200, 400], depths(3)
    kwargs = dict(samples=2, key_digits=5, seed=1, device=torch.device("cpu"))
    perfect = evaluate_passkey(reader(10_000), TOKENIZER, FILLER, lengths, depth_values, **kwargs)
    assert [(s.length, s.depth) for s in perfect] == [(n, d) for n in lengths for d in depth_values]
    assert all(s.accuracy == 1.0 for s in perfect)
    assert all(-1e-3 < s.log_likelihood <= 0 for s in perfect)
    # Reading only the last 150 tokens: the needle at depth 1 is in reach at both lengths, at depths 0 and 0.5 of
    # 400 tokens it is not.
    windowed = {(s.length, s.depth): s.accuracy
                for s in evaluate_passkey(reader(150), TOKENIZER, FILLER, lengths, depth_values, **kwargs)}
    assert windowed[(400, 1.0)] == 1.0 and windowed[(200, 1.0)] == 1.0
    assert windowed[(400, 0.0)] == 0.0 and windowed[(400, 0.5)] == 0.0


def test_outputs():
    scores = evaluate_passkey(reader(150), TOKENIZER, FILLER, [200, 400], depths(2), samples=1, key_digits=4,
                              seed=0, device=torch.device("cpu"))
    # The heat map: rows lengths (shortest on top), columns depths, each cell's value written in it, a colour bar
    figure = heat_map_figure({(s.length, s.depth): s.accuracy for s in scores}, "passkey accuracy")
    ax, colour_bar = figure.axes
    assert ax.images[0].get_array().tolist() == [[s.accuracy for s in scores[:2]], [s.accuracy for s in scores[2:]]]
    assert [t.get_text() for t in ax.texts] == [f"{s.accuracy:.2f}" for s in scores]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["200", "400"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.00", "1.00"]
    assert colour_bar.get_ylabel() == "accuracy"
    image = heat_map(scores, "passkey accuracy")  # the same drawn for tensorboard: RGB, values in [0, 1]
    assert image.shape[0] == 3 and min(image.shape[1:]) > 200 and 0 <= image.min() and image.max() <= 1
    values = passkey_scalars(scores)
    assert values["passkey/accuracy/len400"] == pytest.approx((scores[2].accuracy + scores[3].accuracy) / 2)
    assert values["passkey/accuracy"] == pytest.approx(sum(s.accuracy for s in scores) / 4)
    assert table(scores).splitlines()[2].startswith("| 200 |")


def test_lengths_and_depths():
    assert passkey_lengths(256, 1024) == [256, 512, 1024]
    assert passkey_lengths(300, 1024) == [300, 600, 1024]
    assert passkey_lengths(1024, 1024) == [1024]
    assert depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_too_short_a_sample_is_a_config_error():
    with pytest.raises(ConfigError, match="passkey.min_length"):
        passkey_sample(TOKENIZER, FILLER, 40, 0.5, "12345")


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--training.steps", "2",
                           "--lr_scheduler.warmup_steps", "1", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_training_logs_passkey_scores_and_the_heat_map(tmp_path):
    done = _train("--training.eval_interval", "2", "--passkey.enable", "true", "--passkey.min_length", "128",
                  "--passkey.depths", "3", "--passkey.samples", "2", "--job.run_dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    tags = {}
    images = {}  # tag -> (width, height)
    for event_file in event_files(tmp_path):
        tags.update(scalars(event_file))
        # the loader gives images in the tensor form: [width, height, PNG] as strings
        images |= {v.tag: tuple(int(x) for x in v.tensor.string_val[:2])
                   for e in EventFileLoader(str(event_file)).Load() for v in e.summary.value
                   if v.metadata.plugin_data.plugin_name == "images"}
    for length in (128, 256):  # doubling from min_length up to data.seq_len
        assert 0 <= tags[f"passkey/accuracy/len{length}"][2] <= 1
        assert tags[f"passkey/log_likelihood/len{length}"][2] < 0
    width, height = images["passkey/accuracy_length_x_depth"]
    assert width > 300 and height > 200  # the labelled figure (axes, values, colour bar), not a bare grid of cells


@pytest.mark.parametrize("args, key", [(("--passkey.min_length", "512"), "passkey.min_length"),
                                       (("--passkey.min_length", "64"), "passkey.min_length"),
                                       (("--training.eval_interval", "0"), "training.eval_interval")])
def test_passkey_settings_that_cannot_run_are_one_line(tmp_path, args, key):
    done = _train("--passkey.enable", "true", *args, "--job.run_dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and key in done.stderr
    assert not (tmp_path / "run").exists()


def test_passkey_without_matplotlib_is_a_config_error(monkeypatch):
    """Checked before training, not at the first evaluation: the heat map is drawn with matplotlib."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^passkey.enable = true draws its heat map with matplotlib.*pip install"):
        load_config([str(REPO / "recipes/debug.toml"), "--passkey.enable", "true"])
    load_config([str(REPO / "recipes/debug.toml"), "--passkey.enable", "false"])
