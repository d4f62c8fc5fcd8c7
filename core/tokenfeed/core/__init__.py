"""tokenfeed's neutral core: what every part shares, importing none of the parts.

    errors      the error tree and its status-code names
    limits      the bounds a request is checked against, each defined once
    dtypes      token dtypes: names, numpy types, the narrowest dtype for a vocabulary
    atomic      crash-safe file writes (temporary name, fsync, rename)
    store       token stores: the native format (meta.json, chunks), one reader
                interface for every served format (native, seed layout, Megatron),
                the writer, and where stores live (local files or s3:// object storage)
    request     SamplingSpec, the one spelling of a sampling request
    keyed       the key chain, its domain tags, and the keyed bijection
    shuffle     a dataset epoch's order: the block shuffle
    sampling    one dataset's sampling: splits, windows, shift, ranks, rounds
    mixture     several datasets blended by weight (a package: one module per job)
    documents   document boundaries -> position ids, cu_seqlens, masked labels
    native      the one switch of the compiled loops (C, with Python references)

Nothing here imports grpc, torch or transformers. The core does file and
object-storage I/O for stores (store/files.py, store/objects.py: obstore, the `s3`
extra, imported only when an s3:// location is opened) and nothing else over the
network, and reads mixture files (mixture/files.py); the sampling math does no I/O at
all. See ARCHITECTURE.md for the import graph.
"""
