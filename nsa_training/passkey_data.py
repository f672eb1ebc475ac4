"""`data.source = "passkey"`: training rows that teach retrieval, each a haystack with one passkey to recall.

A row is filler text (the embedded corpus, packed as `PackedLoader` packs it, in the run's tokenizer) with the
needle of `nsa_training.passkey` at a uniformly random depth and the question and key at the row's end, laid out by
`passkey_sample` exactly as the `[passkey]` evaluation lays out its samples. Needles are spread over the whole row,
so with `model.nsa.window_size` well below `data.seq_len` most lie beyond the window from the question (9 in 10
in recipes/retrieval_nsa.toml): only attention that reaches past the window can recall their keys. The loss covers
every token, filler included (language modelling teaches the copying that retrieval builds on).

The eval split is the held-out text itself, without needles: `eval/loss` is language modelling, and the `[passkey]`
evaluation, which draws its haystacks from that split, scores retrieval on text never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nsa_training.config import ConfigError
from nsa_training.loaders import Batch, PackedLoader
from nsa_training.passkey import NEEDLE, QUESTION, passkey_sample

# Keys of 1 to MAX_KEY_DIGITS random digits: every `passkey.key_digits` the evaluation may ask for (at most 18).
MAX_KEY_DIGITS = 18


class PasskeyLoader:
    """Endless (inputs, labels) batches [batch_size, seq_len] of passkey rows (module docstring) over `filler`'s
    windows of seq_len+1 tokens. Row i of batch k draws its key and depth from the generator seeded (seed, k): the
    rows depend only on the seed, the filler's documents and the batch counter, so that the state (the filler's and
    the counter) resumes exactly."""

    def __init__(self, filler: PackedLoader, seq_len: int, seed: Sequence[int]):
        self.tokenizer = filler.tokenizer
        self._filler, self._seq_len = filler, seq_len
        self._seed = [int(s) for s in seed]
        self._batches = 0
        longest = sum(len(self.tokenizer.encode(text.format(key="9" * MAX_KEY_DIGITS)))
                      for text in (NEEDLE, QUESTION, "{key}"))
        if longest > seq_len:
            raise ConfigError(f"data.seq_len = {seq_len}: data.source = 'passkey' needs rows of at least {longest} "
                              "tokens (needle, question and the longest key): raise data.seq_len")

    def __iter__(self) -> PasskeyLoader:
        return self

    def __next__(self) -> Batch:
        inputs, labels = next(self._filler)
        rng = np.random.default_rng([*self._seed, self._batches])
        self._batches += 1
        rows = []
        for window in torch.cat([inputs, labels[:, -1:]], dim=1).tolist():  # each row's seq_len+1 filler tokens
            key = "".join(map(str, rng.integers(0, 10, rng.integers(1, MAX_KEY_DIGITS + 1))))
            rows.append(passkey_sample(self.tokenizer, window, self._seq_len, float(rng.random()), key)[0])
        rows = torch.tensor(rows, dtype=torch.long)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"filler": self._filler.state_dict(), "batches": self._batches}

    def load_state_dict(self, state: dict) -> None:
        self._filler.load_state_dict(state["filler"])
        self._batches = state["batches"]
