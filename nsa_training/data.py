"""Token batches for training and evaluation: the loader a run's `[data]` section asks for (`nsa_training.loaders`).

`data.source = "synthetic"` gives seeded random token ids and reads no documents; any other source is read by
`nsa_training.documents` (HuggingFace `datasets`, imported only then: a synthetic run needs neither it nor
pyarrow). Loaders run forever over epochs and resume exactly from `state_dict()`.

With `data.document_mask` documents are not cut anywhere: each starts at a multiple of the model's alignment
(`nsa_models.model.document_alignment`) and batches carry each token's document start (`DocumentLoader`).
"""

from __future__ import annotations

import dataclasses

from nsa_training.config import ConfigError, DataConfig
from nsa_training.loaders import DocumentLoader, PackedLoader, Split, SyntheticLoader, TokenBatchLoader
from nsa_training.passkey_data import PasskeyLoader
from nsa_training.tokenizer import build_tokenizer


def build_data_loader(cfg: DataConfig, *, split: Split, batch_size: int, dp_rank: int, dp_world_size: int,
                      seed: int, doc_align: int = 1) -> TokenBatchLoader:
    """The loader of this data-parallel rank for `split`; `seed` fixes the document order (or the random tokens).
    With `data.document_mask` documents start at multiples of `doc_align` (the model's alignment)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.source == "synthetic":
        return SyntheticLoader(tokenizer, cfg.seq_len, batch_size, seed=(seed, split == "eval"), dp_rank=dp_rank,
                               dp_world_size=dp_world_size)
    try:
        from nsa_training.documents import DocumentStream  # imports datasets and pyarrow: only runs that read documents
    except ModuleNotFoundError as error:
        if error.name is None or error.name.startswith("nsa_training"):
            raise
        raise ConfigError(f"data.source {cfg.source!r} needs the `{error.name}` package, which is not installed: "
                          "`pip install datasets`, or set data.source = 'synthetic'") from None

    passkey = cfg.source == "passkey"  # haystacks of the embedded corpus (nsa_training.passkey_data)
    documents = DocumentStream(dataclasses.replace(cfg, source="embedded") if passkey else cfg, split=split,
                               dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)
    if passkey and split == "train":  # the eval split stays plain held-out text: the [passkey] haystacks
        return PasskeyLoader(PackedLoader(documents, tokenizer, cfg.seq_len, batch_size), cfg.seq_len,
                             seed=(seed, dp_rank))
    if cfg.document_mask:
        return DocumentLoader(documents, tokenizer, cfg.seq_len, batch_size, doc_align)
    return PackedLoader(documents, tokenizer, cfg.seq_len, batch_size)
