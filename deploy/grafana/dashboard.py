"""Generate deploy/grafana/dashboards/tokenfeed.json, the dashboard Grafana loads.

    python deploy/grafana/dashboard.py          # rewrite the JSON
    python deploy/grafana/dashboard.py --check  # exit 1 if the committed JSON is stale

Why code: about twenty panels share one data source, one rate window and one layout
rule; written as grafanalib objects they stay short and reviewable, and the committed
JSON is still what Grafana provisions (tests/deploy/test_deploy.py proves the two agree).

The panel queries use raw metrics with `$__rate_interval` rather than the recording
rules, so the dashboard also works on a Prometheus that does not load our rules (a
cluster's shared one). Metric names come from server/ and client/ metrics.py;
tests/deploy/test_deploy_prometheus.py runs every query against a real feeder and client.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grafanalib.core as G
from grafanalib._gen import DashboardEncoder

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "tokenfeed.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
WIDTH = 24  # Grafana's grid width


def target(expr: str, legend: str = "", ref: str = "A") -> G.Target:
    return G.Target(expr=expr, legendFormat=legend, refId=ref)


def targets(*pairs: tuple[str, str]) -> list[G.Target]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def quantiles(metric: str, by: str, label: str) -> list[tuple[str, str]]:
    """p50 and p99 of a histogram, per `by` label set."""
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))",
            f"p{int(q * 100)} {label}",
        )
        for q in (0.5, 0.99)
    ]


def timeseries(
    title: str, pairs: list[tuple[str, str]], unit: str, description: str, **kw: object
) -> G.TimeSeries:
    return G.TimeSeries(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=targets(*pairs),
        unit=unit,
        tooltipMode="multi",
        legendDisplayMode="table",
        legendPlacement="right",
        legendCalcs=["lastNotNull", "max"],
        **kw,
    )


def stat(
    title: str,
    expr: str,
    unit: str,
    description: str,
    legend: str = "",
    thresholds: list[G.Threshold] | None = None,
) -> G.Stat:
    return G.Stat(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=[target(expr, legend)],
        format=unit,
        reduceCalc="lastNotNull",
        graphMode="area",
        thresholds=thresholds or [G.Threshold("green", 0, 0.0)],
    )


def row(title: str) -> G.RowPanel:
    return G.RowPanel(title=title)


STALL_LIMIT = 0.05  # the TokenfeedRankStalled alert's threshold

OVERVIEW = [
    (
        stat(
            "Tokens/s received (all ranks)",
            f"sum(rate(tokenfeed_client_tokens_received_total[{RATE}]))",
            "short",
            "input_ids tokens per second the trainers receive, summed over ranks",
        ),
        4,
    ),
    (
        stat(
            "Tokens/s served (all feeders)",
            f"sum(rate(tokenfeed_server_tokens_sent_total[{RATE}]))",
            "short",
            "tokens per second the feeders send (rows x (seq_len + shift))",
        ),
        4,
    ),
    (
        stat(
            "Worst rank stall",
            "max(tokenfeed_client_stall_fraction)",
            "percentunit",
            "largest fraction of wall time any rank's loop waited in next() (30 s window); "
            "above 5% the feeder is the bottleneck",
            thresholds=[G.Threshold("green", 0, 0.0), G.Threshold("red", 1, STALL_LIMIT)],
        ),
        4,
    ),
    (
        stat(
            "Cache hit ratio",
            f"sum(rate(tokenfeed_cache_hits_total[{RATE}])) / (sum(rate(tokenfeed_cache_hits_total"
            f"[{RATE}])) + sum(rate(tokenfeed_cache_misses_total[{RATE}])))",
            "percentunit",
            "chunk requests served from memory, all feeders",
            thresholds=[G.Threshold("red", 0, 0.0), G.Threshold("green", 1, 0.5)],
        ),
        4,
    ),
    (
        stat(
            "Active streams",
            "sum(tokenfeed_server_streams_active)",
            "short",
            "StreamBatches calls in progress (about one per rank)",
        ),
        4,
    ),
    (
        stat(
            "Feeders up",
            'sum(up{job="tokenfeed-feeder"})',
            "short",
            "feeder replicas Prometheus scrapes successfully",
        ),
        4,
    ),
]

THROUGHPUT = [
    (
        timeseries(
            "Tokens/s served and received",
            [
                (f"sum(rate(tokenfeed_server_tokens_sent_total[{RATE}]))", "served (all feeders)"),
                (
                    f"sum(rate(tokenfeed_client_tokens_received_total[{RATE}]))",
                    "received (all ranks)",
                ),
                (
                    f"sum by (rank) (rate(tokenfeed_client_tokens_received_total[{RATE}]))",
                    "rank {{rank}}",
                ),
            ],
            "short",
            "Served counts seq_len + shift tokens per row, received counts seq_len.",
        ),
        12,
    ),
    (
        timeseries(
            "Bytes/s on the wire",
            [
                (
                    f"sum by (dataset, split) (rate(tokenfeed_server_bytes_sent_total[{RATE}]))",
                    "sent {{dataset}}/{{split}}",
                ),
                (
                    f"sum by (rank) (rate(tokenfeed_client_bytes_received_total[{RATE}]))",
                    "rank {{rank}} received",
                ),
            ],
            "Bps",
            "Token payload bytes (narrow dtype: 2 bytes per token for GPT-2).",
        ),
        12,
    ),
    (
        timeseries(
            "Batches/s",
            [
                (
                    f"sum by (dataset, split) (rate(tokenfeed_server_batches_sent_total[{RATE}]))",
                    "sent {{dataset}}/{{split}}",
                ),
                (
                    f"sum by (rank) (rate(tokenfeed_client_batches_received_total[{RATE}]))",
                    "rank {{rank}}",
                ),
            ],
            "short",
            "Batches per second per dataset/split and per rank.",
        ),
        12,
    ),
    (
        timeseries(
            "Active streams",
            [
                ("sum by (instance) (tokenfeed_server_streams_active)", "{{instance}}"),
            ],
            "short",
            "StreamBatches calls in progress per feeder replica.",
        ),
        12,
    ),
]

MIXTURES = [
    (
        timeseries(
            "Tokens/s by source (mixtures)",
            [
                (
                    f'sum by (source) (rate(tokenfeed_server_tokens_sent_total{{source!=""}}'
                    f"[{RATE}]))",
                    "{{source}}",
                ),
                (
                    f'sum by (dataset) (rate(tokenfeed_server_tokens_sent_total{{source=""}}'
                    f"[{RATE}]))",
                    "{{dataset}} (alone)",
                ),
            ],
            "short",
            "A mixture's tokens by source (its weights at work); single-dataset streams "
            "by dataset.",
        ),
        12,
    ),
    (
        timeseries(
            "Mixture weights",
            [("max by (source) (tokenfeed_client_mixture_weight_ratio)", "{{source}}")],
            "percentunit",
            "Each source's weight at the trainers' position: the constructor's schedule "
            "and the changes made at run time (set_weights, an online mixer).",
            valueMin=0,
            valueMax=1,
        ),
        12,
    ),
    (
        timeseries(
            "Mixer loss by source",
            [("max by (source) (tokenfeed_client_mixer_loss_nats)", "{{source}}")],
            "none",
            "An online mixer's mean loss per row of each source over its last update "
            "interval, summed over ranks: what its policy turned into the weights beside.",
        ),
        12,
    ),
]

TRAINERS = [
    (
        timeseries(
            "Stall fraction per rank",
            [
                ("max by (rank) (tokenfeed_client_stall_fraction)", "rank {{rank}}"),
            ],
            "percentunit",
            "Fraction of wall time the training loop waited for data over the "
            "client's 30 s window. The alert fires above 5% for 5 minutes.",
            valueMin=0,
            thresholds=[G.Threshold("green", 0, 0.0), G.Threshold("red", 1, STALL_LIMIT)],
            thresholdsStyleMode="line",
        ),
        12,
    ),
    (
        timeseries(
            "next() wait percentiles",
            quantiles("tokenfeed_client_wait_seconds", "rank", "rank {{rank}}"),
            "s",
            "How long the training loop blocks per batch: microseconds when the "
            "double buffer is full, the feeder's latency when it is not.",
        ),
        12,
    ),
    (
        timeseries(
            "Buffer occupancy",
            [
                ("max by (rank) (tokenfeed_client_buffer_occupancy)", "rank {{rank}}"),
            ],
            "short",
            "Batches ready in each client's ring (prefetch); 0 means the loop is about to wait.",
            valueMin=0,
        ),
        12,
    ),
    (
        timeseries(
            "Reconnects",
            [
                (
                    f"sum by (rank, reason) (increase(tokenfeed_client_reconnects_total[{RATE}]))",
                    "rank {{rank}} {{reason}}",
                ),
            ],
            "short",
            "Stream re-openings by cause (unavailable, ended_early, resolve, ...): "
            "each resumes at the first batch not yet delivered.",
            drawStyle="bars",
        ),
        12,
    ),
    (
        timeseries(
            "Time to first batch",
            [
                (
                    "max by (rank) (tokenfeed_client_first_batch_seconds_sum "
                    "/ tokenfeed_client_first_batch_seconds_count)",
                    "mean rank {{rank}}",
                ),
                *quantiles("tokenfeed_client_first_batch_seconds", "rank", "rank {{rank}}")[1:],
            ],
            "s",
            "How long each stream's first next() waited (connect, plan, first chunk): kept "
            "apart from the steady-state wait and stall above. With lookahead the next "
            "epoch's stream is open before the epoch ends, so later epochs start at ~0.",
        ),
        12,
    ),
]

FEEDER = [
    (
        timeseries(
            "Cache requests/s",
            [
                (
                    f"sum by (instance) (rate(tokenfeed_cache_hits_total[{RATE}]))",
                    "hits {{instance}}",
                ),
                (
                    f"sum by (instance) (rate(tokenfeed_cache_misses_total[{RATE}]))",
                    "misses {{instance}}",
                ),
                (
                    f"sum by (instance) (rate(tokenfeed_cache_evictions_total[{RATE}]))",
                    "evictions {{instance}}",
                ),
            ],
            "short",
            "Chunk requests served from memory (hits) or loaded from disk (misses), "
            "and chunks evicted to make room.",
        ),
        8,
    ),
    (
        timeseries(
            "Cache hit ratio",
            [
                (
                    f"sum by (instance) (rate(tokenfeed_cache_hits_total[{RATE}])) / "
                    f"(sum by (instance) (rate(tokenfeed_cache_hits_total[{RATE}])) "
                    f"+ sum by (instance) (rate(tokenfeed_cache_misses_total[{RATE}])))",
                    "{{instance}}",
                ),
            ],
            "percentunit",
            "Below 50% for 10 minutes the working set no longer fits in "
            "--cache-bytes (alert TokenfeedCacheHitRatioCollapsing).",
            valueMin=0,
            valueMax=1,
        ),
        8,
    ),
    (
        timeseries(
            "Cache bytes",
            [
                ("sum by (instance) (tokenfeed_cache_resident_bytes)", "resident {{instance}}"),
                ("sum by (instance) (tokenfeed_cache_capacity_bytes)", "capacity {{instance}}"),
            ],
            "bytes",
            "Bytes held by the chunk cache against its --cache-bytes bound.",
        ),
        8,
    ),
    (
        timeseries(
            "Chunk load latency",
            quantiles("tokenfeed_chunk_load_seconds", "instance", "{{instance}}"),
            "s",
            "Time to read and checksum one chunk from the store (cache misses).",
        ),
        8,
    ),
    (
        timeseries(
            "Batch build latency",
            quantiles("tokenfeed_batch_build_seconds", "instance", "{{instance}}"),
            "s",
            "Time to assemble one batch from cached chunks, off the event loop.",
        ),
        8,
    ),
    (
        timeseries(
            "Errors by code",
            [
                (f"sum by (code) (rate(tokenfeed_server_errors_total[{RATE}]))", "{{code}}"),
                (
                    f"sum(rate(tokenfeed_cache_load_failures_total[{RATE}]))",
                    "chunk load failures",
                ),
                (
                    f"sum(rate(tokenfeed_cache_checksum_failures_total[{RATE}]))",
                    "checksum failures",
                ),
            ],
            "reqps",
            "Calls ended with an error, by gRPC status code; chunk load failures (a missing, "
            "short or unreadable chunk) and checksum failures (a corrupt chunk) give clients "
            "DATA_LOSS.",
            drawStyle="bars",
        ),
        8,
    ),
    (
        timeseries(
            "Chunk loads by dataset",
            [
                (
                    f"sum by (dataset) (rate(tokenfeed_cache_dataset_misses_total[{RATE}]))",
                    "misses {{dataset}}",
                ),
                (
                    f"sum by (dataset) (rate(tokenfeed_cache_dataset_hits_total[{RATE}]))",
                    "hits {{dataset}}",
                ),
            ],
            "short",
            "Chunk requests by dataset, all feeders: which store (a mixture's source, a "
            "store in object storage) the cache loads from.",
        ),
        8,
    ),
]

SECTIONS = [
    ("Overview", OVERVIEW, 4),
    ("Throughput", THROUGHPUT, 8),
    ("Mixtures", MIXTURES, 8),
    ("Trainers", TRAINERS, 8),
    ("Feeder", FEEDER, 8),
]


def layout() -> list[G.Panel]:
    """Rows of panels, left to right, wrapping at the grid width."""
    panels: list[G.Panel] = []
    y = 0
    for title, section, height in SECTIONS:
        rp = row(title)
        rp.gridPos = G.GridPos(h=1, w=WIDTH, x=0, y=y)
        panels.append(rp)
        y += 1
        x = 0
        for panel, width in section:
            if x + width > WIDTH:
                x, y = 0, y + height
            panel.gridPos = G.GridPos(h=height, w=width, x=x, y=y)
            panels.append(panel)
            x += width
        y += height
    return panels


def dashboard() -> G.Dashboard:
    return G.Dashboard(
        title="tokenfeed",
        uid="tokenfeed",
        description="Feeder and trainer throughput, data stalls, cache and latency.",
        tags=["tokenfeed"],
        timezone="browser",
        refresh="5s",
        time=G.Time("now-15m", "now"),
        templating=G.Templating(
            list=[
                G.Template(
                    name="datasource", label="Data source", query="prometheus", type="datasource"
                ),
            ]
        ),
        panels=layout(),
    ).auto_panel_ids()


def render() -> str:
    data = dashboard().to_json_data()
    return json.dumps(data, cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if the committed JSON differs from the generated one",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
