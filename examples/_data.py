"""Text, tokenizer and batches for the examples: Python's own standard library as a corpus.

The corpus is the `.py` source (code, comments and docstrings) of the running interpreter's
standard library, `sysconfig.get_paths()["stdlib"]`, without `site-packages`: it is on every
machine that runs the examples, so nothing is downloaded. Its content depends on the Python
version (and on whether the distribution ships the `test/` package), so numbers are
comparable between runs of one interpreter only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100
EOS, PAD = "<|endoftext|>", "<|pad|>"
_MAX_FILE_BYTES = 256 * 1024  # skips a few generated data files (e.g. pydoc_data/topics.py)


@dataclasses.dataclass(frozen=True)
class Document:
    """One source file of the corpus."""

    name: str
    text: str


@dataclasses.dataclass(frozen=True)
class LMData:
    """Fixed-length next-token examples: `labels[i, t]` is the token after `inputs[i, t]`.

    Padding positions hold `pad_id` in `inputs` and `IGNORE_INDEX` in `labels`.
    """

    train_inputs: np.ndarray  # [N, T] int32
    train_labels: np.ndarray  # [N, T] int32
    val_inputs: np.ndarray
    val_labels: np.ndarray
    vocab_size: int
    pad_id: int
    info: dict


def stdlib_documents(byte_budget: int, seed: int = 0) -> list[Document]:
    """A deterministic subset of the standard library's `.py` files, up to `byte_budget` bytes.

    The sorted file list is shuffled with `seed` (for a mix of modules and tests) and files are
    taken in that order while they fit in the budget. Files that are not UTF-8 are skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    docs: list[Document] = []
    used = 0
    for path in files:
        size = path.stat().st_size
        if size == 0 or size > _MAX_FILE_BYTES or used + size > byte_budget:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append(Document(str(path.relative_to(root)), text))
        used += size
    if len(docs) < 2:
        raise ValueError(f"text budget of {byte_budget} bytes selects {len(docs)} file(s); "
                         "raise it (at least two files are needed for a validation split)")
    return docs


def train_tokenizer(docs: list[Document], vocab_size: int, cache_dir: Path):
    """A byte-level BPE tokenizer trained on `docs`, cached in `cache_dir` by content hash."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    digest = hashlib.sha256(str(vocab_size).encode())
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(doc.text.encode())
    path = Path(cache_dir) / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((doc.text for doc in docs), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def pack(token_lists: list[list[int]], seq_len: int, eos_id: int,
         pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Cuts each document (plus an end-of-text token) into `seq_len`-token examples.

    No example crosses a document boundary: the last chunk of every document is padded, with
    `pad_id` as input and `IGNORE_INDEX` as label, so padded positions carry no loss.
    """
    inputs, labels = [], []
    for ids in token_lists:
        ids = np.asarray(list(ids) + [eos_id], np.int32)
        for start in range(0, len(ids) - 1, seq_len):
            chunk = ids[start:start + seq_len + 1]
            n = len(chunk) - 1
            x = np.full(seq_len, pad_id, np.int32)
            y = np.full(seq_len, IGNORE_INDEX, np.int32)
            x[:n], y[:n] = chunk[:-1], chunk[1:]
            inputs.append(x)
            labels.append(y)
    return np.stack(inputs), np.stack(labels)


def load_lm_data(*, text_bytes: int, vocab_size: int, seq_len: int, cache_dir: Path,
                 val_fraction: float = 0.1, max_val_seqs: int = 256, seed: int = 0) -> LMData:
    """Corpus -> tokenizer -> packed train/validation examples.

    The validation split holds whole documents (the last `val_fraction` of the shuffled files,
    at least one), so no validation text is seen in training; the tokenizer is trained on the
    training documents only. At most `max_val_seqs` validation examples are kept.
    """
    docs = stdlib_documents(text_bytes, seed)
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    train_docs, val_docs = docs[:-n_val], docs[-n_val:]
    tokenizer = train_tokenizer(train_docs, vocab_size, cache_dir)
    eos_id, pad_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)

    def encode(ds: list[Document]) -> list[list[int]]:
        return [enc.ids for enc in tokenizer.encode_batch([d.text for d in ds])]

    train_x, train_y = pack(encode(train_docs), seq_len, eos_id, pad_id)
    val_x, val_y = pack(encode(val_docs), seq_len, eos_id, pad_id)
    val_x, val_y = val_x[:max_val_seqs], val_y[:max_val_seqs]
    n_train_tokens = int((train_y != IGNORE_INDEX).sum())
    info = dict(
        source=f"Python {sysconfig.get_python_version()} standard library .py files "
               f"({sysconfig.get_paths()['stdlib']})",
        documents=len(docs), train_documents=len(train_docs), val_documents=len(val_docs),
        text_bytes=sum(len(d.text.encode()) for d in docs),
        vocab_size=tokenizer.get_vocab_size(), train_seqs=len(train_x), val_seqs=len(val_x),
        train_tokens=n_train_tokens,
        padding_fraction=float((train_y == IGNORE_INDEX).mean()),
        bytes_per_token=sum(len(d.text.encode()) for d in train_docs) / n_train_tokens)
    return LMData(train_x, train_y, val_x, val_y, tokenizer.get_vocab_size(), pad_id, info)


def batches(inputs: np.ndarray, labels: np.ndarray, batch_size: int,
            seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless shuffled batches, one permutation per epoch; the order depends only on `seed`."""
    rng = np.random.default_rng(seed)
    n = len(inputs)
    while True:
        if n < batch_size:
            idx = rng.integers(0, n, batch_size)
            yield inputs[idx], labels[idx]
            continue
        perm = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            yield inputs[idx], labels[idx]
