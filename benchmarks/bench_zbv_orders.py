"""Simulated step of evenpipe's zb-v order against torch's ScheduleZBVZeroBubble order, on the same costs.

Issue 12: paired on this CPU, evenpipe's zb-v ran 2-3% slower than torch's (gpt-mini, P=2) with the same
per-action CPU. Both orders are imported into the IR here (torch's through its schedule visualizer, see
``evenpipe.runtime.torch_orders``), given the same stage costs and simulated, so the difference in the orders
themselves is seen without the host's noise. Costs per stage: forward ``f``, input gradient ``i``, weight
gradient ``w``; with ``--first-stage-i0`` stage 0's ``I`` is empty and its ``W`` the whole backward, as the
runtime runs the stage whose input is tokens. Until 2026-12-02 evenpipe's zb-v was a unit-time list schedule
planned with durations (1, 1, 1) (up to 42% longer than torch's order here); it is now ZB-V's fixed pattern
(:mod:`evenpipe.schedule.generate.zb_v`), and the last column is v-min's matched-duration plan for reference.

    .venv/bin/python benchmarks/bench_zbv_orders.py
    .venv/bin/python benchmarks/bench_zbv_orders.py --profile profile.json   # also the profile's own costs
"""

from __future__ import annotations

import argparse
import sys

from evenpipe.schedule import derive_communication
from evenpipe.schedule.build import build_schedule
from evenpipe.schedule.ir import Schedule
from evenpipe.schedule.validate import validate
from evenpipe.sim import SimCosts, StageCosts, simulate

CASES = (  # (label, f, i, w, stage 0's I empty)
    ("uniform", 1.0, 1.0, 1.0, False),
    ("uniform, stage 0 I=0", 1.0, 1.0, 1.0, True),
    ("I 1.3 W 0.7, stage 0 I=0", 1.0, 1.3, 0.7, True),
    ("I 1.5 W 0.5, stage 0 I=0", 1.0, 1.5, 0.5, True),
    ("F 1.5, stage 0 I=0", 1.5, 1.0, 1.0, True),
)


def _costs(schedule: Schedule, f: float, i: float, w: float, first_i0: bool) -> SimCosts:
    stages = [StageCosts(forward=f, backward_input=0.0 if first_i0 and s == 0 else i,
                         backward_weight=i + w if first_i0 and s == 0 else w, activation_bytes=1.0,
                         weight_grad_bytes=1.0 if first_i0 and s == 0 else 0.5)
              for s in range(schedule.num_stages)]
    return SimCosts.from_stages(stages)


def _torch_order(p: int, m: int) -> Schedule:
    from evenpipe.runtime.torch_orders import torch_compute_order  # imports torch
    full = derive_communication(torch_compute_order("zbvzerobubble", num_ranks=p, num_microbatches=m))
    validate(full)
    return full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4,8", help="pipeline sizes P (M = 4P)")
    ap.add_argument("--profile", default=None, help="also simulate with this profile's costs (P=2, M=8, b=1)")
    args = ap.parse_args(argv)
    print(f"{'P':>2s} {'M':>3s}  {'costs':26s} {'torch zbv':>9s} {'evenpipe zb-v':>14s} {'torch/ours':>11s}")
    for p in (int(x) for x in args.stages.split(",")):
        m = 4 * p
        theirs = _torch_order(p, m)
        default = build_schedule("zb-v", num_ranks=p, num_microbatches=m)
        for label, f, i, w, first_i0 in CASES:
            t, d = (simulate(s, _costs(s, f, i, w, first_i0)).step_time for s in (theirs, default))
            print(f"{p:2d} {m:3d}  {label:26s} {t:9.2f} {d:14.2f} {t / d:11.3f}")
    if args.profile:
        from evenpipe.cost.profile import Profile
        from evenpipe.cost.profile_fit import ProfileModel, predict_step
        with open(args.profile) as fh:
            model = ProfileModel(Profile.from_json(fh.read(), where=args.profile))
        layers = model.profile.model.num_layers
        layout = (layers // 4,) * 4 if layers % 4 == 0 else None
        for b in model.profile.microbatch_sizes:
            t, d = (predict_step(model, s, microbatch_size=b, layout=layout).step_time
                    for s in (_torch_order(2, 8), build_schedule("zb-v", num_ranks=2, num_microbatches=8)))
            print(f"profile {model.profile.model.name}, P=2 M=8 b={b}: torch {t * 1e3:.1f} ms, ours {d * 1e3:.1f} ms, "
                  f"torch/ours {t / d:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
