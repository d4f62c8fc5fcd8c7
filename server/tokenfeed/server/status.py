"""The status page on the metrics port: who is streaming what, as HTML and as JSON.

    /status.json  {"datasets": [{"name", "tokens", "format"}],
                   "cache": {"bytes", "capacity_bytes", "hit_ratio"},
                   "streams": [{"job", "peer", "dataset" (or "mixture": [names]),
                                "rank", "world_size", "epoch", "step",
                                "tokens_per_s", "idle_s"}]}
    /status       the same as plain HTML tables, refreshed by the browser every
                  REFRESH_SECONDS (no script)
    anything else the Prometheus exposition (/metrics)

A status is a dict (`feeder_status`: the catalog's, the cache's and the streams');
under `--workers N` each worker writes its own to the state directory every second and
the supervisor serves `merge` of the live workers' ones. No gRPC here. Nothing secret
reaches it: jobs are names, peers addresses. The keys: docs/tenants.md, "Who is streaming".
"""

from __future__ import annotations

import html
import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

if TYPE_CHECKING:
    from tokenfeed.server.cache import ChunkCache
    from tokenfeed.server.datasets import Catalog
    from tokenfeed.server.streams import OpenStreams

REFRESH_SECONDS = 5
StatusFn = Callable[[], dict[str, Any]]
_STREAM_COLUMNS = (
    "job",
    "peer",
    "dataset",
    "rank",
    "world_size",
    "epoch",
    "step",
    "tokens_per_s",
    "idle_s",
)


def hit_ratio(hits: int, misses: int) -> float:
    """Chunk requests served from the cache, as a fraction (0 before any request)."""
    return round(hits / (hits + misses), 4) if hits + misses else 0.0


def feeder_status(catalog: Catalog, cache: ChunkCache, streams: OpenStreams) -> dict[str, Any]:
    """One feeder process's status; `cache_counts` (hits, misses) lets the supervisor
    of `--workers` merge the hit ratios."""
    hits, misses = cache.stats.hits, cache.stats.misses
    return {
        "datasets": [
            {"name": ds.name, "tokens": ds.store.total_tokens, "format": ds.store.format}
            for ds in sorted(catalog.opened(), key=lambda d: d.name)
        ],
        "cache": {
            "bytes": cache.resident_bytes,
            "capacity_bytes": cache.capacity,
            "hit_ratio": hit_ratio(hits, misses),
        },
        "streams": streams.rows(),
        "cache_counts": [hits, misses],
    }


def merge(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One node's status from its workers' (each with `cache_counts`: [hits, misses],
    and `age_s`, how old it is: added to its streams' idle times)."""
    datasets: dict[str, dict[str, Any]] = {}
    streams: list[dict[str, Any]] = []
    used = capacity = hits = misses = 0
    for part in parts:
        for ds in part["datasets"]:
            datasets.setdefault(ds["name"], ds)
        used += part["cache"]["bytes"]
        capacity += part["cache"]["capacity_bytes"]
        h, m = part.get("cache_counts", (0, 0))
        hits, misses = hits + h, misses + m
        age = part.get("age_s", 0.0)
        streams += [{**s, "idle_s": round(s["idle_s"] + age, 3)} for s in part["streams"]]
    return {
        "datasets": [datasets[n] for n in sorted(datasets)],
        "cache": {"bytes": used, "capacity_bytes": capacity, "hit_ratio": hit_ratio(hits, misses)},
        "streams": streams,
    }


def public(status: dict[str, Any]) -> dict[str, Any]:
    """The status with only the documented keys."""
    return {k: status[k] for k in ("datasets", "cache", "streams")}


def _cell(value: Any) -> str:
    if isinstance(value, list):
        value = ", ".join(map(str, value))
    return html.escape("" if value is None else str(value))


def render_html(status: dict[str, Any]) -> str:
    """The status as a page of plain tables (refreshed by a meta tag)."""
    cache = status["cache"]
    streams = sorted(status["streams"], key=lambda s: (str(s["job"]), str(s["peer"]), s["rank"]))
    rows = []
    for s in streams:
        what = s.get("dataset", s.get("mixture"))
        cells = [s["job"], s["peer"], what, *(s[c] for c in _STREAM_COLUMNS[3:])]
        rows.append("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{'dataset or mixture' if c == 'dataset' else c}</th>" for c in _STREAM_COLUMNS
    )
    datasets = "".join(
        f"<tr><td>{_cell(d['name'])}</td><td>{d['tokens']}</td><td>{_cell(d['format'])}</td></tr>"
        for d in status["datasets"]
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>tokenfeed: who is streaming</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #bbb; padding: 0.2em 0.6em; text-align: left; }}
td:nth-child(n+4) {{ text-align: right; }}
</style></head><body>
<h1>tokenfeed feeder</h1>
<p id="cache">cache: {cache["bytes"]} of {cache["capacity_bytes"]} bytes,
hit ratio {cache["hit_ratio"]}</p>
<h2>Streams: {len(streams)}</h2>
<table id="streams"><thead><tr>{head}</tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<h2>Datasets open</h2>
<table id="datasets"><thead><tr><th>name</th><th>tokens</th><th>format</th></tr></thead>
<tbody>{datasets}</tbody></table>
<p><a href="status.json">JSON</a> · <a href="metrics">metrics</a></p>
</body></html>
"""


def http_app(registry: CollectorRegistry, status: StatusFn | None) -> Callable[..., Any]:
    """A WSGI app: /status and /status.json from `status()`, everything else /metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if status is None or path not in ("/status", "/status/", "/status.json"):
            return list(metrics(environ, start_response))
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        doc = public(status())
        if path == "/status.json":
            body, kind = json.dumps(doc).encode(), "application/json"
        else:
            body, kind = render_html(doc).encode(), "text/html; charset=utf-8"
        start_response(
            "200 OK",
            [
                ("Content-Type", kind),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [body]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no access log
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_http(
    registry: CollectorRegistry, host: str, port: int, status: StatusFn | None = None
) -> tuple[WSGIServer, int]:
    """Serve `http_app` on host:port in a daemon thread; (server, bound port). Port 0
    picks a free one; `server.shutdown()` stops it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("StatusServer", (_Server,), {"address_family": family})
    app = http_app(registry, status)
    server: WSGIServer = make_server(host, port, app, server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="tokenfeed-http", daemon=True).start()
    return server, int(server.server_address[1])
