"""Build the embedded corpus `nsa_training/corpus/python_docs.jsonl.gz` (the `data.source = "embedded"` data).

Real English prose that ships with Python, so that a first training run needs no download: the language-reference
topics of `pydoc_data.topics`, every docstring of the standard library (modules, classes, functions, methods,
properties) and the prose comment blocks of its sources; one document per topic, docstring or comment block,
written as gzip-compressed jsonl `{"text": ...}`. Test suites are left out. Python sources are parsed, never
imported (no side effects from `antigravity`, `this`, `turtle`...); only compiled modules (`builtins`, `math`,
`_io`...) are imported, to read their docstrings.

Offline and reproducible for a given Python version: documents are deduplicated and sorted, and the gzip header
carries no time or file name. The committed file (built with Python 3.11.7, ~3 MB of text) is the one training
uses; rerun this script only to refresh it:

    python scripts/build_corpus.py
"""

from __future__ import annotations

import ast
import gzip
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import sys
import sysconfig
import tokenize
from pathlib import Path
from pydoc_data.topics import topics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nsa_training.documents import EMBEDDED_CORPUS  # noqa: E402

OUTPUT = EMBEDDED_CORPUS  # where data.source = "embedded" reads it
TEST_DIRS = {"test", "tests", "idle_test", "site-packages"}  # test suites (and third-party packages)
MIN_CHARS = 60  # one-liners such as "Return self+value." add no prose
MIN_PROSE_SHARE = 0.85  # letters and spaces in a comment block; lower is commented-out code or a table


def source_texts(path: Path) -> list[str]:
    """Docstrings and prose comment blocks (runs of whole-line `#` comments, joined) of one source file."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    docs = [ast.get_docstring(node) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    blocks, lines, previous_row = [], [], -1
    with tokenize.open(path) as source:
        for token in tokenize.generate_tokens(source.readline):
            if token.type != tokenize.COMMENT or not token.line.lstrip().startswith("#") or token.string[:2] == "#!":
                continue  # trailing comments annotate code; `#!` lines are shebangs
            if token.start[0] != previous_row + 1:
                blocks.append(" ".join(lines))
                lines = []
            lines.append(token.string.lstrip("#").strip())
            previous_row = token.start[0]
    blocks.append(" ".join(lines))
    prose = [block for block in blocks if sum(c.isalpha() or c == " " for c in block) >= MIN_PROSE_SHARE * len(block)]
    return [doc for doc in docs if doc] + prose


def compiled_docstrings(namespace, defined_in: str) -> list[str]:
    """Docstrings of a compiled module or class and of its classes, routines and properties, recursively.

    Classes and routines count only where defined in `defined_in`, so that re-exports are not visited twice.
    """
    docs = [namespace.__doc__]
    for _, member in sorted(vars(namespace).items()):
        if inspect.isclass(member) and member.__module__ == defined_in and member is not namespace:
            docs += compiled_docstrings(member, defined_in)
        elif inspect.isroutine(member) or inspect.isdatadescriptor(member):
            docs.append(member.__doc__)
    return [inspect.cleandoc(doc) for doc in docs if isinstance(doc, str)]


def is_compiled(name: str) -> bool:
    """A built-in or extension module: docstrings only readable by importing it."""
    spec = importlib.util.find_spec(name)
    extension = importlib.machinery.ExtensionFileLoader
    return spec is not None and (spec.origin == "built-in" or isinstance(spec.loader, extension))


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = list(topics.values())
    for path in sorted(stdlib.rglob("*.py")):
        if not TEST_DIRS & set(path.relative_to(stdlib).parts):
            texts += source_texts(path)
    for name in sorted(sys.stdlib_module_names):
        if is_compiled(name):
            try:
                module = importlib.import_module(name)
            except ImportError:  # built without its system library (_tkinter, _curses, ...)
                continue
            texts += compiled_docstrings(module, name)
    documents = sorted({text.strip() for text in texts if len(text.strip()) >= MIN_CHARS})
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUTPUT, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
        for text in documents:
            out.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode())
    n_chars = sum(map(len, documents))
    print(f"{OUTPUT}: {len(documents)} documents, {n_chars / 1e6:.2f} M characters, "
          f"{OUTPUT.stat().st_size / 1e6:.2f} MB compressed")


if __name__ == "__main__":
    main()
