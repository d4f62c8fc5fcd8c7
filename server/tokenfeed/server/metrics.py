"""The feeder's Prometheus metrics: the one home of every server metric name.

Dashboards and alert rules (deploy/) are built on these names, so they change only
together with those. A registry is passed in (never the process-global one, which
tests would fight over). Labels carry dataset names (paths relative to the data
root), split names and a mixture's source names (dataset names too) only: no
filesystem paths, no tokens, no client addresses. What each one means:
docs/serving.md, "Metrics".

prometheus_client appends `_total` to counter names itself, so the counters below are
declared without it and exported as `tokenfeed_server_batches_sent_total` and so on.
The tests and the deploy checks read the names from a registry these classes filled,
never from a list kept by hand.

Under `--workers N` each worker process writes its values to files in a directory the
supervisor owns (prometheus_client's multiprocess mode) and the supervisor serves one
/metrics for the node: counters and histograms summed over every worker that ever ran
(a replaced worker's counts stay in, so the sums never go backwards), gauges summed
over the live workers (`multiprocess_mode="livesum"`: streams active, cache bytes; the
capacities add up to --cache-bytes). The names are the same as for one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BUILD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1)


class ServerMetrics:
    """All server metrics, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ds = ("dataset", "split")
        self.streams_active = Gauge(
            "tokenfeed_server_streams_active",
            "StreamBatches calls in progress",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.batches_sent = Counter(
            "tokenfeed_server_batches_sent", "Batches sent", ds, registry=registry
        )
        # `source` is "" for a single dataset's stream (PromQL treats it as absent, so
        # queries by dataset and split read as before); a mixture's rows count under
        # their source's dataset with source = that source.
        self.tokens_sent = Counter(
            "tokenfeed_server_tokens_sent",
            "Tokens sent (rows x (seq_len + shift)); a mixture's by source",
            ("dataset", "split", "source"),
            registry=registry,
        )
        self.bytes_sent = Counter(
            "tokenfeed_server_bytes_sent", "Token payload bytes sent", ds, registry=registry
        )
        self.errors = Counter(
            "tokenfeed_server_errors",
            "Calls ended with an error, by gRPC status code",
            ("code",),
            registry=registry,
        )
        self.cache_hits = Counter(
            "tokenfeed_cache_hits", "Chunk requests served from the cache", registry=registry
        )
        self.cache_misses = Counter(
            "tokenfeed_cache_misses",
            "Chunk requests that had to load (or wait for) a chunk",
            registry=registry,
        )
        self.cache_dataset_hits = Counter(
            "tokenfeed_cache_dataset_hits",
            "Chunk requests served from the cache, by dataset (a mixture's: by source)",
            ("dataset",),
            registry=registry,
        )
        self.cache_dataset_misses = Counter(
            "tokenfeed_cache_dataset_misses",
            "Chunk requests that had to load (or wait for) a chunk, by dataset",
            ("dataset",),
            registry=registry,
        )
        self.cache_evictions = Counter(
            "tokenfeed_cache_evictions", "Chunks evicted to make room", registry=registry
        )
        self.cache_checksum_failures = Counter(
            "tokenfeed_cache_checksum_failures",
            "Chunks whose bytes did not match the checksum in meta.json",
            registry=registry,
        )
        self.cache_load_failures = Counter(
            "tokenfeed_cache_load_failures",
            "Chunk loads that failed for any reason (missing, short, unreadable, corrupt)",
            registry=registry,
        )
        self.cache_resident_bytes = Gauge(
            "tokenfeed_cache_resident_bytes",
            "Bytes held (or being loaded) by the chunk cache",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.cache_capacity_bytes = Gauge(
            "tokenfeed_cache_capacity_bytes",
            "Byte bound of the chunk cache (--cache-bytes)",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.readahead_bytes = Gauge(
            "tokenfeed_readahead_bytes",
            "Bytes of chunks read ahead and not used yet (outside the cache's bound)",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.readahead_capacity_bytes = Gauge(
            "tokenfeed_readahead_capacity_bytes",
            "Byte bound of chunks read ahead and not used yet (--readahead-bytes)",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.chunk_load_seconds = Histogram(
            "tokenfeed_chunk_load_seconds",
            "Time to read and verify one chunk",
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.batch_build_seconds = Histogram(
            "tokenfeed_batch_build_seconds",
            "Time to assemble one batch from cached chunks",
            buckets=_BUILD_BUCKETS,
            registry=registry,
        )


class SupervisorMetrics:
    """The supervisor's metrics (`--workers N`), on the registry that also collects the
    workers' files."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.workers = Gauge(
            "tokenfeed_server_workers", "Worker processes serving (--workers)", registry=registry
        )
        self.worker_restarts = Counter(
            "tokenfeed_server_worker_restarts",
            "Worker processes that died and were replaced",
            registry=registry,
        )
