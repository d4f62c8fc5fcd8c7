"""A feeder keeps the mixtures it opened (server/opened.py): the next stream of the same
sources reuses them, and never a store after its replacement. Real feeders on
loopback, real stores rewritten, re-linked and removed under them.

Each source's token i is i + its offset, so every row says which store it came from.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.core.mixture.passes import PassOrders
from tokenfeed.core.store import write_store
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import feeder_params, running_feeder
from support.tenants import JOBS, bearer, write_tokens_file

SEQ, B = 16, 4


def write(path: Path, total: int, offset: int) -> Path:
    tokens = (np.arange(total) + offset).astype("uint32")
    write_store(path, tokens, dtype="uint32", tokens_per_chunk=500)
    return path


def mixture(
    *names: str, seed: int = 3, world_size: int = 1, segments: int = 0
) -> pb.SamplingParams:
    params = feeder_params(
        dataset="", seq_len=SEQ, stride=SEQ, batch_size=B, seed=seed, world_size=world_size
    )
    params.shuffle = True
    for i, name in enumerate(names):
        params.sources.add(name=name, weight=1.0 + i)
    for j in range(segments):  # a weight schedule: new weights every 64 tokens
        seg = params.schedule.add(from_tokens=64 * (j + 1))
        for i, name in enumerate(names):
            seg.weights.add(name=name, weight=1.0 + (i + j) % 5)
    return params


def stream(
    address: str, params: pb.SamplingParams, batches: int = 8, rank: int = 0, metadata=None
) -> list[pb.Batch]:
    """The first `batches` batches of `rank`'s stream."""
    got: list[pb.Batch] = []
    with grpc.insecure_channel(address) as channel:
        request = pb.StreamBatchesRequest(params=params, rank=rank)
        call = pb_grpc.FeederStub(channel).StreamBatches(request, metadata=metadata)
        for message in call:
            got += message.batches
            if len(got) >= batches:
                call.cancel()
                break
    return got[:batches]


def rows_of(batches: list[pb.Batch], offsets: list[int]) -> None:
    """Every row is its window in the store of that source with those offsets."""
    for b in batches:
        rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
        want = np.array(b.starts)[:, None] + np.arange(b.cols)
        want += np.array(offsets, dtype=np.int64)[np.array(b.sources)][:, None]
        np.testing.assert_array_equal(rows, want)


