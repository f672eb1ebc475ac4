"""Data pipeline: tokenizers, sources, packing, hold-out, sharding, exact resume, and bad-input errors."""

import json
import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets reads its config

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from nsa_training.config import ConfigError, DataConfig  # noqa: E402
from nsa_training.data import build_data_loader  # noqa: E402
from nsa_training.tokenizer import build_tokenizer  # noqa: E402

DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) + "é€" * (i % 3) for i in range(40)]  # unique, some UTF-8
EVAL_DOCS, TRAIN_DOCS = DOCS[0::4], [d for i, d in enumerate(DOCS) if i % 4]  # eval_fraction 0.25 below
EOS = 256
REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH = 15, 2


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def make_loader(source, part="train", rank=0, world=1, seed=0, batch_size=BATCH, **overrides):
    cfg = DataConfig(**{"source": str(source), "seq_len": SEQ_LEN, "eval_fraction": 0.25, **overrides})
    return build_data_loader(cfg, split=part, batch_size=batch_size, dp_rank=rank, dp_world_size=world, seed=seed)


def windows(batch, seq_len=SEQ_LEN) -> torch.Tensor:
    inputs, labels = batch
    assert inputs.dtype == labels.dtype == torch.long
    assert inputs.shape == labels.shape and inputs.shape[1] == seq_len
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    return torch.cat([inputs[:, :1], labels], dim=1)


def read_documents(loader, n_docs: int) -> list[str]:
    """The first n_docs documents of a byte-tokenized loader's packed stream."""
    stream = []
    while stream.count(EOS) < n_docs:
        stream += windows(next(loader)).flatten().tolist()
    text = bytes(0 if i == EOS else i for i in stream).decode("utf-8", errors="replace")
    return text.split("\0")[:n_docs]


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "docs.jsonl", DOCS)


def bpe_file(tmp_path, special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS * 3, trainer)
    path = tmp_path / f"bpe_{len(special_tokens)}.json"
    tokenizer.save(str(path))
    return path


def test_byte_tokenizer_round_trip():
    tokenizer = build_tokenizer("byte")
    text = "Hello, wörld — ∑ 日本 🙂\n"
    ids = tokenizer.encode(text)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (257, 256)
    assert ids == list(text.encode()) and max(ids) < 256
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == text


def test_tokenizers_file(tmp_path):
    path = bpe_file(tmp_path, ["<pad>", "<|endoftext|>"])
    tokenizer = build_tokenizer(str(path))
    assert tokenizer.eos_id == 1 and 256 < tokenizer.vocab_size <= 320
    text = "document 7: lorem ipsum é€"
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_packing_matches_independent_construction(jsonl, tmp_path, tokenizer):
    spec = "byte" if tokenizer == "byte" else str(bpe_file(tmp_path, ["<|endoftext|>"]))
    reference = build_tokenizer(spec)
    one_epoch = [i for doc in EVAL_DOCS for i in reference.encode(doc) + [reference.eos_id]]
    stream = one_epoch * 4  # eval reads its documents in order, epoch after epoch
    n_batches = 3 * len(one_epoch) // (3 * (SEQ_LEN + 1))  # about three epochs: crosses two epoch boundaries
    loader = make_loader(jsonl, part="eval", tokenizer=spec, batch_size=3)
    assert loader.tokenizer.vocab_size == reference.vocab_size
    for b in range(n_batches):
        expected = torch.tensor(stream[b * 3 * (SEQ_LEN + 1):(b + 1) * 3 * (SEQ_LEN + 1)]).view(3, SEQ_LEN + 1)
        assert torch.equal(windows(next(loader)), expected), f"batch {b}"


def test_train_reads_every_document_once_per_epoch_in_a_seeded_order(jsonl):
    two_epochs = read_documents(make_loader(jsonl, seed=3), 2 * len(TRAIN_DOCS))
    first, second = two_epochs[:len(TRAIN_DOCS)], two_epochs[len(TRAIN_DOCS):]
    assert sorted(first) == sorted(second) == sorted(TRAIN_DOCS)
    assert first != second and first != TRAIN_DOCS  # reshuffled each epoch
    assert read_documents(make_loader(jsonl, seed=3), len(TRAIN_DOCS)) == first
    assert read_documents(make_loader(jsonl, seed=4), len(TRAIN_DOCS)) != first


