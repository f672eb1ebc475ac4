"""Documents for the packed loader, read through HuggingFace `datasets` (imported only by runs that read documents).

`data.source` picks them:
- `embedded`: the Python-docs corpus shipped in `nsa_training/corpus/` (built by `scripts/build_corpus.py`);
- a local .jsonl/.json/.parquet/.txt file, or a folder of them (all, sorted; a .txt document is a line, a paragraph
  or a file: `data.txt_document`);
- `hf://NAME`: a hub dataset, streamed.

Evaluation reads `data.eval_split`, or else every round(1/eval_fraction)-th document (never trained on). Each
data-parallel rank reads its own documents (`split_dataset_by_node`); training reshuffles local documents every
epoch with the run's seed (hub streams are read in order: a shuffle buffer could not be resumed exactly).

Reading is the one boundary between this project and `datasets`, `pyarrow`, the filesystem and the hub: whatever
fails there (an empty or malformed file, bytes that are not the format the name says, an unreadable file, a text
column of another type, an unreachable hub) is one ConfigError naming `data.source` and the fix (`_reading`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets
import numpy as np
from datasets.distributed import split_dataset_by_node

from nsa_training.config import ConfigError, DataConfig
from nsa_training.loaders import Split

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "python_docs.jsonl.gz"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # extension -> datasets builder
TXT_SAMPLE_BY = {"line": "line", "paragraph": "paragraph", "file": "document"}  # data.txt_document -> datasets'
HUB_PROBE_TIMEOUT_S = 10.0  # one request to the hub endpoint before streaming: its retries would take ~25 s to fail


class DocumentStream:
    """The texts of this rank's documents of `split`, epoch after epoch; resumes exactly from `state_dict()`.

    The state is the epoch and datasets' own position in that epoch's documents.
    """

    def __init__(self, cfg: DataConfig, *, split: Split, dp_rank: int, dp_world_size: int, seed: int) -> None:
        self._cfg, self._split, self._seed = cfg, split, seed
        self._split_name = cfg.eval_split if split == "eval" and cfg.eval_split else cfg.split
        self._rank, self._world = dp_rank, dp_world_size
        self._where = f"{split} split of data.source {cfg.source!r}"
        datasets.disable_progress_bars()  # "Generating train split" bars on stderr would bury a one-line error
        with _reading(cfg, self._split_name):
            self._all = _held_out(_load_documents(cfg, split, self._split_name), cfg, split)
        if isinstance(self._all, datasets.Dataset) and len(self._all) < dp_world_size:
            raise ConfigError(f"data.source: the {self._where} has {len(self._all)} documents for {dp_world_size} "
                              "data-parallel ranks; use more data or a larger data.eval_fraction")
        self._epoch = 0
        self._documents: datasets.IterableDataset | None = None  # the current epoch's, once reading started
        self._document_iter: Iterator[dict] | None = None

    def __iter__(self) -> DocumentStream:
        return self

    def __next__(self) -> str:
        with _reading(self._cfg, self._split_name):
            return self._next_text()

    def _next_text(self) -> str:
        while True:
            fresh_epoch = self._document_iter is None
            if fresh_epoch:
                self._open_epoch(state=None)
            for document in self._document_iter:
                if text := _text(document, self._cfg):  # skips empty lines of .txt and null cells
                    return text
            if fresh_epoch:  # a whole epoch without text: it would loop forever
                raise ConfigError(f"data.source: the {self._where} on rank {self._rank} of {self._world} has no "
                                  "non-empty documents; use more data, fewer ranks, or a larger data.eval_fraction")
            self._epoch += 1
            self._documents = self._document_iter = None

    def _epoch_documents(self) -> datasets.IterableDataset:
        documents = self._all
        if self._split == "train" and isinstance(documents, datasets.Dataset):  # a new order every epoch
            documents = documents.shuffle(generator=np.random.default_rng([self._seed, self._epoch]),
                                          keep_in_memory=True)
        documents = split_dataset_by_node(documents, rank=self._rank, world_size=self._world)
        return documents.to_iterable_dataset() if isinstance(documents, datasets.Dataset) else documents

    def _open_epoch(self, state: dict | None) -> None:
        self._documents = self._epoch_documents()
        if state is not None:
            self._documents.load_state_dict(state)
        self._document_iter = iter(self._documents)

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "documents": None if self._documents is None else self._documents.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state["epoch"]
        self._documents = self._document_iter = None
        if state["documents"] is not None:
            with _reading(self._cfg, self._split_name):
                self._open_epoch(state["documents"])


@contextmanager
def _reading(cfg: DataConfig, split_name: str) -> Iterator[None]:
    """Any failure inside `datasets` (and what it calls: pyarrow, fsspec, the hub client, the OS) while reading
    `cfg.source` becomes one ConfigError line: such a failure is the data's, or the network's, not a bug here.
    datasets' own error log lines ("Failed to load JSON from file ...") are dropped: each precedes the exception
    that this line reports."""
    handlers = logging.getLogger("datasets").handlers
    for handler in handlers:
        handler.addFilter(_below_error)
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - datasets has no common base class for its failures
        if cfg.source.startswith("hf://"):
            raise ConfigError(f"data.source: cannot stream hub dataset {cfg.source.removeprefix('hf://')!r} "
                              f"(data.hf_config {cfg.hf_config!r}, split {split_name!r}): {_cause(error)}; "
                              "check the name, config, split and network") from None
        raise ConfigError(f"data.source: cannot read {cfg.source!r} ({_cause(error)}); fix the file(s) or point "
                          "data.source at other data") from None
    finally:
        for handler in handlers:
            handler.removeFilter(_below_error)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def _cause(error: BaseException) -> str:
    """The innermost explicit cause (datasets wraps the parser's error in a generic one), as one short line."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _text(document: dict, cfg: DataConfig) -> str | None:
    """The document's text (None for a null cell); a value of another type is a wrong `data.text_field`."""
    text = document[cfg.text_field]
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"data.text_field: column {cfg.text_field!r} of {cfg.source!r} holds "
                          f"{type(text).__name__} values, not text; set data.text_field to the column holding the text")
    return text


