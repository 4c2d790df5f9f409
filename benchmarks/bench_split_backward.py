"""The zero-bubble split backward's graph analysis, side by side with an older version of the module.

    .venv/bin/python benchmarks/bench_split_backward.py --baseline OLD_split_backward.py [--repeats 5]
    # e.g. git show de9e581:src/evenpipe/runtime/split_backward.py > /tmp/old_split_backward.py

Before its engine call, ``backward_input`` (I) walks the stage's autograd graph to find the input path, the split
nodes and the parameter groups. This times that analysis (from the call until the engine starts) and the whole I
and W, for the last stage of gpt-mini at P=2 (4 blocks and the head with its loss input, micro-batch 4, seq 128),
alternating the current module and the baseline in one process, and checks both give the same gradients.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import torch


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_split_backward", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _time_one(sb: Any, stage: torch.nn.Module, params: list[torch.Tensor], x0: torch.Tensor
              ) -> tuple[float, float, float, list[torch.Tensor]]:
    """(analysis s, I s, W s, parameter gradients) of one I + W with module ``sb``."""
    engine = sb._engine
    started: list[float] = []

    def timed_engine(*a: Any, **k: Any) -> Any:
        started.append(time.perf_counter())
        return engine(*a, **k)
    sb._engine = timed_engine
    try:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        _, state = sb.backward_input([out], [g], [x], params)
        t1 = time.perf_counter()
        sb.backward_weight(state, params)
        t2 = time.perf_counter()
    finally:
        sb._engine = engine
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return started[0] - t0, t1 - t0, t2 - t1, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="an older split_backward.py to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from evenpipe.models import build_model, model_config
    from evenpipe.runtime import split_backward as new
    from evenpipe.runtime.stages import build_stage_modules
    old = _load(a.baseline)
    cfg = model_config("gpt-mini", seq_len=128)
    stage = build_stage_modules(build_model(cfg, seed=0).pipeline_parts(), num_stages=2, stages=[1])[1]
    params = [p for p in stage.parameters() if p.requires_grad]
    x0 = torch.randn(4, 128, cfg.hidden, generator=torch.Generator().manual_seed(0))
    rows: dict[str, list[tuple[float, float, float]]] = {"new": [], "baseline": []}
    for i in range(a.repeats + 1):
        for name, sb in (("new", new), ("baseline", old)) if i % 2 == 0 else (("baseline", old), ("new", new)):
            an, ti, tw, grads = _time_one(sb, stage, params, x0)
            if i == 0:
                rows.setdefault(name + "_grads", grads)  # type: ignore[arg-type]
            else:
                rows[name].append((an, ti, tw))
    for g_new, g_old in zip(rows["new_grads"], rows["baseline_grads"]):  # type: ignore[arg-type]
        torch.testing.assert_close(g_new, g_old)
    print(f"gpt-mini last stage of P=2 (4 blocks + head), micro-batch 4, seq 128, {len(params)} parameters; "
          f"median of {a.repeats} alternating runs; load {os.getloadavg()[0]:.2f}")
    med = {k: [statistics.median(v[j] for v in rows[k]) for j in range(3)] for k in ("new", "baseline")}
    for k in ("baseline", "new"):
        an, ti, tw = med[k]
        print(f"  {k:8s}  analysis {an * 1e3:7.1f} ms   I {ti * 1e3:7.1f} ms   W {tw * 1e3:7.1f} ms")
    print(f"  analysis baseline/new {med['baseline'][0] / med['new'][0]:.1f}x; I baseline/new "
          f"{med['baseline'][1] / med['new'][1]:.2f}x; same parameter gradients")


if __name__ == "__main__":
    main()
