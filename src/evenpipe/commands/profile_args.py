"""Reading a profile file for any command: ``--profile PATH`` (one-line errors, exit 2, for a missing file, another
schema version, a damaged file or another model)."""

from __future__ import annotations

import pathlib

from evenpipe.cost.profile import Profile, ProfileError

__all__ = ["load_profile"]


def load_profile(path: str | pathlib.Path, *, model: str | None = None, num_layers: int | None = None,
                 hidden: int | None = None) -> Profile:
    """The profile at ``path``; with ``model`` (and sizes), refuse a profile of another model."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ProfileError(f"profile {str(p)!r} does not exist (write one with `evenpipe profile --out {p}`)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile {str(p)!r} cannot be read: {e}") from None
    profile = Profile.from_json(text, where=f"profile {str(p)!r}")
    if model is not None:
        profile.check_model(model, num_layers=num_layers, hidden=hidden)
    return profile