def _load_documents(cfg: DataConfig, split: Split, split_name: str) -> datasets.Dataset | datasets.IterableDataset:
    """Every document of split `split_name` (which `split` reads), checked for the text column."""
    if cfg.source.startswith("hf://"):
        _check_txt_document(cfg, "")
        _check_hub_reachable()
        documents = datasets.load_dataset(cfg.source.removeprefix("hf://"), cfg.hf_config or None, split=split_name,
                                          streaming=True)
    else:
        if split_name != "train":
            key = "data.eval_split" if split == "eval" else "data.split"
            raise ConfigError(f"{key}: a local source has the single split `train`, not {split_name!r}; "
                              "leave data.split = 'train' and data.eval_split empty (eval_fraction holds out data)")
        builder, files = ("json", [str(EMBEDDED_CORPUS)]) if cfg.source == "embedded" else _local_files(cfg.source)
        _check_txt_document(cfg, builder)
        # datasets' text builder cuts the documents: by line, by blank-line-separated paragraph, or a file each.
        text = {"sample_by": TXT_SAMPLE_BY[cfg.txt_document]} if builder == "text" else {}
        documents = datasets.load_dataset(builder, data_files=files, split="train", **text)
    _check_text_field(documents, cfg)
    return documents


def _check_txt_document(cfg: DataConfig, builder: str) -> None:
    """data.txt_document other than the default names .txt files: refuse it for a source of another kind (`builder`
    its datasets builder; "" for the hub), which would ignore it."""
    if cfg.txt_document != "line" and builder != "text":
        raise ConfigError(f"data.txt_document = {cfg.txt_document!r} cuts .txt files, but data.source = "
                          f"{cfg.source!r} holds none: set data.txt_document = 'line' (the default)")


def _check_hub_reachable() -> None:
    """Fail in seconds, not after the hub client's retries, when the hub cannot be reached (offline mode skips it:
    datasets then reads its local cache)."""
    from huggingface_hub import constants, get_session

    if datasets.config.HF_HUB_OFFLINE:
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - any transport failure (DNS, refused, timeout, proxy) means the same
        raise ConfigError(f"data.source: the hub {constants.ENDPOINT} is unreachable ({_cause(error)}); check the "
                          "network (or HF_ENDPOINT), set HF_HUB_OFFLINE=1 to read datasets' local cache, or use "
                          "local data") from None


def _local_files(source: str) -> tuple[str, list[str]]:
    """The datasets builder and the files of a local source (a file, or every data file under a folder)."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data.source: {source!r} is not embedded, synthetic, hf://NAME, or an existing file or "
                          "folder; fix the path")
    files = sorted(p for p in path.rglob("*") if p.suffix in BUILDERS and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"data.source: folder {source!r} holds no {'/'.join(BUILDERS)} files; "
                          "add some or fix the path")
    builders = {BUILDERS.get(f.suffix) for f in files}
    if None in builders:
        raise ConfigError(f"data.source: {source!r} is not a {'/'.join(BUILDERS)} file; convert it or fix the path")
    if len(builders) > 1:
        suffixes = ", ".join(sorted({f.suffix for f in files}))
        raise ConfigError(f"data.source: folder {source!r} mixes file types ({suffixes}); keep one type per folder")
    files = [f for f in files if _has_content(f)]  # datasets fails on a file without data ("no data" for the split)
    if not files:
        raise ConfigError(f"data.source: {source!r} has no documents; point it at non-empty data")
    return builders.pop(), [str(f) for f in files]


def _has_content(path: Path) -> bool:
    """Whether the file holds anything but whitespace (read up to its first other byte: usually one block)."""
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return True
    return False


def _check_text_field(documents: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig) -> None:
    """The first document exists and has the text column (streams have no column list before reading)."""
    first = next(iter(documents.take(1) if isinstance(documents, datasets.IterableDataset) else documents), None)
    if first is None:
        raise ConfigError(f"data.source: {cfg.source!r} has no documents; point it at non-empty data")
    if cfg.text_field not in first:
        raise ConfigError(f"data.text_field: no column {cfg.text_field!r} in {cfg.source!r} (columns: "
                          f"{', '.join(first)}); set data.text_field to the column holding the text")
    _text(first, cfg)


def _held_out(documents: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig, split: Split):
    """Without an eval split, every k-th document (k = round(1/eval_fraction)) is evaluation-only."""
    if cfg.eval_split:
        return documents
    every = round(1 / cfg.eval_fraction)
    is_eval = split == "eval"
    if isinstance(documents, datasets.IterableDataset):
        return documents.filter(lambda _, index: (index % every == 0) == is_eval, with_indices=True)
    kept = np.flatnonzero((np.arange(len(documents)) % every == 0) == is_eval)
    return documents.select(kept, keep_in_memory=True)
