"""`tokenfeed info --state FILE`: a saved mixture run's weight trajectory, from a JSON
state or a torch checkpoint (docs/mixtures.md, "Run-time weights")."""

from __future__ import annotations

import json
from pathlib import Path

from tokenfeed.cli import main
from tokenfeed.client import FeederClient
from tokenfeed.mixing import Bandit, OnlineMixer

SEQ = 4


def saved_run(path: Path) -> dict:
    """A loader that declared one later segment and made two changes at run time (one
    at that segment's from_tokens, which it replaces), with its mixer: no feeder needed
    outside an iteration."""
    ld = FeederClient(
        "127.0.0.1:1",
        mixture={"web": 0.7, "code": 0.3},
        schedule=[(40 * SEQ, {"web": 0.5, "code": 0.5}), (90 * SEQ, {"web": 0.9, "code": 0.1})],
        seq_len=SEQ,
        batch_size=2,
    )
    ld.load_state_dict({**ld.state_dict(), "offset": 10, "step": 5})
    ld.set_weights({"web": 0.25, "code": 0.75})  # from step 5: position 10
    ld.set_weights({"web": "0.1", "code": "0.9"}, at_step=20)  # position 40: replaces
    doc = {"data": ld.state_dict(), "mixer": OnlineMixer(ld, Bandit(), every=5).state_dict()}
    ld.close()
    path.write_text(json.dumps(doc))
    return doc


def test_the_trajectory_merges_declared_and_run_time_segments(tmp_path, capsys) -> None:
    saved_run(tmp_path / "state.json")
    assert main(["info", "--state", str(tmp_path / "state.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (loader,) = doc["loaders"]
    assert loader["at"] == "data"
    assert (loader["step"], loader["offset"], loader["runtime"]) == (5, 10, 2)
    assert loader["trajectory"] == [
        {"from_tokens": 0, "kind": "base", "weights": {"web": "0.7", "code": "0.3"}},
        {"from_tokens": 40, "kind": "run-time", "weights": {"web": "0.25", "code": "0.75"}},
        {"from_tokens": 160, "kind": "run-time", "weights": {"web": "0.1", "code": "0.9"}},
        {"from_tokens": 360, "kind": "schedule", "weights": {"web": "0.9", "code": "0.1"}},
    ]
    assert doc["mixers"][0]["policy"]["policy"] == "bandit"
    assert main(["info", "--state", str(tmp_path / "state.json")]) == 0
    text = capsys.readouterr().out
    assert "data: step 5, offset 10 (windows), 4 segments (2 set at run time)" in text
    assert "             160 run-time      0.1      0.9" in text
    assert "mixer: bandit (progress), 0 updates" in text


def test_a_torch_checkpoint_is_read_too(tmp_path, capsys) -> None:
    import torch

    doc = saved_run(tmp_path / "state.json")
    torch.save({"model": {"w": torch.zeros(2)}, **doc}, tmp_path / "ckpt.pt")
    assert main(["info", "--state", str(tmp_path / "ckpt.pt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loaders"][0]["runtime"] == 2


def test_a_file_without_a_mixture_state_is_an_error(tmp_path, capsys) -> None:
    (tmp_path / "other.json").write_text(json.dumps({"epoch": 0, "offset": 3}))
    assert main(["info", "--state", str(tmp_path / "other.json")]) == 2
    assert "holds no mixture loader's state_dict()" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"\x80not a checkpoint")
    assert main(["info", "--state", str(tmp_path / "junk.pt")]) == 2
    assert "neither JSON nor a torch checkpoint" in capsys.readouterr().err