def local_source(tmp_path, kind):
    """A local source in the given format holding DOCS; returns (source, extra config, rows in document order)."""
    if kind == "jsonl":
        return write_jsonl(tmp_path / "docs.jsonl", DOCS), {}, DOCS
    if kind == "json":  # one JSON array
        (tmp_path / "docs.json").write_text(json.dumps([{"text": d, "n": i} for i, d in enumerate(DOCS)]))
        return tmp_path / "docs.json", {}, DOCS
    if kind == "parquet":
        pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "docs.parquet")
        return tmp_path / "docs.parquet", {"text_field": "body"}, DOCS
    if kind == "txt":  # one document per line; blank lines are read but hold no document
        rows = [line for doc in DOCS for line in (doc, "")][:-1]
        (tmp_path / "docs.txt").write_text("\n".join(rows) + "\n", encoding="utf-8")
        return tmp_path / "docs.txt", {}, rows
    (tmp_path / "corpus" / "part2").mkdir(parents=True)  # a folder: data files sorted by path, others ignored
    write_jsonl(tmp_path / "corpus" / "part2" / "b.jsonl", DOCS[25:])
    write_jsonl(tmp_path / "corpus" / "a.jsonl", DOCS[:25])
    (tmp_path / "corpus" / "README.md").write_text("not data")
    return tmp_path / "corpus", {}, DOCS


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "txt", "folder"])
def test_local_sources_split_into_disjoint_train_and_eval(tmp_path, kind):
    source, overrides, rows = local_source(tmp_path, kind)
    eval_docs = [row for row in rows[0::4] if row]
    train_docs = [row for i, row in enumerate(rows) if i % 4 and row]
    got_eval = read_documents(make_loader(source, part="eval", **overrides), len(eval_docs) + 1)
    got_train = read_documents(make_loader(source, **overrides), len(train_docs))
    assert got_eval == eval_docs + eval_docs[:1]  # in order, then the next epoch
    assert Counter(got_train) == Counter(train_docs)
    assert not set(got_train) & set(got_eval)


def test_embedded_corpus_is_real_text():
    loader = make_loader("embedded", seq_len=256, batch_size=8)
    assert loader.tokenizer.vocab_size == 257
    text = "".join(loader.tokenizer.decode(windows(next(loader), 256).flatten().tolist()) for _ in range(20))
    assert len(text) > 35_000
    assert sum(c.isascii() for c in text) > 0.99 * len(text)
    assert sum(c.isalpha() or c == " " for c in text) > 0.75 * len(text)
    assert len(set(re.findall(r"[a-z]{3,}", text.lower()))) > 1000
    assert {"the", "return", "function", "object"} <= set(text.lower().split())


