"""torch 2.13's own schedule classes against evenpipe's generators under the same costs: step time and peak
activation memory side by side (the simulator; no GPU needed).

Run: ``.venv/bin/python benchmarks/bench_torch_orders.py``. torch's orders come from its schedule visualizer
(:mod:`evenpipe.runtime.torch_orders`); both sides get the same derived communication and the same costs.
Peaks are the largest rank's, in activation units of a whole rank's layers.
"""

from __future__ import annotations

import os

from evenpipe.runtime.torch_orders import TorchSchedule, torch_compute_order
from evenpipe.schedule import Schedule, build_schedule, derive_communication, validate
from evenpipe.schedule.build import plan_durations_for
from evenpipe.sim import SimCosts, simulate

PAIRS = [  # (torch class, evenpipe family it is compared with)
    (TorchSchedule.ZBV_ZERO_BUBBLE, "zb-v"),
    (TorchSchedule.DUALPIPE_V, "dualpipev"),
    (TorchSchedule.INTERLEAVED_ZERO_BUBBLE, "zb-v"),
    (TorchSchedule.INTERLEAVED_1F1B, "interleaved"),
]
COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0)]  # (F, B = input gradient, W) per rank's layers


def _sim(schedule: Schedule, f: float, b: float, w: float) -> tuple[float, float]:
    costs = SimCosts.uniform(num_stages=schedule.num_stages, num_chunks=schedule.num_chunks, forward=f, backward=b,
                             weight=w, weight_grad_bytes=1.0)
    trace = simulate(schedule, costs)
    return trace.step_time, max(trace.peak_activations)


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; free links, M = 4P, "
          "I keeps a micro-batch's activations until its W")
    print(f"{'torch class':<22} {'evenpipe':<12} {'P':>2} {'F,B,W':<9} {'torch step':>10} {'ours step':>9} "
          f"{'ratio':>6} {'torch peak':>10} {'ours peak':>9}")
    for which, family in PAIRS:
        for p in (4, 8):
            m = 4 * p
            theirs = derive_communication(torch_compute_order(which, num_ranks=p, num_microbatches=m))
            validate(theirs)
            for f, b, w in COSTS:
                ours = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=2,
                                      plan_durations=plan_durations_for(f, b, w))
                ts, tp = _sim(theirs, f, b, w)
                os_, op = _sim(ours, f, b, w)
                print(f"{which.value:<22} {family:<12} {p:>2} {f:g},{b:g},{w:g}{'':<4} {ts:>10.2f} {os_:>9.2f} "
                      f"{os_ / ts:>6.3f} {tp:>10.2f} {op:>9.2f}")


if __name__ == "__main__":
    main()
