"""Complete or ignored: the manifest, the pruning plan and the fresh-directory refusal, on real files and on real
(small) DCP checkpoints saved by a world of one process."""

from __future__ import annotations

import logging
import os
import pathlib
import socket

import pytest
import torch
import torch.distributed as dist

from evenpipe.cli import main
from evenpipe.errors import ConfigError
from evenpipe.training.checkpoint import TrainState, load_checkpoint, newest_complete_checkpoint, save_checkpoint
from evenpipe.training.checkpoint_manifest import (MANIFEST, Manifest, check_fresh_directory, checksum_problem,
                                                   file_entry, prune_plan, read_manifest, size_problem,
                                                   step_directories)
from evenpipe.training.checkpoint_state import checkpoint_target
from evenpipe.training.params import RankParameters

S = {n: f"step_{n:08d}" for n in range(0, 20, 2)}


@pytest.mark.parametrize("names,saved,keep,replaced,drop", [
    ([S[2], S[4], S[6]], S[6], 2, [], [S[2]]),                    # the usual: keep the newest two
    ([S[8], S[10], S[2]], S[2], 2, [], []),                       # another run's newer ones stay, ours stays
    ([S[8], S[10], S[2], S[4]], S[4], 1, [], [S[2]]),             # keep 1: only what is no newer than the save
    ([S[8], S[10], S[2]], S[2], 2, [S[8], S[10], S[2]], [S[10], S[8]]),  # overwrite: the earlier run's go
    ([S[2]], S[2], 1, [], []),                                     # never the one just saved
])
def test_prune_plan(names: list[str], saved: str, keep: int, replaced: list[str], drop: list[str]) -> None:
    assert sorted(prune_plan(names, saved=saved, keep=keep, replaced=replaced)) == sorted(drop)


def _files(tmp: pathlib.Path) -> Manifest:
    (tmp / "a.distcp").write_bytes(b"x" * 1000)
    (tmp / ".metadata").write_bytes(b"meta" * 10)
    return Manifest(step=3, world={"world": 1}, files=(file_entry(str(tmp), "a.distcp"),
                                                       file_entry(str(tmp), ".metadata")))


def test_manifest_round_trip_and_damage_found(tmp_path: pathlib.Path) -> None:
    manifest = _files(tmp_path)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert size_problem(str(tmp_path), manifest) is None
    assert checksum_problem(str(tmp_path), manifest.files) is None
    (tmp_path / "a.distcp").write_bytes(b"x" * 999 + b"y")  # same size, other content
    assert size_problem(str(tmp_path), manifest) is None
    assert "a.distcp has a different checksum" in str(checksum_problem(str(tmp_path), manifest.files))
    with open(tmp_path / ".metadata", "r+b") as f:
        f.truncate(7)
    assert size_problem(str(tmp_path), manifest) == ".metadata has 7 bytes where the manifest says 40"
    os.remove(tmp_path / "a.distcp")
    assert size_problem(str(tmp_path), manifest) == "a.distcp is missing"


def test_read_manifest_says_why_not(tmp_path: pathlib.Path) -> None:
    assert read_manifest(str(tmp_path))[1] == f"it has no {MANIFEST} (the save did not finish)"
    (tmp_path / MANIFEST).write_text("{not json")
    assert read_manifest(str(tmp_path))[0] is None and "unreadable" in read_manifest(str(tmp_path))[1]


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path: pathlib.Path) -> None:
    check_fresh_directory(str(tmp_path / "none"), resume=False, overwrite=False)
    (tmp_path / S[4]).mkdir()
    (tmp_path / ".tmp-step_00000006").mkdir()
    assert step_directories(str(tmp_path)) == [S[4]]
    with pytest.raises(ConfigError, match="--overwrite-checkpoints"):
        check_fresh_directory(str(tmp_path), resume=False, overwrite=False)
    check_fresh_directory(str(tmp_path), resume=True, overwrite=False)
    check_fresh_directory(str(tmp_path), resume=False, overwrite=True)


