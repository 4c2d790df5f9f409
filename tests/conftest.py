"""Suite-wide rule for how ``pytest -n 2 --dist loadgroup`` (``make test``) shares the two cores.

The multi-process worlds (everything under ``tests/distributed``) are one work unit, run in order on one worker
(two worlds at once would overload the cores their timeouts are sized for); every other file is a unit of its
own (its module-scoped fixtures are built once), spread over the workers while the worlds run. (xdist's own
``xdist_group`` marks are not honoured under pytest 9, which ignores the node-id suffix they rely on, so the
grouping is a scheduler of our own.)"""

from __future__ import annotations

from typing import Any

import pytest

WORLDS = "tests/distributed/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorldsTogether(LoadScopeScheduling):  # type: ignore[misc]
        """One unit for the worlds, one per file for the rest (the largest unit is handed out first)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return WORLDS if path.startswith(WORLDS) else path

    return WorldsTogether(config, log)
