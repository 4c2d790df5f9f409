"""Where the planner's CPU goes: the search behind ``evenpipe plan --model gpt3-175b --gpu a100-80gb --gpus 1024
--global-batch 1536``, CPU seconds summed per step (bounds, model-state checks, memory, estimates and, inside them,
building and simulating the schedule). Nested steps overlap: ``build`` and ``sim`` are parts of ``estimate``.

Run: ``.venv/bin/python benchmarks/plan_split.py``; against another checkout,
``PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/plan_split.py`` (alternate the two for a ratio).
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any, Callable

from evenpipe.cost import hardware_preset, model_preset
from evenpipe.plan import search

SPENT: dict[str, float] = {}


def _timed(owner: Any, name: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.process_time() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    estimate_module = importlib.import_module("evenpipe.cost.estimate")
    for owner, name, label in [(search.Searcher, "lower_bound", "bound"), (search.Searcher, "estimate", "estimate"),
                               (search.Searcher, "peak_memory_gib", "peak memory"),
                               (search.Searcher, "_states_fit", "model states"),
                               (estimate_module, "build_cost_schedule", "build"), (estimate_module, "simulate", "sim")]:
        _timed(owner, name, label)
    t0 = time.process_time()
    result = search.Searcher(model_preset("gpt3-175b"), hardware_preset("a100-80gb")).search(
        num_gpus=1024, global_batch=1536, space=search.SearchSpace(), top_k=10)
    total = time.process_time() - t0
    parts = ", ".join(f"{k} {v:.2f}" for k, v in SPENT.items())
    print(f"load {os.getloadavg()[0]:.2f}: search CPU {total:.2f} s ({parts}); {result.stats.num_estimated} "
          f"simulated; best {result.best.config.describe()}")


if __name__ == "__main__":
    main()
