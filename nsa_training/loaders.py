"""Token batch loaders: documents -> tokens + EOS -> packed windows of seq_len+1 tokens (`PackedLoader`), whole
documents with their starts (`DocumentLoader`), or seeded random tokens (`SyntheticLoader`). Each runs forever over
epochs and resumes exactly from `state_dict()`. `nsa_training.data.build_data_loader` picks one for a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol

import numpy as np
import torch

from nsa_training.tokenizer import Tokenizer

Split = Literal["train", "eval"]
Batch = tuple[torch.Tensor, ...]
IGNORE_INDEX = -100  # the label of padding tokens: the loss skips it (F.cross_entropy's default ignore_index)


class DocumentSource(Protocol):
    """Endless iterator of document texts that resumes from its `state_dict()` (`nsa_training.documents`)."""

    def __next__(self) -> str: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TokenBatchLoader(Protocol):
    """Endless iterator of (inputs, labels) LongTensors [batch_size, seq_len]; labels are inputs shifted by one.
    With `data.document_mask`: (inputs, labels, doc_start), see `DocumentLoader`."""

    tokenizer: Tokenizer

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class PackedLoader:
    """Tokenizes documents, appends EOS, concatenates them and cuts batch_size non-overlapping windows per batch.

    The state is the document stream's position and the tokens read but not yet batched; restoring it yields
    exactly the batches that would have come next.
    """

    def __init__(self, documents: DocumentSource, tokenizer: Tokenizer, seq_len: int, batch_size: int):
        self.tokenizer = tokenizer
        self._documents = documents
        self._seq_len, self._batch_size = seq_len, batch_size
        self._tokens = torch.empty(0, dtype=torch.long)  # read, not yet batched

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        needed = self._batch_size * (self._seq_len + 1)
        chunks, available = [self._tokens], len(self._tokens)
        while available < needed:
            chunks.append(self._read_document())
            available += len(chunks[-1])
        tokens = torch.cat(chunks)
        self._tokens = tokens[needed:]
        windows = tokens[:needed].view(self._batch_size, self._seq_len + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _read_document(self) -> torch.Tensor:
        """The next document's token ids, EOS appended."""
        ids = self.tokenizer.encode(next(self._documents))
        ids.append(self.tokenizer.eos_id)
        return torch.tensor(ids, dtype=torch.long)

    def state_dict(self) -> dict:
        # A clone of the tokens: the view would pickle the whole concatenation.
        return {**self._documents.state_dict(), "tokens": self._tokens.clone()}

    def load_state_dict(self, state: dict) -> None:
        self._tokens = state["tokens"].clone()
        self._documents.load_state_dict(state)


class DocumentLoader(PackedLoader):
    """Packs whole documents for `data.document_mask`: (inputs, labels, doc_start) with doc_start int32
    [batch_size, seq_len] the position of each token's document's first token in its row.

    A document of n tokens (EOS included) gives n-1 (input, label) pairs, as the same tokens alone would. Each
    starts at a multiple of `align` (the first at position 0); the gap before it is padding: input EOS, label
    IGNORE_INDEX, doc_start that of the document before (so doc_start never decreases and padding never reaches a
    later document). A document longer than the rest of its row continues at the start of the next row as a new
    document. The state is the document stream's position and the tokens of the document being placed.
    """

    def __init__(self, documents: DocumentSource, tokenizer: Tokenizer, seq_len: int, batch_size: int, align: int):
        super().__init__(documents, tokenizer, seq_len, batch_size)
        self._align = align

    def __next__(self) -> Batch:
        shape, T = (self._batch_size, self._seq_len), self._seq_len
        inputs = torch.full(shape, self.tokenizer.eos_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        doc_start = torch.zeros(shape, dtype=torch.int32)
        for row in range(self._batch_size):
            pos = 0
            while pos < T:
                if len(self._tokens) < 2:  # the document is placed (its last token was a label): the next one
                    self._tokens = self._read_document()
                n = min(len(self._tokens) - 1, T - pos)  # (input, label) pairs placed in this row
                inputs[row, pos:pos + n] = self._tokens[:n]
                labels[row, pos:pos + n] = self._tokens[1:n + 1]
                self._tokens = self._tokens[n:]  # its first token: the next input (or the last label)
                end = -(-(pos + n) // self._align) * self._align  # the next document's start
                doc_start[row, pos:end] = pos  # the document and the padding after it
                pos = end
        return inputs, labels, doc_start


class SyntheticLoader:
    """Uniform random token ids. Sample k of the global stream depends only on (seed, split, k), and rank r of
    W takes samples [(i*W + r)*b, (i*W + r + 1)*b) for its batch i: the global batch of a step is the same for
    any number of ranks (so 1-rank and N-rank runs can be compared loss for loss). State: the batch counter."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: tuple[int, ...], dp_rank: int,
                 dp_world_size: int):
        self.tokenizer = tokenizer
        self._seq_len, self._batch_size = seq_len, batch_size
        self._seed = [int(s) for s in seed]
        self._rank, self._world = dp_rank, dp_world_size
        self._step = 0

    def __iter__(self) -> SyntheticLoader:
        return self

    def __next__(self) -> Batch:
        first = (self._step * self._world + self._rank) * self._batch_size
        self._step += 1
        windows = torch.from_numpy(np.stack([
            np.random.default_rng(self._seed + [k]).integers(0, self.tokenizer.vocab_size, self._seq_len + 1)
            for k in range(first, first + self._batch_size)]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"step": self._step}

    def load_state_dict(self, state: dict) -> None:
        self._step = state["step"]