@pytest.fixture
def hub_stream(monkeypatch, jsonl):
    """`hf://local` streams the jsonl fixture, so the hub (IterableDataset) code path runs offline."""
    load_dataset = datasets.load_dataset

    def fake_load_dataset(name, config=None, *, split, streaming):
        assert name == "local" and streaming
        return load_dataset("json", data_files=str(jsonl), split=split, streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return "hf://local"


@pytest.mark.parametrize("kind", ["jsonl", "hub"])
def test_ranks_read_disjoint_documents(request, jsonl, kind):
    source = request.getfixturevalue("hub_stream") if kind == "hub" else jsonl
    for split, docs in [("train", TRAIN_DOCS), ("eval", EVAL_DOCS)]:
        per_rank = [read_documents(make_loader(source, part=split, rank=r, world=2), len(docs) // 2)
                    for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == sorted(docs)


def test_hub_stream_holds_out_eval_documents(hub_stream):
    assert read_documents(make_loader(hub_stream, part="eval"), len(EVAL_DOCS)) == EVAL_DOCS
    assert read_documents(make_loader(hub_stream), len(TRAIN_DOCS) + 1) == TRAIN_DOCS + TRAIN_DOCS[:1]


BATCHES_PER_EPOCH = sum(len(d.encode()) + 1 for d in TRAIN_DOCS) // (BATCH * (SEQ_LEN + 1))


@pytest.mark.parametrize("kind", ["jsonl", "hub", "synthetic"])
@pytest.mark.parametrize("k", [0, 5, BATCHES_PER_EPOCH - 1, BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 1])
def test_resume_yields_exactly_the_next_batches(request, jsonl, kind, k):
    source = {"jsonl": jsonl, "synthetic": "synthetic"}.get(kind) or request.getfixturevalue("hub_stream")
    original = make_loader(source, seed=7)
    for _ in range(k):
        next(original)
    state = pickle.loads(pickle.dumps(original.state_dict()))
    resumed = make_loader(source, seed=7)
    resumed.load_state_dict(state)
    for step in range(4):  # k near BATCHES_PER_EPOCH: the next batches cross into the next epoch
        assert torch.equal(windows(next(resumed)), windows(next(original))), f"batch {k + step}"


def test_synthetic_tokens_are_seeded_per_rank_and_split():
    def first(**kwargs):
        return windows(next(make_loader("synthetic", batch_size=4, **kwargs)))

    tokens = first()
    assert 0 <= tokens.min() and tokens.max() < 257 and len(tokens.unique()) > 40
    assert torch.equal(first(), tokens)
    for other in [first(seed=1), first(rank=1, world=2), first(part="eval")]:
        assert not torch.equal(other, tokens)


def test_synthetic_global_batch_does_not_depend_on_the_rank_count():
    single = make_loader("synthetic", batch_size=2)
    ranks = [make_loader("synthetic", batch_size=2, rank=r, world=2) for r in range(2)]
    for _ in range(3):  # one step of 2 ranks x 1 micro-batch = one step of 1 rank x 2 micro-batches
        together = torch.cat([windows(next(single)), windows(next(single))])
        assert torch.equal(torch.cat([windows(next(loader)) for loader in ranks]), together)


def bad_source(tmp_path, case):
    if case == "missing":
        return tmp_path / "nope.jsonl"
    if case == "csv":
        (tmp_path / "data.csv").write_text("text\nhello\n")
        return tmp_path / "data.csv"
    if case == "empty_folder":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if case == "mixed_folder":
        (tmp_path / "mixed").mkdir()
        write_jsonl(tmp_path / "mixed" / "a.jsonl", DOCS)
        (tmp_path / "mixed" / "b.txt").write_text("hello\n")
        return tmp_path / "mixed"
    if case == "empty_file":
        return write_jsonl(tmp_path / "empty.jsonl", [])
    if case == "blank_txt":
        (tmp_path / "blank.txt").write_text("\n\n\n\n\n\n\n\n")
        return tmp_path / "blank.txt"
    if case == "blank_jsonl":
        (tmp_path / "blank.jsonl").write_text("\n \n\t\n" * 3)
        return tmp_path / "blank.jsonl"
    if case in ("random_parquet", "random_jsonl"):
        path = tmp_path / f"random.{case.removeprefix('random_')}"
        path.write_bytes(bytes(range(256)) * 16)
        return path
    if case == "not_utf8_txt":
        (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
        return tmp_path / "latin1.txt"
    if case == "folder_of_folders":  # names that look like data files but are folders
        (tmp_path / "corpus" / "a.jsonl").mkdir(parents=True)
        return tmp_path / "corpus"
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    return tmp_path / "broken.jsonl"


@pytest.mark.parametrize("case, says", [
    ("missing", "is not embedded, synthetic, hf://NAME, or an existing file or folder"),
    ("csv", "is not a .jsonl/.json/.parquet/.txt file"), ("empty_folder", "holds no .jsonl/.json/.parquet/.txt files"),
    ("mixed_folder", "mixes file types"), ("empty_file", "has no documents"), ("blank_txt", "has no documents"),
    ("blank_jsonl", "has no documents"), ("random_parquet", "cannot read .* \\(ArrowInvalid: "),
    ("random_jsonl", "cannot read .* \\(ArrowInvalid: JSON parse error"),
    ("not_utf8_txt", "cannot read .* \\(UnicodeDecodeError: "), ("folder_of_folders", "holds no .jsonl"),
    ("broken", "cannot read .* \\(ArrowInvalid: JSON parse error"),
])
def test_bad_source_names_data_source(tmp_path, case, says):
    with pytest.raises(ConfigError, match=rf"^data\.source: .*{says}") as error:
        next(make_loader(bad_source(tmp_path, case)))
    assert "\n" not in str(error.value)


def test_train_py_reports_unreadable_data_in_one_line(tmp_path):
    """Nothing but the one line: datasets' own error log ("Failed to load JSON from file ...") is dropped."""
    result = subprocess.run([sys.executable, "train.py", "recipes/debug.toml", "--job.run_dir", str(tmp_path / "run"),
                             "--data.source", str(bad_source(tmp_path, "broken"))], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2
    one_line = r"error: data\.source: cannot read [^\n]* \(ArrowInvalid: [^\n]*\n"
    assert re.fullmatch(one_line, result.stderr), result.stderr


@pytest.mark.parametrize("values", [[5, 6, 7, 8, 9], [["a"], ["b"]] * 3, ["a", "b", "c", 4, "d", "e"],
                                    ["a", "b", "c", {"x": 1}, "d"]], ids=["int", "list", "int_later", "dict_later"])
def test_text_of_another_type_names_data_text_field(tmp_path, values):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    with pytest.raises(ConfigError, match=r"^data\.text_field: column 'text' .* holds (int|list|dict) values"):
        loader = make_loader(path)  # the first document is checked at once, later ones when read
        for _ in range(20):
            next(loader)


def test_any_failure_inside_datasets_is_one_line_naming_the_source(monkeypatch, jsonl):
    """The class, not the cases: whatever datasets raises while loading or while streaming is one line."""
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(jsonl))

    monkeypatch.setattr(datasets, "load_dataset", unreadable)
    with pytest.raises(ConfigError, match=r"^data\.source: cannot read .*PermissionError: .*Permission denied"):
        make_loader(jsonl)

    def dies_after_three(shards):
        for i in range(3):
            yield {"text": f"document {i}"}
        raise ConnectionError("Connection reset by peer\n(while reading shard 2)")

    def stream(name, config=None, *, split, streaming):
        return datasets.IterableDataset.from_generator(dies_after_three, gen_kwargs={"shards": [0]})

    monkeypatch.setattr(datasets, "load_dataset", stream)
    loader = make_loader("hf://flaky", eval_fraction=0.5)
    with pytest.raises(ConfigError, match=r"^data\.source: cannot stream hub dataset 'flaky' .*ConnectionError: "
                                          r"Connection reset by peer \(while reading shard 2\)"):
        for _ in range(20):
            next(loader)


def test_unreachable_hub_fails_at_once(monkeypatch):
    import huggingface_hub

    class NoNetwork:
        def head(self, url, timeout):
            raise ConnectionError(f"[Errno -2] Name or service not known: {url}")

    def must_not_load(*args, **kwargs):  # it would retry for ~25 s
        raise AssertionError("load_dataset called although the hub is unreachable")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_session", NoNetwork)
    monkeypatch.setattr(datasets, "load_dataset", must_not_load)
    with pytest.raises(ConfigError, match=r"^data\.source: the hub \S+ is unreachable .*HF_HUB_OFFLINE=1"):
        make_loader("hf://somebody/corpus")


def test_offline_mode_reads_the_cache_without_probing_the_hub(monkeypatch, hub_stream):
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "get_session", None)  # a probe would fail: None is not callable
    assert read_documents(make_loader(hub_stream, part="eval"), 1) == EVAL_DOCS[:1]


def test_tokenizer_file_without_the_tokenizers_package(monkeypatch, tmp_path, jsonl):
    path = bpe_file(tmp_path, ["<|endoftext|>"])
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: .* needs the `tokenizers` package.*pip install"):
        make_loader(jsonl, tokenizer=str(path))


@pytest.mark.parametrize("content", [b'{"model": {"type": "BPE"', b"{}", bytes(range(256))],
                         ids=["truncated", "no_model", "binary"])
def test_malformed_tokenizer_file_is_one_line(tmp_path, jsonl, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: .* is not a tokenizers JSON file") as error:
        make_loader(jsonl, tokenizer=str(path))
    assert "\n" not in str(error.value)


def test_documents_without_datasets_installed_is_one_line(monkeypatch, jsonl):
    monkeypatch.delitem(sys.modules, "nsa_training.documents", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"^data\.source '.*' needs the `datasets` package.*pip install datasets"):
        make_loader(jsonl)


def test_synthetic_run_needs_neither_datasets_nor_pyarrow(tmp_path):
    """Benchmark machines may lack them: a synthetic run must not import them (an import would raise here)."""
    script = (
        "import sys\n"
        "sys.modules['datasets'] = sys.modules['pyarrow'] = None\n"
        "import train\n"
        f"code = train.main(['recipes/debug.toml', '--job.run_dir', {str(tmp_path / 'run')!r}, '--data.source', "
        "'synthetic', '--training.steps', '1', '--lr_scheduler.warmup_steps', '0', '--training.eval_interval', '1', "
        "'--training.eval_batches', '1', '--training.global_batch_tokens', '512', '--training.micro_batch_size', '2',"
        " '--metrics.log_freq', '1'])\n"
        "train.exit_now(code)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 1 steps" in result.stdout


@pytest.mark.parametrize("overrides, key", [
    ({"text_field": "body"}, "data.text_field"),
    ({"split": "test"}, "data.split"),
    ({"tokenizer": "missing.json"}, "data.tokenizer"),
    ({"tokenizer": "NO_EOS"}, "data.tokenizer"),
    ({"tokenizer": "NOT_JSON"}, "data.tokenizer"),
])
def test_bad_setting_names_its_key(tmp_path, jsonl, overrides, key):
    if overrides.get("tokenizer") == "NO_EOS":
        overrides = {"tokenizer": str(bpe_file(tmp_path, ["<pad>"]))}
    if overrides.get("tokenizer") == "NOT_JSON":
        overrides = {"tokenizer": str(jsonl)}
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        make_loader(jsonl, **overrides)


def test_bad_eval_setting_names_its_key(jsonl):
    with pytest.raises(ConfigError, match=r"^data\.eval_split: "):
        make_loader(jsonl, part="eval", eval_split="validation")
    with pytest.raises(ConfigError, match=r"^data\.source: .* 2 documents for 4 data-parallel ranks"):
        make_loader(write_jsonl(jsonl.parent / "two.jsonl", DOCS[:8]), part="eval", rank=0, world=4)


@pytest.mark.parametrize("unit", ["line", "paragraph", "file"])
def test_a_txt_document_is_a_line_a_paragraph_or_a_file(tmp_path, unit):
    """data.txt_document: a folder of two .txt files, each of two paragraphs of two lines, read as 8 lines, 4
    paragraphs (line breaks kept) or 2 files; every document once, train and eval together."""
    books = {"a.txt": "Call me Ishmael.\nSome years ago.\n\nNever mind how long.\nPrecisely.\n",
             "b.txt": "It was the best of times.\nIt was the worst.\n\nIt was the age\nof wisdom.\n"}
    (tmp_path / "books").mkdir()
    for name, text in books.items():
        (tmp_path / "books" / name).write_text(text, encoding="utf-8")
    texts = list(books.values())
    want = {"line": [line for text in texts for line in text.split("\n") if line],
            "paragraph": [p.strip("\n") for text in texts for p in text.split("\n\n")],
            "file": [text.rstrip("\n") for text in texts]}[unit]
    got = []
    for part in ("train", "eval"):
        loader = make_loader(tmp_path / "books", part=part, txt_document=unit, eval_fraction=0.5)
        got += read_documents(loader, len(want) // 2)
    assert sorted(doc.rstrip("\n") for doc in got) == sorted(want)


def test_txt_document_on_a_source_without_txt_files_is_one_line(jsonl):
    with pytest.raises(ConfigError, match=r"^data\.txt_document = 'paragraph' cuts \.txt files, but data\.source = "
                                          r".*docs\.jsonl' holds none: set data\.txt_document = 'line'"):
        make_loader(jsonl, txt_document="paragraph")