def kept_space(feeder, names: tuple[str, ...]):
    """The token space the feeder keeps for a mixture of `names` (None if not kept)."""
    kept = feeder.server.service.mixtures._kept.get(names)
    return None if kept is None else kept.space


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Sources a (tokens from 0) and b (from 1,000,000)."""
    write(tmp_path / "root" / "a", 6_000, 0)
    write(tmp_path / "root" / "b", 3_000, 1_000_000)
    return tmp_path / "root"


def opened(feeder) -> pb.SamplingParams:
    """A mixture of a and b streamed once (its rows checked): its params."""
    params = mixture("a", "b")
    rows_of(stream(feeder.address, params), [0, 1_000_000])
    return params


def test_the_next_open_reuses_a_kept_mixture_and_serves_the_same_rows(root: Path) -> None:
    with running_feeder(root) as feeder:
        params = opened(feeder)
        space = kept_space(feeder, ("a", "b"))
        assert space is not None
        first = stream(feeder.address, params)
        again = stream(feeder.address, params)
        assert kept_space(feeder, ("a", "b")) is space
        assert [b.SerializeToString() for b in again] == [b.SerializeToString() for b in first]


def test_a_source_rewritten_under_a_running_feeder_is_served_from_its_new_store(
    root: Path,
) -> None:
    with running_feeder(root) as feeder:
        params = opened(feeder)
        before = kept_space(feeder, ("a", "b"))
        # b replaced by a store of other tokens and size, as a writer replaces one
        shutil.rmtree(root / "b")
        write(root / "b", 4_000, 2_000_000)
        after = stream(feeder.address, params, batches=40)
        rows_of(after, [0, 2_000_000])
        assert any(s == 1 for b in after for s in b.sources)  # b's rows came, new ones
        assert kept_space(feeder, ("a", "b")) is not before


def test_a_source_whose_link_is_re_pointed_is_served_from_the_new_target(root: Path) -> None:
    (root / "b").rename(root / "b1")
    os.symlink("b1", root / "b")
    write(root / "b2", 3_000, 2_000_000)
    with running_feeder(root) as feeder:
        params = opened(feeder)
        tmp_link = root / "b.new"
        os.symlink("b2", tmp_link)
        tmp_link.replace(root / "b")  # re-pointed in one rename
        rows_of(stream(feeder.address, params, batches=40), [0, 2_000_000])


def test_a_source_removed_is_not_found_naming_it(root: Path) -> None:
    with running_feeder(root) as feeder:
        params = opened(feeder)
        shutil.rmtree(root / "b")
        with pytest.raises(grpc.RpcError) as e:
            stream(feeder.address, params)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details().startswith("sources['b']: no dataset 'b'")


def test_a_job_of_a_narrower_grant_is_judged_at_every_open(tmp_path: Path) -> None:
    """A mixture kept from the open of a job that may read everything is no pass for
    a job whose grant leaves a source out."""
    root = tmp_path / "root"
    write(root / "web" / "en", 6_000, 0)
    write(root / "code", 3_000, 1_000_000)
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    with running_feeder(root, tokens_file=tokens) as feeder:
        params = mixture("web/en", "code")
        rows_of(stream(feeder.address, params, metadata=bearer("eval")), [0, 1_000_000])
        assert kept_space(feeder, ("web/en", "code")) is not None
        with pytest.raises(grpc.RpcError) as e:  # ablation may read web/en only
            stream(feeder.address, params, metadata=bearer("ablation"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "sources['code']: job 'ablation' may not read dataset 'code'" in e.value.details()
        rows_of(stream(feeder.address, params, metadata=bearer("pretrain")), [0, 1_000_000])


def test_ranks_streaming_together_share_one_sampler_and_each_gets_its_own_rows(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    names = [f"s{i}" for i in range(12)]
    for i, name in enumerate(names):
        write(root / name, 2_000 + 300 * i, 1_000_000 * i)
    offsets = [1_000_000 * i for i in range(len(names))]
    world = 4
    # a large request (12 x 401 weights): every rank's parses to one spec
    params = mixture(*names, world_size=world, segments=400)
    with running_feeder(root) as feeder:
        alone = [stream(feeder.address, params, 30, rank) for rank in range(world)]
    with running_feeder(root) as feeder:
        together: list[list[pb.Batch]] = [[] for _ in range(world)]

        def read(rank: int) -> None:
            together[rank] = stream(feeder.address, params, 30, rank)

        threads = [threading.Thread(target=read, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        kept = feeder.server.service.mixtures._kept[tuple(names)]
        assert len(kept.samplers) == 1  # one sampler served every rank
    for rank in range(world):
        rows_of(together[rank], offsets)
        assert [b.SerializeToString() for b in together[rank]] == [
            b.SerializeToString() for b in alone[rank]
        ]


def test_pass_orders_shared_by_threads_map_as_one_each() -> None:
    """Threads mapping items through one PassOrders (its caches filled and cleared as
    they go) get what a PassOrders of their own gives."""
    k = 40
    windows = [50 + 7 * i for i in range(k)]
    args = (windows, [4] * k, 3, list(range(100, 100 + k)), True)
    shared = PassOrders(*args)
    shared._CACHE = 64  # cleared often: the race a lock must keep out
    rng = np.random.default_rng(0)
    calls = []
    for _ in range(8):
        src = rng.integers(0, k, 3_000)
        epoch = rng.integers(0, 20, 3_000)
        pos = rng.integers(0, np.array(windows)[src])
        calls.append((src, epoch, pos))
    want = [PassOrders(*args).windows(*c) for c in calls]
    got: list[list[np.ndarray]] = [[] for _ in calls]

    def run(n: int) -> None:
        for _ in range(20):
            got[n].append(shared.windows(*calls[n]))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for n, w in enumerate(want):
        assert len(got[n]) == 20
        for g in got[n]:
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("bad", ["x\x00y", "../a", "/etc"])
def test_a_bad_source_name_is_invalid_argument_naming_it(root: Path, bad: str) -> None:
    with running_feeder(root) as feeder:
        opened(feeder)
        with pytest.raises(grpc.RpcError) as e:
            stream(feeder.address, mixture("a", bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"sources[{bad!r}]: ")
