"""Token batches for training and evaluation: documents -> tokens + EOS -> packed windows of seq_len+1 tokens.

`data.source` picks the documents:
- `embedded`: the Python-docs corpus shipped in `nsa_training/corpus/` (built by `scripts/build_corpus.py`);
- `synthetic`: seeded random token ids, no documents at all (benchmarks);
- a local .jsonl/.json/.parquet/.txt file, or a folder of them (all, sorted; .txt gives one document per line);
- `hf://NAME`: a hub dataset, streamed.

Evaluation reads `data.eval_split`, or else every round(1/eval_fraction)-th document (never trained on). Each
data-parallel rank reads its own documents (`split_dataset_by_node`); training reshuffles local documents every
epoch with the run's seed (hub streams are read in order: a shuffle buffer could not be resumed exactly).
Loaders run forever over epochs and resume exactly from `state_dict()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, Protocol

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node

from nsa_training.config import ConfigError, DataConfig
from nsa_training.tokenizer import Tokenizer, build_tokenizer

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "python_docs.jsonl.gz"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # extension -> datasets builder

Split = Literal["train", "eval"]
Batch = tuple[torch.Tensor, torch.Tensor]


class TokenBatchLoader(Protocol):
    """Endless iterator of (inputs, labels) LongTensors [batch_size, seq_len]; labels are inputs shifted by one."""

    tokenizer: Tokenizer

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def build_data_loader(cfg: DataConfig, *, split: Split, batch_size: int, dp_rank: int, dp_world_size: int,
                      seed: int) -> TokenBatchLoader:
    """The loader of this data-parallel rank for `split`; `seed` fixes the document order (or the random tokens)."""
    if cfg.seq_len < 1:
        raise ConfigError(f"data.seq_len: {cfg.seq_len} is not a sequence length; set a positive value")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.source == "synthetic":
        return SyntheticLoader(tokenizer, cfg.seq_len, batch_size, seed=(seed, split == "eval"), dp_rank=dp_rank,
                               dp_world_size=dp_world_size)
    documents = _held_out(_load_documents(cfg, split), cfg, split)
    where = f"{split} split of data.source {cfg.source!r}"
    if isinstance(documents, datasets.Dataset) and len(documents) < dp_world_size:
        raise ConfigError(f"data.source: the {where} has {len(documents)} documents for {dp_world_size} "
                          "data-parallel ranks; use more data or a larger data.eval_fraction")

    def epoch_documents(epoch: int) -> datasets.IterableDataset:
        epoch_docs = documents
        if split == "train" and isinstance(epoch_docs, datasets.Dataset):  # a new order every epoch
            epoch_docs = epoch_docs.shuffle(generator=np.random.default_rng([seed, epoch]), keep_in_memory=True)
        epoch_docs = split_dataset_by_node(epoch_docs, rank=dp_rank, world_size=dp_world_size)
        return epoch_docs.to_iterable_dataset() if isinstance(epoch_docs, datasets.Dataset) else epoch_docs

    return PackedLoader(epoch_documents, cfg.text_field, tokenizer, cfg.seq_len, batch_size,
                        where=f"{where} on rank {dp_rank} of {dp_world_size}")


def _load_documents(cfg: DataConfig, split: Split) -> datasets.Dataset | datasets.IterableDataset:
    """Every document of the split that `split` reads, checked for the text column."""
    split_name = cfg.eval_split if split == "eval" and cfg.eval_split else cfg.split
    if cfg.source.startswith("hf://"):
        name = cfg.source.removeprefix("hf://")
        try:
            documents = datasets.load_dataset(name, cfg.hf_config or None, split=split_name, streaming=True)
        except (FileNotFoundError, ValueError, ConnectionError) as error:
            raise ConfigError(f"data.source: cannot stream hub dataset {name!r} (data.hf_config {cfg.hf_config!r}, "
                              f"split {split_name!r}): {error}; check the name, config, split and network") from error
    else:
        if split_name != "train":
            key = "data.eval_split" if split == "eval" else "data.split"
            raise ConfigError(f"{key}: a local source has the single split `train`, not {split_name!r}; "
                              "leave data.split = 'train' and data.eval_split empty (eval_fraction holds out data)")
        builder, files = ("json", [str(EMBEDDED_CORPUS)]) if cfg.source == "embedded" else _local_files(cfg.source)
        try:
            documents = datasets.load_dataset(builder, data_files=files, split="train")
        except datasets.exceptions.DatasetGenerationError as error:
            raise ConfigError(f"data.source: cannot read {cfg.source!r} as {builder} ({error.__cause__}); "
                              "fix the file(s) or point data.source elsewhere") from error
    _check_text_field(documents, cfg)
    return documents


def _local_files(source: str) -> tuple[str, list[str]]:
    """The datasets builder and the files of a local source (a file, or every data file under a folder)."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data.source: {source!r} is not embedded, synthetic, hf://NAME, or an existing file or "
                          "folder; fix the path")
    files = sorted(p for p in path.rglob("*") if p.suffix in BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"data.source: folder {source!r} holds no {'/'.join(BUILDERS)} files; "
                          "add some or fix the path")
    builders = {BUILDERS.get(f.suffix) for f in files}
    if None in builders:
        raise ConfigError(f"data.source: {source!r} is not a {'/'.join(BUILDERS)} file; convert it or fix the path")
    if len(builders) > 1:
        suffixes = ", ".join(sorted({f.suffix for f in files}))
        raise ConfigError(f"data.source: folder {source!r} mixes file types ({suffixes}); keep one type per folder")
    files = [f for f in files if f.stat().st_size > 0]  # datasets' json builder fails on an empty first file
    if not files:
        raise ConfigError(f"data.source: {source!r} has no documents; point it at non-empty data")
    return builders.pop(), [str(f) for f in files]


