"""What makes a checkpoint directory *complete*: a manifest written last, and the checks that read it.

A checkpoint ``<dir>/step_<N>`` is complete when its ``manifest.json`` exists and every file it lists has the
listed size and CRC-32. The manifest is written after every rank's files and DCP's ``.metadata`` are on disk,
and before the directory is renamed from ``.tmp-step_<N>``, so a directory without one was never finished (or
predates manifests) and one whose files disagree with it was damaged afterwards. Anything else is ignored: resume
takes the newest complete checkpoint, whatever ``latest`` says. No torch here: plain files only.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

from evenpipe.errors import ConfigError

__all__ = ["MANIFEST", "FileEntry", "Manifest", "checkpoint_name", "checkpoint_step", "step_directories",
           "file_entry", "write_manifest", "read_manifest", "size_problem", "checksum_problem",
           "check_fresh_directory", "prune_plan"]

MANIFEST = "manifest.json"
"""File name of the manifest inside a checkpoint directory."""
_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint."""

    name: str
    """Path relative to the checkpoint directory."""
    size: int
    """Bytes."""
    crc32: int
    """zlib CRC-32 of the whole file."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """The record that marks a checkpoint complete."""

    step: int
    """Optimizer steps done when it was saved."""
    world: dict[str, int]
    """The saving job's layout: ``{"world", "pp", "dp", "tp"}`` and whatever else the saver records."""
    files: tuple[FileEntry, ...]
    """Every file the save wrote (the manifest excepted)."""

    def to_json(self) -> str:
        files = [{"name": f.name, "size": f.size, "crc32": f.crc32} for f in self.files]
        return json.dumps({"format": _FORMAT, "step": self.step, "world": self.world, "files": files}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        return cls(step=int(raw["step"]), world=dict(raw["world"]),
                   files=tuple(FileEntry(name=str(f["name"]), size=int(f["size"]), crc32=int(f["crc32"]))
                               for f in raw["files"]))


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` steps."""
    return f"step_{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a ``step_<N>`` directory name, else None."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_directories(directory: str) -> list[str]:
    """Names of the ``step_<N>`` directories in ``directory``, newest (highest step) first."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    found = [(s, e) for e in entries if (s := checkpoint_step(e)) is not None
             and os.path.isdir(os.path.join(directory, e))]
    return [e for _, e in sorted(found, reverse=True)]


def file_entry(directory: str, name: str) -> FileEntry:
    """Size and CRC-32 of ``directory/name``."""
    crc, size = 0, 0
    with open(os.path.join(directory, name), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileEntry(name=name, size=size, crc32=crc)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write ``manifest`` into ``directory`` atomically (a temporary file, fsync, rename)."""
    tmp = os.path.join(directory, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def read_manifest(path: str) -> tuple[Manifest | None, str]:
    """The manifest of checkpoint ``path``, or None and why not (one phrase)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return Manifest.from_json(f.read()), ""
    except FileNotFoundError:
        return None, f"it has no {MANIFEST} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its {MANIFEST} is unreadable ({type(e).__name__})"


def size_problem(path: str, manifest: Manifest) -> str | None:
    """The first file of ``path`` missing or of the wrong size (one phrase), or None: a cheap check."""
    for entry in manifest.files:
        try:
            size = os.path.getsize(os.path.join(path, entry.name))
        except OSError:
            return f"{entry.name} is missing"
        if size != entry.size:
            return f"{entry.name} has {size} bytes where the manifest says {entry.size}"
    return None


def checksum_problem(path: str, entries: Iterable[FileEntry]) -> str | None:
    """The first of ``entries`` whose content differs from its CRC-32 (one phrase), or None."""
    for entry in entries:
        try:
            got = file_entry(path, entry.name)
        except OSError as e:
            return f"{entry.name} cannot be read ({e.strerror})"
        if got.size != entry.size:
            return f"{entry.name} has {got.size} bytes where the manifest says {entry.size}"
        if got.crc32 != entry.crc32:
            return f"{entry.name} has a different checksum than the manifest records"
    return None


def check_fresh_directory(directory: str | None, *, resume: bool, overwrite: bool) -> None:
    """Refuse (ConfigError) a job that would start at step 0 in a directory holding checkpoints, unless it
    resumes from them or was told to overwrite them."""
    if directory is None or resume or overwrite:
        return
    found = step_directories(directory)
    if found:
        raise ConfigError(f"--checkpoint-dir {directory} already holds checkpoints ({', '.join(found[:3])}"
                          f"{', ...' if len(found) > 3 else ''}); pass --resume to continue from them or "
                          "--overwrite-checkpoints to replace them")


def prune_plan(names: Sequence[str], *, saved: str, keep: int, replaced: Iterable[str] = ()) -> list[str]:
    """The ``step_<N>`` directories to delete after saving ``saved``: of those no newer than it, all but the
    newest ``keep`` (``saved`` among them); never ``saved`` nor a newer one. ``replaced`` (checkpoints of an
    earlier run this job overwrites) go too, whatever their step."""
    limit = checkpoint_step(saved)
    assert limit is not None, saved
    older = sorted((s, n) for n in names if (s := checkpoint_step(n)) is not None and s <= limit and n != saved)
    drop = [n for _, n in older[:max(0, len(older) - (keep - 1))]]
    gone = set(replaced) - {saved}
    return sorted(set(drop) | {n for n in names if n in gone})