def test_cli_refuses_a_fresh_run_in_a_used_directory(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import evenpipe.training.launch as launch
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / S[4]).mkdir()
    assert main(["train", "--checkpoint-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds checkpoints (step_00000004)" in err, err
    assert main(["train", "--checkpoint-dir", str(tmp_path), "--resume", "--overwrite-checkpoints"]) == 2


@pytest.fixture()
def world_of_one() -> object:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _job(seed: int) -> tuple[RankParameters, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    params = RankParameters(named=dict(model.named_parameters()), owned=frozenset(n for n, _ in
                                                                                  model.named_parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return params, opt


def _save(d: pathlib.Path, step: int, params: RankParameters, opt: torch.optim.Optimizer, **kw: object) -> str:
    return save_checkpoint(str(d), target=checkpoint_target(params, opt), state=TrainState(step=step, samples=4 * step),
                           keep=int(kw.pop("keep", 2)), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("which", [".metadata", ".distcp"])
def test_damaged_newest_falls_back_to_the_previous_complete(tmp_path: pathlib.Path, world_of_one: object,
                                                            caplog: pytest.LogCaptureFixture, which: str) -> None:
    params, opt = _job(0)
    _save(tmp_path, 2, params, opt)
    want = {n: p.detach().clone() for n, p in params.named.items()}
    with torch.no_grad():
        for p in params.named.values():
            p.add_(1.0)
    newest = _save(tmp_path, 4, params, opt)
    assert read_manifest(newest)[0].step == 4 and newest_complete_checkpoint(str(tmp_path)) == newest
    name = sorted(f for f in os.listdir(newest) if f.endswith(which))[0]
    size = os.path.getsize(os.path.join(newest, name))
    with open(os.path.join(newest, name), "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="evenpipe.train"):
        found = newest_complete_checkpoint(str(tmp_path))
    assert found == str(tmp_path / S[2])
    assert [r.getMessage() for r in caplog.records if r.name == "evenpipe.train"] == [
        f"skipping damaged checkpoint {newest}: {name} has {size // 2} bytes where the manifest says {size}"]
    other, opt2 = _job(1)
    assert load_checkpoint(found, target=checkpoint_target(other, opt2)) == TrainState(step=2, samples=8)
    for n, p in other.named.items():
        assert torch.equal(p, want[n]), n


def test_incomplete_and_latest_are_ignored(tmp_path: pathlib.Path, world_of_one: object) -> None:
    params, opt = _job(0)
    _save(tmp_path, 2, params, opt)
    newest = _save(tmp_path, 4, params, opt)
    os.remove(os.path.join(newest, MANIFEST))  # as if killed before the manifest
    (tmp_path / "latest").write_text("step_00000099\n")
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / S[2])
    os.remove(tmp_path / "latest")
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / S[2])


def test_pruning_keeps_what_was_saved_and_newer_complete_ones(tmp_path: pathlib.Path, world_of_one: object) -> None:
    params, opt = _job(0)
    for step in (6, 8):  # an earlier, longer run
        _save(tmp_path, step, params, opt)
    _save(tmp_path, 2, params, opt, keep=1)
    assert step_directories(str(tmp_path)) == [S[8], S[6], S[2]]
    _save(tmp_path, 4, params, opt, keep=1, replaced=[S[8], S[6], S[2]])  # --overwrite-checkpoints
    assert step_directories(str(tmp_path)) == [S[4]]
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / S[4])


def _bf16_job(seed: int) -> tuple[RankParameters, object]:
    from evenpipe.runtime.precision import MasterWeightOptimizer
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    params = RankParameters(named=dict(model.named_parameters()), owned=frozenset(n for n, _ in
                                                                                  model.named_parameters()))
    opt = MasterWeightOptimizer(torch.optim.AdamW, list(params.named.values()), lr=0.1)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return params, opt


def test_bf16_saves_its_fp32_masters_and_any_dtype_loads_them(tmp_path: pathlib.Path, world_of_one: object) -> None:
    params, opt = _bf16_job(0)
    masters = {n: m.detach().clone() for n, m in zip(params.named, opt.masters.params)}  # type: ignore[attr-defined]
    moments = [opt.inner.state[m]["exp_avg"].clone() for m in opt.masters.params]  # type: ignore[attr-defined]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters.values(), params.named.values()))
    path = _save(tmp_path, 2, params, opt)
    other, opt2 = _bf16_job(1)
    load_checkpoint(path, target=checkpoint_target(other, opt2))
    for (name, p), m, moment in zip(other.named.items(), opt2.masters.params, moments):  # type: ignore[attr-defined]
        assert torch.equal(m, masters[name]) and torch.equal(p, masters[name].to(torch.bfloat16)), name
        assert torch.equal(opt2.inner.state[m]["exp_avg"], moment), name  # type: ignore[attr-defined]
    fp32, opt3 = _job(2)  # the same weights in a float32 job: the masters, exactly
    load_checkpoint(path, target=checkpoint_target(fp32, opt3))
    assert all(torch.equal(p, masters[n]) for n, p in fp32.named.items())
