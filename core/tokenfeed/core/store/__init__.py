"""Token stores: the native format (meta.py), one reader interface for every served
format, the writer, and where stores live (local directories or s3://).

    meta        the native format: meta.json and chunk names (reader and writer share it)
    reader      StoreReader, the interface every format implements; TokenStore (native)
    files       a store's files: LocalFiles (a directory) or ObjectFiles (s3://prefix)
    objects     ObjectStore: S3-compatible object storage on obstore, our retry loop
    seed        the seed loader's chunk_NNNNNN/ save_to_disk folders, read in place
    megatron    Megatron-LM / NeMo PREFIX.bin + PREFIX.idx, read in place
    formats     open_store(location): which format a location holds
    writer      StoreWriter: chunks as they fill, meta.json last (locally or to s3://)

from tokenfeed.core.store import open_store, TokenStore, StoreWriter, write_store
"""

from tokenfeed.core.store.files import LocalFiles, ObjectFiles, StoreFiles, open_files
from tokenfeed.core.store.formats import FORMATS, detect, open_store
from tokenfeed.core.store.megatron import MegatronStore
from tokenfeed.core.store.meta import (
    DEFAULT_TOKENS_PER_CHUNK,
    FORMAT_VERSION,
    META_NAME,
    Chunk,
    StoreMeta,
    checksum,
    chunk_name,
)
from tokenfeed.core.store.objects import is_url
from tokenfeed.core.store.reader import StoreReader, TokenStore, is_complete, iter_tokens
from tokenfeed.core.store.seed import SeedStore
from tokenfeed.core.store.writer import StoreWriter, write_meta, write_store

__all__ = [
    "DEFAULT_TOKENS_PER_CHUNK",
    "FORMATS",
    "FORMAT_VERSION",
    "META_NAME",
    "Chunk",
    "LocalFiles",
    "MegatronStore",
    "ObjectFiles",
    "SeedStore",
    "StoreFiles",
    "StoreMeta",
    "StoreReader",
    "StoreWriter",
    "TokenStore",
    "checksum",
    "chunk_name",
    "detect",
    "is_complete",
    "is_url",
    "iter_tokens",
    "open_files",
    "open_store",
    "write_meta",
    "write_store",
]
