"""tokenfeed's neutral core: what every part shares, importing none of the parts.

    errors      the error tree and its status-code names
    dtypes      token dtypes: names, numpy types, the narrowest dtype for a vocabulary
    atomic      crash-safe file writes (temporary name, fsync, rename)
    store       the token store format: meta.json, chunks, reader, writer
    request     SamplingSpec, the one spelling of a sampling request
    sampling    the sampling math: windows, shift, block shuffle, ranks, resume

Nothing here does network I/O or imports grpc, torch or transformers; the sampling
math does no I/O at all. See ARCHITECTURE.md for the import graph.
"""
