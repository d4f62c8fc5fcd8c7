"""`tokenfeed info`: describe a token store without serving it.

`info PATH` prints what the store says (tokens, chunks, dtype, vocabulary, EOS,
tokenizer, source) and, given `--seq-len`, the tokens and windows of each split (and,
with `--batch-size`, rank 0's steps per epoch) computed by the sampling engine itself
with SamplingSpec's defaults, so the numbers are the ones the feeder serves. `--json`
prints the same as JSON. A folder of bare `*.bin` files needs `--dtype`.

PATH is any served format: a native store directory or `s3://bucket/prefix` (the
root is listed first: bad credentials or no such bucket exit 2), a folder of the seed
loader's chunk_NNNNNN/ save_to_disk datasets (info then prints the meta.json to put
beside them, to give the EOS, vocabulary or a narrower dtype), or a Megatron indexed
dataset (its PREFIX, or the .bin or .idx path).

The budget of a mixture before a run (docs/mixtures.md, "Before a run"):

    tokenfeed info --data-root ROOT --mixture web=0.7,code=0.2,math=0.1 (or FILE)
                   [--schedule FILE] --tokens 1e12 --seq-len L [--stride S] [--split-rate R]

prints, per source, its train tokens and windows, the windows and tokens a run of
`--tokens` tokens draws from it, the passes over it (how many times it repeats), and
its share in each schedule segment. The mixture file is the client's.

A saved run's weight trajectory (docs/mixtures.md, "Run-time weights"):

    tokenfeed info --state FILE [--json]

FILE is a JSON file or a torch checkpoint (`torch.save`, read with weights_only) that
holds a mixture FeederClient's `state_dict()` anywhere in it (and an OnlineMixer's):
prints the position, then every segment in force from token 0, the base mixture, the
declared schedule and the run-time changes merged as the feeder merges them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenfeed.core.dtypes import DTYPES


def add_path_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    parser.add_argument(
        "path",
        metavar="PATH",
        nargs="?" if optional else None,
        help="store: directory, s3://bucket/prefix, seed-layout folder, or Megatron PREFIX "
        "(or PREFIX.bin / PREFIX.idx)" + (" (not with --mixture)" if optional else ""),
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="token dtype of a folder of bare *.bin files (no meta.json)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenfeed.core.request import SamplingSpec

    add_path_arguments(parser, optional=True)
    SamplingSpec.add_arguments(parser, dataset=False, seq_len_default=None, batch_size_default=None)
    parser.add_argument(
        "--data-root", default=None, help="with --mixture: the folder the source names are in"
    )
    parser.add_argument(
        "--tokens",
        type=float,
        default=None,
        help="with --mixture: the run's token budget (1e12 is fine)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        metavar="FILE",
        help="a checkpoint (JSON or torch.save) holding a mixture loader's state_dict(): "
        "print its weight trajectory",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def open_store(args: argparse.Namespace) -> Any:
    """The store at args.path, any format (args.dtype for a folder of bare *.bin files)."""
    from tokenfeed.core.errors import InvalidArgument
    from tokenfeed.core.store import META_NAME, is_url
    from tokenfeed.core.store import open_store as open_any

    if is_url(args.path):
        from tokenfeed.core.store.objects import ObjectStore

        ObjectStore(args.path).check_access()  # exit 2 on bad credentials / no such bucket
    else:
        root = Path(args.path)
        if (
            args.dtype is None
            and root.is_dir()
            and not (root / META_NAME).exists()
            and any(root.glob("*.bin"))
        ):
            raise InvalidArgument(
                f"{root} has *.bin files but no meta.json: pass --dtype uint16 or --dtype uint32"
            )
    return open_any(args.path, dtype=args.dtype)


def _kind(store: Any) -> str:
    meta = store.meta
    if store.format == "seed":
        return "seed layout (save_to_disk chunk folders" + (
            ", with meta.json)" if store.has_meta else ", no meta.json)"
        )
    if store.format == "megatron":
        src = meta.source
        return (
            f"Megatron indexed dataset ({src['dtype']} tokens, {src['documents']} documents, "
            f"{src['sequences']} sequences)"
        )
    if meta.format_version is None:
        return (
            "Streaming-Dataloader meta.json"
            if meta.tokens_per_chunk is not None or meta.eos_token_id is not None
            else "bare *.bin files"
        )
    return f"tokenfeed v{meta.format_version}"


def _splits(args: argparse.Namespace, total: int) -> dict[str, Any]:
    from tokenfeed.core.request import SPLITS, SamplingSpec
    from tokenfeed.core.sampling import split_windows, steps_per_epoch

    spec = SamplingSpec.from_args(args, dataset=args.path, batch_size=args.batch_size or 1)
    rows = []
    for split in SPLITS:
        tokens, windows = split_windows(spec, total, split)
        row: dict[str, Any] = {"split": split, "tokens": tokens, "windows": windows}
        if args.batch_size:
            row["steps_per_epoch_rank0"] = steps_per_epoch(
                windows, spec.batch_size, spec.world_size, 0, split
            )
        rows.append(row)
    return {
        "seq_len": spec.seq_len,
        "stride": spec.stride,
        "split_rate": spec.split_rate,
        "shift": spec.shift,
        "splits": rows,
    }


def run(args: argparse.Namespace) -> int:
    if args.state is not None:
        return _state(args)
    if args.mixture or args.schedule:
        return _mixture(args)
    if args.path is None:
        from tokenfeed.core.errors import InvalidArgument

        raise InvalidArgument("give a store PATH, or --mixture with --data-root")
    store = open_store(args)
    meta = store.meta
    doc: dict[str, Any] = {
        "path": store.location,
        "format": _kind(store),
        "total_tokens": store.total_tokens,
        "chunks": store.num_chunks,
        "dtype": meta.dtype,
        "vocab_size": meta.vocab_size,
        "eos_token_id": meta.eos_token_id,
        "tokenizer": meta.tokenizer,
        "tokens_per_chunk": meta.tokens_per_chunk,
        "checksums": sum(1 for c in meta.chunks if c.checksum),
        "created_at_unix": meta.created_at_unix,
        "source": meta.source,
    }
    if args.seq_len is not None:
        doc["sampling"] = _splits(args, store.total_tokens)
    suggested = store.suggested_meta() if store.format == "seed" and not store.has_meta else None
    if suggested is not None:
        doc["meta_json_to_add"] = suggested
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    width = max(len(k) for k in doc)
    for key, value in doc.items():
        if key in ("sampling", "meta_json_to_add"):
            continue
        if key == "source":
            value = json.dumps(value) if value else "-"
            value = value if len(value) <= 200 else value[:197] + "..."
        print(f"{key:<{width}}  {'-' if value is None else value}")
    if "sampling" in doc:
        s = doc["sampling"]
        print(
            f"windows (seq_len {s['seq_len']}, stride {s['stride']}, shift {s['shift']}, "
            f"split_rate {s['split_rate']}):"
        )
        for row in s["splits"]:
            extra = (
                f", {row['steps_per_epoch_rank0']} steps/epoch"
                if "steps_per_epoch_rank0" in row
                else ""
            )
            print(
                f"  {row['split']:<10} {row['tokens']:>14} tokens {row['windows']:>12} "
                f"windows{extra}"
            )
    if suggested is not None:
        where = Path(store.location) / "meta.json"
        print(
            f"\nmeta.json to add at {where} (served as {meta.dtype} without EOS or "
            "vocabulary until you do; set eos_token_id, vocab_size, and dtype uint16 if the "
            "vocabulary fits 65,536 ids):"
        )
        print(json.dumps(suggested, indent=2))
    return 0


def _mixture(args: argparse.Namespace) -> int:
    """The budget of a mixture run: per source, what --tokens tokens draw from it."""
    from tokenfeed.core.errors import InvalidArgument, NotFound
    from tokenfeed.core.mixture.sampler import MixtureSampler
    from tokenfeed.core.request import SamplingSpec
    from tokenfeed.server.datasets import Catalog

    if args.path is not None:
        raise InvalidArgument("--mixture names datasets under --data-root; drop PATH")
    if args.data_root is None or args.seq_len is None or args.tokens is None:
        raise InvalidArgument("--mixture needs --data-root, --seq-len and --tokens")
    tokens = args.tokens
    if not (tokens >= 0 and tokens == int(tokens)):
        raise InvalidArgument(f"--tokens must be a whole number of tokens, got {tokens:g}")
    spec = SamplingSpec.from_args(args, batch_size=args.batch_size or 1)
    catalog = Catalog(args.data_root)  # every served format, local or s3://
    stores = []
    for name in spec.source_names:
        try:
            stores.append(catalog.get(name).store)
        except NotFound as e:
            raise NotFound(f"sources[{name!r}]: {e.message}") from None
    sampler = MixtureSampler(
        spec,
        tuple(s.total_tokens for s in stores),
        tuple(
            max(1, s.meta.tokens_per_chunk or max(c.tokens for c in s.meta.chunks)) for s in stores
        ),
    )
    budget = sampler.budget(int(tokens))
    segments = [{"from_tokens": lo, "to_tokens": hi} for lo, hi in budget.segments]
    doc: dict[str, Any] = {
        "tokens": budget.tokens,
        "windows": budget.positions,
        "seq_len": spec.seq_len,
        "segments": segments,
        "sources": [
            {
                "name": s.name,
                "train_tokens": t,
                "windows": s.windows,
                "windows_drawn": s.windows_drawn,
                "tokens_drawn": s.tokens_drawn,
                "passes": float(s.passes),
                "shares": s.share_floats,
            }
            for s, t in zip(budget.sources, sampler.train_tokens, strict=True)
        ],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"mixture of {len(stores)} sources over {budget.tokens:,} tokens = "
        f"{budget.positions:,} windows of {spec.seq_len} tokens"
    )
    heads = [f"share@{lo:.3g}" for lo, _ in budget.segments]
    width = max(6, *(len(n) for n in spec.source_names))
    print(
        f"{'source':<{width}} {'train tokens':>15} {'tokens drawn':>17} {'passes':>10}"
        + "".join(f" {h:>12}" for h in heads)
    )
    for s in doc["sources"]:
        print(
            f"{s['name']:<{width}} {s['train_tokens']:>15,} {s['tokens_drawn']:>17,} "
            f"{s['passes']:>10.3f}" + "".join(f" {x:>12.2%}" for x in s["shares"])
        )
    return 0


def _state(args: argparse.Namespace) -> int:
    """A saved mixture state's position and weight trajectory (and its mixer's)."""
    from tokenfeed.core.errors import InvalidArgument

    if args.path is not None or args.mixture or args.schedule:
        raise InvalidArgument("--state reads a checkpoint alone; drop PATH, --mixture, --schedule")
    found = _states(_load_checkpoint(args.state))
    loaders = [(where, s) for where, s in found if "mixture" in s and "offset" in s]
    mixers = [(where, s) for where, s in found if "policy" in s and "weights" in s]
    if not loaders:
        raise InvalidArgument(f"{args.state} holds no mixture loader's state_dict()")
    doc = {
        "loaders": [dict(at=where, **_trajectory(s)) for where, s in loaders],
        "mixers": [
            {
                "at": where,
                "policy": s["policy"],
                "updates": s.get("updates"),
                "weights": s["weights"],
            }
            for where, s in mixers
        ],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for one in doc["loaders"]:
        names = one["sources"]
        print(
            f"{one['at'] or 'state'}: step {one['step']}, offset {one['offset']} (windows), "
            f"{len(one['trajectory'])} segments ({one['runtime']} set at run time)"
        )
        width = max(8, *(len(n) for n in names))
        print(f"{'from_tokens':>16} {'':8}" + "".join(f" {n:>{width}}" for n in names))
        for seg in one["trajectory"]:
            print(
                f"{seg['from_tokens']:>16} {seg['kind']:8}"
                + "".join(f" {seg['weights'][n]:>{width}}" for n in names)
            )
    for m in doc["mixers"]:
        policy = m["policy"]
        kind = policy.get("policy", "?") + (f" ({policy['reward']})" if "reward" in policy else "")
        print(f"{m['at'] or 'mixer'}: {kind}, {m['updates']} updates")
    return 0


def _load_checkpoint(path: Path) -> Any:
    """A JSON document, or else a torch checkpoint (plain types only: weights_only)."""
    raw = path.read_bytes()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        pass
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{path} is not JSON; reading a torch checkpoint needs torch: "
            "pip install 'tokenfeed[torch]'"
        ) from None
    import io

    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a file that is not its own
        from tokenfeed.core.errors import InvalidArgument

        raise InvalidArgument(f"{path} is neither JSON nor a torch checkpoint: {e}") from None


def _states(doc: Any, where: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every dict in `doc` (depth first) with its key path, e.g. "loader"."""
    if not isinstance(doc, dict):
        return []
    out = [(where, doc)]
    for key, value in doc.items():
        out += _states(value, f"{where}.{key}" if where else str(key))
    return out


def _trajectory(state: dict[str, Any]) -> dict[str, Any]:
    """The segments in force of a loader state: declared and run-time, merged."""
    from tokenfeed.core.mixture import RuntimeSegments, merge
    from tokenfeed.core.mixture.spec import parse

    mixture = state["mixture"]
    names, declared = parse(mixture["sources"], [tuple(s) for s in mixture.get("schedule", [])])
    runtime = RuntimeSegments.from_state(len(names), mixture.get("runtime", []), "mixture.runtime")
    added = runtime.segments(names)
    ids = {id(s) for s in added}
    return {
        "step": state.get("step"),
        "offset": state.get("offset"),
        "sources": list(names),
        "runtime": len(added),
        "trajectory": [
            {
                "from_tokens": seg.from_tokens,
                "kind": "run-time" if id(seg) in ids else "base" if j == 0 else "schedule",
                "weights": {n: repr(float(w)) for n, w in zip(names, seg.weights, strict=True)},
            }
            for j, seg in enumerate(merge(declared, added))
        ],
    }
