"""Passkey retrieval (needle in a haystack): does the model find a key placed far back in its context?

A sample of `length` tokens is filler text (held-out data) with a needle ("The pass key is 83920. Remember it.")
at a relative `depth` (0: the start, 1: just before the question), then "What is the pass key? The pass key is"
and the key itself. The model is scored teacher-forced on the key's tokens: `accuracy` is the share of key tokens
predicted exactly (argmax), `log_likelihood` their mean log-probability. A model that uses its context beyond the
sliding window retrieves keys at every depth; one that does not is at chance far from the question.

Every rank runs the same forwards (one per length, of the same shape), so scoring works under any data-parallel
plan; the logged scores are the logging rank's, whose filler comes from its own held-out shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nsa_training.config import ConfigError
from nsa_training.tokenizer import Tokenizer

if TYPE_CHECKING:  # matplotlib is imported only to draw (config.py checks that it is installed)
    from matplotlib.figure import Figure

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is "


@dataclass(frozen=True)
class PasskeyScore:
    length: int
    depth: float
    accuracy: float
    log_likelihood: float


def passkey_sample(tokenizer: Tokenizer, filler: Sequence[int], length: int, depth: float,
                   key: str) -> tuple[list[int], int]:
    """`length + 1` token ids (a model input of `length` and its last label) with the key's needle at `depth` of
    the filler, ending in the key; and the number of the key's tokens (the sample's last ones)."""
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question, answer = tokenizer.encode(QUESTION), tokenizer.encode(key)
    n_filler = length + 1 - len(needle) - len(question) - len(answer)
    if n_filler < 0 or len(filler) < n_filler:
        raise ConfigError(f"passkey.min_length: a sample of {length} tokens cannot hold the needle, question and "
                          f"key ({length + 1 - n_filler} tokens) and {n_filler} filler tokens "
                          f"({len(filler)} available): raise passkey.min_length")
    at = round(depth * n_filler)
    return [*filler[:at], *needle, *filler[at:n_filler], *question, *answer], len(answer)


def filler_tokens(loader: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[int]:
    """At least `n` held-out tokens from a resumable batch loader (see nsa_training.data), left where it was."""
    state = loader.state_dict()
    tokens: list[int] = []
    while len(tokens) < n:
        inputs = next(loader)[0]  # (inputs, labels[, doc_start])
        tokens += inputs.flatten().tolist()
    loader.load_state_dict(state)
    return tokens


def passkey_lengths(min_length: int, max_length: int) -> list[int]:
    """`min_length`, doubling, up to and including `max_length`."""
    lengths = [min_length]
    while lengths[-1] * 2 < max_length:
        lengths.append(lengths[-1] * 2)
    return lengths + [max_length] if lengths[-1] != max_length else lengths


def depths(n: int) -> list[float]:
    """`n` evenly spaced relative depths from 0 to 1."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


@torch.no_grad()
def evaluate_passkey(model: Callable[[torch.Tensor], torch.Tensor], tokenizer: Tokenizer, filler: Sequence[int],
                     lengths: Sequence[int], depth_values: Sequence[float], *, samples: int, key_digits: int,
                     seed: int, device: torch.device) -> list[PasskeyScore]:
    """One score per (length, depth): `samples` keys each, batched per length (one forward per length)."""
    generator = torch.Generator().manual_seed(seed)
    keys = [str(int(k)).zfill(key_digits)
            for k in torch.randint(10 ** key_digits, (samples,), generator=generator)]
    scores = []
    for length in lengths:
        rows = [passkey_sample(tokenizer, filler, length, depth, key) for depth in depth_values for key in keys]
        n_key = rows[0][1]
        tokens = torch.tensor([ids for ids, _ in rows], device=device)
        logits = model(tokens[:, :-1])[:, -n_key:].float()  # the positions that predict the key's tokens
        target = tokens[:, -n_key:]
        hit = (logits.argmax(-1) == target).float().mean(-1).view(len(depth_values), samples).mean(-1)
        log_p = -F.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(-1)
        log_p = log_p.view(len(depth_values), samples).mean(-1)
        scores += [PasskeyScore(length, d, float(a), float(lp)) for d, a, lp in zip(depth_values, hit, log_p)]
    return scores


HEAT_MAP_TAG = "passkey/accuracy_length_x_depth"  # the tensorboard image of heat_map()


def heat_map_figure(accuracy: Mapping[tuple[int, float], float], title: str) -> Figure:
    """Accuracy per (length, depth) as a labelled figure: rows are lengths (shortest on top), columns depths (0
    left), each cell its value, a colour bar from red (0) to green (1). Drawn off screen (no pyplot state)."""
    from matplotlib.figure import Figure

    lengths, depth_values = sorted({k[0] for k in accuracy}), sorted({k[1] for k in accuracy})
    grid = [[accuracy[length, d] for d in depth_values] for length in lengths]
    fig = Figure(figsize=(max(1.1 * len(depth_values) + 2.2, 5.2), 0.6 * len(lengths) + 1.6), dpi=110,
                 layout="tight")
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(depth_values)), [f"{d:.2f}" for d in depth_values])
    ax.set_yticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_xlabel("needle depth (0: context start, 1: just before the question)")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="accuracy")
    return fig


def heat_map(scores: Sequence[PasskeyScore], title: str) -> torch.Tensor:
    """`heat_map_figure` of one evaluation as an RGB image [3, H, W] with values in [0, 1] (tensorboard's format)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(heat_map_figure({(s.length, s.depth): s.accuracy for s in scores}, title))
    canvas.draw()
    rgba = torch.frombuffer(bytearray(canvas.buffer_rgba()), dtype=torch.uint8)
    return rgba.view(canvas.get_width_height()[::-1] + (4,))[..., :3].permute(2, 0, 1).float() / 255


def passkey_scalars(scores: Sequence[PasskeyScore]) -> dict[str, float]:
    """Tensorboard scalars: accuracy and log-likelihood per length (mean over depths), and overall accuracy."""
    out = {}
    for length in sorted({s.length for s in scores}):
        row = [s for s in scores if s.length == length]
        out[f"passkey/accuracy/len{length}"] = sum(s.accuracy for s in row) / len(row)
        out[f"passkey/log_likelihood/len{length}"] = sum(s.log_likelihood for s in row) / len(row)
    out["passkey/accuracy"] = sum(s.accuracy for s in scores) / len(scores)
    return out


def table(scores: Sequence[PasskeyScore]) -> str:
    """Markdown table of accuracy: one row per length, one column per depth."""
    depth_values = sorted({s.depth for s in scores})
    lines = ["| length | " + " | ".join(f"depth {d:.2f}" for d in depth_values) + " | mean |",
             "|---" * (len(depth_values) + 2) + "|"]
    for length in sorted({s.length for s in scores}):
        row = sorted((s for s in scores if s.length == length), key=lambda s: s.depth)
        mean = sum(s.accuracy for s in row) / len(row)
        lines.append(f"| {length} | " + " | ".join(f"{s.accuracy:.2f}" for s in row) + f" | {mean:.2f} |")
    return "\n".join(lines)