def _check_text_field(documents: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig) -> None:
    """The first document exists and has the text column (streams have no column list before reading)."""
    first = next(iter(documents.take(1) if isinstance(documents, datasets.IterableDataset) else documents), None)
    if first is None:
        raise ConfigError(f"data.source: {cfg.source!r} has no documents; point it at non-empty data")
    if cfg.text_field not in first:
        raise ConfigError(f"data.text_field: no column {cfg.text_field!r} in {cfg.source!r} (columns: "
                          f"{', '.join(first)}); set data.text_field to the column holding the text")


def _held_out(documents: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig, split: Split):
    """Without an eval split, every k-th document (k = round(1/eval_fraction)) is evaluation-only."""
    if cfg.eval_split:
        return documents
    if not 0 < cfg.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction: {cfg.eval_fraction} is not a share of the documents; "
                          "set 0 < eval_fraction < 1 or name a data.eval_split")
    every = round(1 / cfg.eval_fraction)
    is_eval = split == "eval"
    if isinstance(documents, datasets.IterableDataset):
        return documents.filter(lambda _, index: (index % every == 0) == is_eval, with_indices=True)
    kept = np.flatnonzero((np.arange(len(documents)) % every == 0) == is_eval)
    return documents.select(kept, keep_in_memory=True)


class PackedLoader:
    """Tokenizes documents, appends EOS, concatenates them and cuts batch_size non-overlapping windows per batch.

    The state is the epoch, datasets' own position in that epoch's documents, and the tokens read but not yet
    batched; restoring it yields exactly the batches that would have come next.
    """

    def __init__(self, epoch_documents: Callable[[int], datasets.IterableDataset], text_field: str,
                 tokenizer: Tokenizer, seq_len: int, batch_size: int, where: str):
        self.tokenizer = tokenizer
        self._epoch_documents = epoch_documents  # epoch -> this rank's documents for that epoch
        self._text_field, self._seq_len, self._batch_size, self._where = text_field, seq_len, batch_size, where
        self._epoch = 0
        self._documents: datasets.IterableDataset | None = None  # the current epoch's, once reading started
        self._document_iter: Iterator[dict] | None = None
        self._tokens = torch.empty(0, dtype=torch.long)  # read, not yet batched

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        needed = self._batch_size * (self._seq_len + 1)
        chunks, available = [self._tokens], len(self._tokens)
        while available < needed:
            ids = self.tokenizer.encode(self._next_text())
            ids.append(self.tokenizer.eos_id)
            chunks.append(torch.tensor(ids, dtype=torch.long))
            available += len(ids)
        tokens = torch.cat(chunks)
        self._tokens = tokens[needed:]
        windows = tokens[:needed].view(self._batch_size, self._seq_len + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _next_text(self) -> str:
        while True:
            fresh_epoch = self._document_iter is None
            if fresh_epoch:
                self._open_epoch(state=None)
            for document in self._document_iter:
                if text := document[self._text_field]:  # skips empty lines of .txt and null cells
                    return text
            if fresh_epoch:  # a whole epoch without text: it would loop forever
                raise ConfigError(f"data.source: the {self._where} has no non-empty documents; "
                                  "use more data, fewer ranks, or a larger data.eval_fraction")
            self._epoch += 1
            self._documents = self._document_iter = None

    def _open_epoch(self, state: dict | None) -> None:
        self._documents = self._epoch_documents(self._epoch)
        if state is not None:
            self._documents.load_state_dict(state)
        self._document_iter = iter(self._documents)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "documents": None if self._documents is None else self._documents.state_dict(),
            "tokens": self._tokens.clone(),  # a clone: the view would pickle the whole concatenation
        }

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state["epoch"]
        self._tokens = state["tokens"].clone()
        self._documents = self._document_iter = None
        if state["documents"] is not None:
            self._open_epoch(state["documents"])


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
