"""A job's temporary directory: owned by its launcher, removed when the job ends, and removed by the next launch
when the launcher that owned it is dead (killed by SIGKILL); a live owner's directory is kept."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from evenpipe.training.jobdir import JOB_DIR_PREFIX, LauncherLink, job_directory, remove_stale_job_dirs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _job(parent: pathlib.Path, name: str, owner: str | None) -> pathlib.Path:
    d = parent / f"{JOB_DIR_PREFIX}{name}"
    (d / "status").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if owner is not None:
        (d / "owner").write_text(owner)
    return d


def test_stale_job_dirs_of_dead_launchers_go_and_others_stay(tmp_path: pathlib.Path) -> None:
    dead = _job(tmp_path, "dead", f"{_dead_pid()}\n")
    live = _job(tmp_path, "live", f"{os.getpid()}\n")
    unowned = _job(tmp_path, "unowned", None)
    reused = _job(tmp_path, "reused", f"{os.getpid()} 1\n")  # this pid, another start time: a reused pid
    other = tmp_path / "not-a-job"
    other.mkdir()
    (other / "owner").write_text(f"{_dead_pid()}\n")
    assert sorted(remove_stale_job_dirs(str(tmp_path))) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert live.exists() and unowned.exists() and other.exists()


def test_job_directory_is_owned_then_removed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    stale = _job(tmp_path, "stale", f"{_dead_pid()}\n")
    with job_directory() as path:
        assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(JOB_DIR_PREFIX)
        assert not stale.exists()
        assert int(pathlib.Path(path, "owner").read_text().split()[0]) == os.getpid()
        assert remove_stale_job_dirs(str(tmp_path)) == []
    assert not os.path.exists(path)


def test_a_worker_sees_its_launcher_gone() -> None:
    assert not LauncherLink(pid=os.getppid()).gone()
    assert LauncherLink(pid=_dead_pid()).gone()
