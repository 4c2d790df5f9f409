"""Output paths checked before any work: a command that will write a file or a folder says at once, in one line,
when it cannot (a folder that is a file, a path under a file, a folder it may not write in), instead of failing
with a traceback after minutes of simulating, measuring or training.

A check writes nothing that stays: it creates and removes one probe file in the nearest existing folder, the only
test of writability that holds for every user (root included) and every file system (read-only, ``/proc``).
"""

from __future__ import annotations

import os

from evenpipe.errors import ConfigError

__all__ = ["check_output_file", "check_output_dir", "check_picture_file", "PICTURE_FORMATS"]

PICTURE_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "pgf")
"""File extensions matplotlib writes (a name without one is written as PNG)."""


def _nearest_existing(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists (as anything)."""
    here = os.path.abspath(path)
    while not os.path.lexists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return here


def _probe(folder: str, flag: str, path: str) -> None:
    """ConfigError unless a file can be created in ``folder``."""
    import tempfile  # here: only a run that writes files probes (tempfile imports random)

    try:
        fd, name = tempfile.mkstemp(prefix=".evenpipe-probe-", dir=folder)
    except OSError as e:
        raise ConfigError(f"{flag} {path!r}: cannot write in {folder!r} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)


def _check_folder(folder: str, flag: str, path: str, *, create: bool) -> None:
    """``folder`` exists as a writable folder, or (``create``) can be created under one."""
    base = _nearest_existing(folder)
    if not os.path.isdir(base):
        raise ConfigError(f"{flag} {path!r} is under {base!r}, which is a file, not a folder")
    if base != os.path.abspath(folder) and not create:
        raise ConfigError(f"{flag} {path!r}: folder {folder!r} does not exist; create it first")
    _probe(base, flag, path)


def check_output_file(path: str | None, flag: str, *, create_folders: bool = False) -> None:
    """ConfigError (one line) unless a file can be written at ``path`` (nothing when None): not a folder, in a
    writable folder (which may be missing if the writer creates it: ``create_folders``)."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a folder; give a file path")
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path!r} exists and is not writable")
    _check_folder(os.path.dirname(os.path.abspath(path)), flag, path, create=create_folders)


def check_output_dir(path: str | None, flag: str) -> None:
    """ConfigError (one line) unless ``path`` is a writable folder or can be created as one (nothing when None)."""
    if not path:
        return
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a file, not a folder")
    _check_folder(path, flag, path, create=True)


def check_picture_file(path: str | None, flag: str, *, create_folders: bool = False) -> None:
    """:func:`check_output_file`, and the extension names a format matplotlib writes."""
    if not path:
        return
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext and ext not in PICTURE_FORMATS:
        raise ConfigError(f"{flag} {path!r}: unknown picture format {ext!r}; use one of {', '.join(PICTURE_FORMATS)}")
    check_output_file(path, flag, create_folders=create_folders)
