"""Offline test material for prepare/import tests: generated corpora, tiny tokenizers,
and `prepare_argv`, the `tokenfeed prepare --files` command line.

Everything here is made on the spot (a BPE trained in milliseconds with `tokenizers`
and saved as a transformers-loadable directory), so no test reaches a hub and none
depends on the demo corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

EOS = "<eos>"


def make_documents(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """`n` documents of pseudo-English; some span several lines."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "an", "or", "el"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(150)]
    docs = []
    for _ in range(n):
        k = rng.randint(1, max_words)
        text = " ".join(rng.choices(words, k=k))
        if rng.random() < 0.3:
            text = text.replace(" ", "\n", 2)
        docs.append(text.capitalize() + ".")
    return docs


def train_tokenizer(path: Path, docs: list[str], eos: str | None = EOS, vocab: int = 300) -> Path:
    """A small byte-level BPE, saved with save_pretrained so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[eos] if eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    kwargs = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(str(path))
    return path


def sparse_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of 4 entries whose word 'big' has id 70000 (> uint16)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, "small": 1, EOS: 2, "big": 70000}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="[UNK]").save_pretrained(
        str(path)
    )
    return path


def expected_tokens(tokenizer_dir: Path, docs: list[str]) -> np.ndarray:
    """What a store of `docs` must hold: each document's ids, then EOS (empty: nothing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out: list[int] = []
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"] if doc else []
        if ids:
            out += [*ids, tok.eos_token_id]
    return np.array(out, dtype=np.int64)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path)
    return path


def store_tokens(path: Path) -> np.ndarray:
    from tokenfeed.core.store import TokenStore, iter_tokens

    store = TokenStore.open(path)
    parts = list(iter_tokens(store))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def prepare_argv(files: object, tokenizer: object, output: object, *flags: object) -> list[str]:
    """`tokenfeed prepare --files F --tokenizer T --output O FLAGS...` as CLI arguments."""
    argv = ["prepare", "--files", files, "--tokenizer", tokenizer, "--output", output, *flags]
    return [str(a) for a in argv]
