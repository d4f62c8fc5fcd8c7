"""tokenfeed side by side with the loaders a team would otherwise pick, on the same tokens.

    benchmarks/peers/setup.sh                 # once: a venv per peer under .peers/ (~5 min)
    .venv/bin/python benchmarks/peers.py      # everything, 3 interleaved rounds (<1 h)

The peers, each given the same random uint16 tokens in its own recommended format and
run in its own virtual environment by a small adapter (benchmarks/peers/run_*.py) that
prints JSON:

  tokenfeed   FeederClient from a `tokenfeed serve` started here, over its store
              (written by `tokenfeed import`); numpy (device=None) and torch ("cpu")
  dataloader  torch DataLoader over a memmap of the flat file; 0 and 2 workers
  streaming   MosaicML Streaming: MDSWriter shards, StreamingDataset and its loader
  litdata     LitData: `optimize` with TokensLoader, StreamingDataset and its loader
  grain       Grain: a memmap data source, MapDataset shuffled and batched; 0 and 2
              workers (mp_prefetch)
  floor       not a loader: one batch handed out again and again, what the loop's
              `next()` costs with nothing behind it (the stall's floor on this
              machine); the one-dataset run only, never a column's best

Windows of 1,024 + 1 tokens, batches of 16, shuffled. For each, in a fresh process per
round and the rounds interleaved (the order rotates every round): the time to the first
batch cold (the format's files dropped from the page cache, tokenfeed's feeder freshly
started) and warm (a second loader in the same process); tokens/s into an empty loop;
CPU seconds per 10^9 tokens of every process involved (the loop's, its workers', the
feeder's); stall fraction and p99 of next() in a loop that sleeps --step-ms per batch;
peak PSS summed over those processes (sampled from here); the time to write the format
from the flat file. Then a mixture of three sources at 0.5 / 0.3 / 0.2 with each
peer's own mixing, with the same figures and how far each source's row count strays
from its weight over the first 1,000 batches; and resume: stop at half an epoch, save
the state, and the time from a new loader loading it to its next batch, whether the
batches after it are those of the run that went on, and (where the loader allows it)
the same state resumed at world size 2. Medians over rounds; the ratios are against
the best peer in each column. Read benchmarks/README.md for the latest figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from procs import pss, tree

HERE = Path(__file__).resolve().parent
ADAPTERS = HERE / "peers"
REPO = HERE.parent
SOURCE_SPAN = 20_000  # as in peers/harness.py: source i's tokens lie in [i, i + 1) x this
MIXTURE = (("mix-a", 0.5), ("mix-b", 0.3), ("mix-c", 0.2))


@dataclass(frozen=True)
class PeerKind:
    """A loader: its adapter, the venv it runs in (None: this interpreter's), its
    variants, whether it reads the flat file as it is (no format to write), and
    whether it is a reference for the harness rather than a loader (run on one
    dataset only, never compared with)."""

    name: str
    venv: str | None
    variants: tuple[str, ...]
    flat: bool = False
    reference: bool = False

    @property
    def adapter(self) -> Path:
        return ADAPTERS / f"run_{self.name}.py"

    def python(self, peers_dir: Path) -> Path:
        return Path(sys.executable) if self.venv is None else peers_dir / self.venv / "bin/python"


PEERS = (
    PeerKind("tokenfeed", None, ("numpy", "torch")),
    PeerKind("dataloader", None, ("w0", "w2"), flat=True),
    PeerKind("streaming", "streaming", ("w0", "w2")),
    PeerKind("litdata", "litdata", ("w0", "w2")),
    PeerKind("grain", "grain", ("w0", "w2"), flat=True),
    PeerKind("floor", None, ("ready",), flat=True, reference=True),
)
REFERENCES = tuple(k.name for k in PEERS if k.reference)


# ----------------------------------------------------------------- pure helpers


def interleaved(items: list[Any], rounds: int) -> list[tuple[int, Any]]:
    """(round, item) for every round, the order rotated by one each round, so no item
    always runs first (cold machine) or after the same neighbour."""
    out = []
    for r in range(rounds):
        k = r % len(items) if items else 0
        out += [(r, item) for item in items[k:] + items[:k]]
    return out


def flat_tokens(n: int, seed: int, low: int = 0, high: int = 1 << 16) -> np.ndarray:
    """n random uint16 tokens in [low, high), the same for every peer."""
    return np.random.default_rng(seed).integers(low, high, size=n, dtype=np.uint16)


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def best(rows: dict[str, float | None], lower_is_better: bool) -> tuple[str, float] | None:
    """The best (name, value) among `rows`, None values left out."""
    have = [(k, v) for k, v in rows.items() if v is not None]
    if not have:
        return None
    return (min if lower_is_better else max)(have, key=lambda kv: kv[1])


# Per figure: where it is in one run's JSON, whether lower is better, and its unit.
COLUMNS = {
    "Mtok/s": (("empty", "tokens_per_s"), False, 1e-6),
    "CPU s/1e9": (("empty", "cpu_s_per_1e9_tokens"), True, 1.0),
    "stall %": (("step", "stall_fraction"), True, 100.0),
    "p99 ms": (("step", "wait_p99_ms"), True, 1.0),
    "first cold ms": (("first_batch_cold_s",), True, 1e3),
    "first warm ms": (("first_batch_warm_s",), True, 1e3),
    "PSS MiB": (("peak_pss",), True, 1 / 2**20),
}


def figure(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


def table(results: list[dict[str, Any]], part: str) -> dict[str, dict[str, float | None]]:
    """name -> column -> the median over rounds (scaled to the column's unit)."""
    names = sorted({r["name"] for r in results if r["part"] == part}, key=_order)
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        runs = [r for r in results if r["part"] == part and r["name"] == name]
        row: dict[str, float | None] = {}
        for col, (path, _, scale) in COLUMNS.items():
            m = median([figure(r, path) for r in runs])  # type: ignore[misc]
            row[col] = None if m is None else m * scale
        dev = median([figure(r, ("deviation", "max_rows")) for r in runs])  # type: ignore[misc]
        if dev is not None:
            row["max dev rows"] = dev
        out[name] = row
    return out


def ratios(rows: dict[str, dict[str, float | None]], ours: str) -> dict[str, tuple[str, float]]:
    """column -> (the best other loader, `ours` / its value)."""
    out = {}
    lower = {col: low for col, (_, low, _) in COLUMNS.items()} | {"max dev rows": True}
    for col, low in lower.items():
        others = {
            k: v.get(col)
            for k, v in rows.items()
            if not k.startswith("tokenfeed") and k.split("/")[0] not in REFERENCES
        }
        b = best(others, low)
        mine = rows.get(ours, {}).get(col)
        if b is not None and mine is not None and b[1]:
            out[col] = (b[0], mine / b[1])
    return out


def _order(name: str) -> tuple[int, str]:
    kinds = [p.name for p in PEERS]
    kind = name.split("/")[0]
    return (kinds.index(kind) if kind in kinds else len(kinds), name)


# ------------------------------------------------------------------ processes


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (written back first), so the next read is cold. Only
    these files: the rest of the machine's page cache is left alone."""
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class PeakPss(threading.Thread):
    """Samples the PSS summed over `pid`'s process tree and `also`, every `every` s."""

    def __init__(self, pid: int, also: list[int], every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.also, self.every = pid, also, every
        self.peak = 0
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(self.every):
            self.peak = max(self.peak, sum(pss(p) for p in tree(self.pid) + self.also))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


class Feeder:
    """A `tokenfeed serve` over `root` on 127.0.0.1, for one adapter run."""

    def __init__(self, root: Path) -> None:
        from tokenfeed.cli.process import serve_argv, wait_for_port

        self.port_file = Path(tempfile.mkdtemp(prefix="tokenfeed-peers-")) / "port"
        self.proc = subprocess.Popen(
            serve_argv(root, self.port_file),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.address = f"127.0.0.1:{wait_for_port(self.proc, self.port_file)}"

    def stop(self) -> None:
        import signal

        from tokenfeed.cli.process import stop

        stop(self.proc, signal.SIGTERM)
        self.port_file.unlink(missing_ok=True)
        self.port_file.parent.rmdir()


def adapter(
    kind: PeerKind, args: argparse.Namespace, mode: str, argv: list[str], feeder: Feeder | None
) -> dict[str, Any]:
    """Run one adapter; its JSON, with the peak PSS of its processes (and the feeder's)."""
    env = dict(os.environ)
    cmd = [str(kind.python(args.peers_dir)), str(kind.adapter), mode, *argv]
    if feeder is not None:
        env["TOKENFEED_ADDRESS"] = feeder.address
        cmd += ["--feeder-pid", str(feeder.proc.pid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = PeakPss(proc.pid, [feeder.proc.pid] if feeder else [])
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    peak = sampler.stop()
    lines = out.strip().splitlines()
    if proc.returncode or not lines:
        tail = "\n".join(err.strip().splitlines()[-15:])
        raise RuntimeError(f"{kind.name} {mode} {' '.join(argv)} exited {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["peak_pss"] = peak
    return result


# ----------------------------------------------------------------------- parts


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.flat = work / "flat"
        self.formats = work / "formats"
        self.kinds = [k for k in PEERS if k.name in args.peers.split(",")]
        missing = [k for k in self.kinds if not k.python(args.peers_dir).exists()]
        for k in missing:
            print(
                f"skipping {k.name}: no venv at {args.peers_dir / str(k.venv)} "
                "(run benchmarks/peers/setup.sh)",
                file=sys.stderr,
            )
        self.kinds = [k for k in self.kinds if k not in missing]
        self.results: list[dict[str, Any]] = []

    def variants(self, kind: PeerKind) -> list[str]:
        """`kind`'s variants that --variants names (all when it names none of them)."""
        asked = [v.split("/", 1) for v in self.args.variants.split(",") if "/" in v]
        mine = [v for k, v in asked if k == kind.name and v in kind.variants]
        return mine or list(kind.variants)

    def data(self, kind: PeerKind, names: list[str]) -> list[str]:
        """The --data arguments of `kind` for these datasets."""
        if kind.name == "tokenfeed":
            return names  # names under the feeder's data root
        if kind.flat:
            return [str(self.flat / f"{n}.bin") for n in names]
        return [str(self.formats / kind.name / n) for n in names]

    def files(self, kind: PeerKind, names: list[str]) -> list[Path]:
        if kind.name == "tokenfeed":
            return [self.formats / "tokenfeed" / n for n in names]
        return [Path(p) for p in self.data(kind, names)]

    def feeder(self, kind: PeerKind) -> Feeder | None:
        return Feeder(self.formats / "tokenfeed") if kind.name == "tokenfeed" else None

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- writing
    def write(self) -> None:
        self.flat.mkdir(parents=True, exist_ok=True)
        n = int(self.args.tokens)
        flat_tokens(n, 0).tofile(self.flat / "main.bin")
        m = int(self.args.mixture_tokens)
        for i, (name, _) in enumerate(MIXTURE):
            low = i * SOURCE_SPAN
            flat_tokens(m, i + 1, low, low + SOURCE_SPAN).tofile(self.flat / f"{name}.bin")
        names = ["main"] + [n for n, _ in MIXTURE]
        for kind in self.kinds:
            if kind.flat:
                continue
            out = self.formats / kind.name
            out.mkdir(parents=True, exist_ok=True)
            for name in names:  # one call per file: the time to write one format
                flat = str(self.flat / f"{name}.bin")
                r = adapter(kind, self.args, "write", ["--data", flat, "--out", str(out)], None)
                if name == "main":
                    r.update(name=kind.name, part="write", round=0)
                    self.results.append(r)
                    self.log(f"  wrote {kind.name} in {r['write_s']:.1f} s")

    # ---------------------------------------------------------------- running
    def run_part(self, part: str) -> None:
        mixture = part == "mixture"
        names = [n for n, _ in MIXTURE] if mixture else ["main"]
        kinds = [k for k in self.kinds if not (mixture and k.reference)]
        runs = [(k, v) for k in kinds for v in self.variants(k)]
        for r, (kind, variant) in interleaved(runs, self.args.rounds):
            argv = ["--seconds", str(self.args.seconds), "--step-ms", str(self.args.step_ms)]
            if mixture:
                argv += ["--weights", *(str(w) for _, w in MIXTURE)]
                argv += ["--mixture-batches", str(self.args.mixture_batches)]
            drop_from_page_cache(self.files(kind, names))
            result = self.one(kind, variant, "run", names, argv, part, r)
            if result is not None:
                self.log(
                    f"  {part} round {r + 1}: {kind.name}/{variant} "
                    f"{result['empty']['tokens_per_s'] / 1e6:.1f} Mtok/s"
                )

    def resume(self) -> None:
        for kind in [k for k in self.kinds if not k.reference]:
            argv = ["--elastic-world-size", "2"]
            variant = self.variants(kind)[0]
            result = self.one(kind, variant, "resume", ["main"], argv, "resume", 0)
            if result is not None:
                self.log(f"  resume {kind.name}: {result['resume_s'] * 1e3:.1f} ms")

    def one(
        self,
        kind: PeerKind,
        variant: str,
        mode: str,
        names: list[str],
        argv: list[str],
        part: str,
        round_: int,
    ) -> dict[str, Any] | None:
        """One adapter run over `names` (a feeder of its own for tokenfeed); its result,
        kept, or None when it failed (logged: the other runs go on)."""
        argv = ["--data", *self.data(kind, names), "--variant", variant, *argv]
        feeder = self.feeder(kind)
        try:
            result = adapter(kind, self.args, mode, argv, feeder)
        except RuntimeError as e:
            self.log(f"  {kind.name}/{variant} {part} failed: {e}")
            return None
        finally:
            if feeder is not None:
                feeder.stop()
        result.update(name=f"{kind.name}/{variant}", part=part, round=round_)
        self.results.append(result)
        return result


# --------------------------------------------------------------------- report


def report(results: list[dict[str, Any]], ours: str = "tokenfeed/numpy") -> str:
    lines: list[str] = []
    for part, title in (("run", "one dataset"), ("mixture", "mixture 0.5 / 0.3 / 0.2")):
        rows = table(results, part)
        if not rows:
            continue
        cols = [c for c in [*COLUMNS, "max dev rows"] if any(c in r for r in rows.values())]
        lines += ["", f"{title} (medians over rounds)", ""]
        lines.append(f"{'loader':<18}" + "".join(f"{c:>15}" for c in cols))
        for name, row in rows.items():
            cells = "".join(
                f"{'-':>15}" if row.get(c) is None else f"{row[c]:>15.3g}" for c in cols
            )
            lines.append(f"{name:<18}{cells}")
        for mine in [n for n in rows if n.startswith("tokenfeed")]:
            lines.append("")
            lines.append(f"{mine} against the best other loader per column:")
            for col, (peer, ratio) in ratios(rows, mine).items():
                lines.append(f"  {col:<15} {ratio:8.3f}x  ({peer})")
    writes = [r for r in results if r["part"] == "write"]
    if writes:
        lines += ["", "writing the format from the flat file"]
        lines += [f"  {r['name']:<16} {r['write_s']:8.2f} s" for r in writes]
    resumes = [r for r in results if r["part"] == "resume"]
    if resumes:
        lines += ["", "resume at half an epoch: new loader + load_state_dict -> next batch"]
        for r in resumes:
            e = r.get("elastic")
            elastic = (
                "not supported"
                if e is None
                else f"world size {e['world_size']}: {e['resume_s'] * 1e3:.1f} ms, lost "
                f"{e['lost']}, repeated {e['repeated']}, foreign {e['foreign']}"
            )
            lines.append(
                f"  {r['name']:<16} {r['resume_s'] * 1e3:9.1f} ms  exact: {r['exact']}  "
                f"state {r['state_bytes']} B  elastic: {elastic}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=64e6, help="the one dataset (default 64M)")
    p.add_argument(
        "--mixture-tokens", type=float, default=16e6, help="each mixture source (default 16M)"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seconds", type=float, default=5.0, help="per loop (default 5)")
    p.add_argument("--step-ms", type=float, default=5.0, help="the stepped loop's sleep")
    p.add_argument("--peers", default=",".join(k.name for k in PEERS))
    p.add_argument(
        "--variants",
        default="",
        help="only these variants of their loaders, e.g. tokenfeed/numpy,grain/w0 (default: all)",
    )
    p.add_argument("--parts", default="write,run,mixture,resume", help="which parts (default: all)")
    p.add_argument(
        "--mixture-batches", type=int, default=1000, help="batches the deviation is taken over"
    )
    p.add_argument("--peers-dir", type=Path, default=REPO / ".peers", help="the peer venvs")
    p.add_argument("--workdir", type=Path, help="keep the data here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="per adapter run, seconds")
    p.add_argument("--json", type=Path, help="also write every result to this file")
    args = p.parse_args()

    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="tokenfeed-peers-") as tmp:
        work = args.workdir or Path(tmp)
        bench = Bench(args, work)
        load0 = os.getloadavg()
        t0 = time.monotonic()
        print(
            f"{args.tokens / 1e6:.0f}M uint16 tokens, windows of 1024 + 1, batches of 16, "
            f"shuffled; {args.rounds} rounds of {args.seconds:g} s loops; {os.cpu_count()} "
            f"CPUs; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
            flush=True,
        )
        bench.write()  # the data every part reads; the write times are reported with "write"
        for part in ("run", "mixture"):
            if part in parts:
                bench.run_part(part)
        if "resume" in parts:
            bench.resume()
    results = [r for r in bench.results if r["part"] in parts]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(report(results))
    load1 = os.getloadavg()
    print(
        f"\n{time.monotonic() - t0:.0f} s; load average at the end {load1[0]:.2f} "
        f"{load1[1]:.2f} {load1[2]:.2f}"
    )


if __name__ == "__main__":
    main()
