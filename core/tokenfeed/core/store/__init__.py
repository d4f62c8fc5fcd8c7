"""The token store: its format (meta.py), the reader and the writer.

from tokenfeed.core.store import TokenStore, StoreWriter, write_store
"""

from tokenfeed.core.store.meta import (
    DEFAULT_TOKENS_PER_CHUNK,
    FORMAT_VERSION,
    META_NAME,
    Chunk,
    StoreMeta,
    checksum,
    chunk_name,
)
from tokenfeed.core.store.reader import TokenStore, is_complete, iter_tokens
from tokenfeed.core.store.writer import StoreWriter, write_meta, write_store

__all__ = [
    "DEFAULT_TOKENS_PER_CHUNK",
    "FORMAT_VERSION",
    "META_NAME",
    "Chunk",
    "StoreMeta",
    "StoreWriter",
    "TokenStore",
    "checksum",
    "chunk_name",
    "is_complete",
    "iter_tokens",
    "write_meta",
    "write_store",
]
