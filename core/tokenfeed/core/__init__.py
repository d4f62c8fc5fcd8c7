"""tokenfeed's neutral core: what every part shares, importing none of the parts.

    errors      the error tree and its status-code names
    dtypes      token dtypes: names, numpy types, the narrowest dtype for a vocabulary
    atomic      crash-safe file writes (temporary name, fsync, rename)
    store       token stores: the native format (meta.json, chunks), one reader
                interface for every served format (native, seed layout, Megatron),
                the writer, and where stores live (local files or s3:// object storage)
    request     SamplingSpec, the one spelling of a sampling request
    sampling    the sampling math: windows, shift, block shuffle, ranks, resume

Nothing here imports grpc, torch or transformers. The core does file and
object-storage I/O for stores (store/files.py, store/objects.py: obstore, the `s3`
extra, imported only when an s3:// location is opened) and nothing else over the
network; the sampling math does no I/O at all. See ARCHITECTURE.md for the import graph.
"""
