"""``train --predict``'s measured side: the slowest rank's step, each step after the first, and their median."""

from __future__ import annotations

import pathlib
import statistics
import sys

from evenpipe.plan.predict import predicted_run
from evenpipe.schedule import build_schedule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cost"))
from test_profile_fit import make_profile  # noqa: E402


def test_measured_steps_are_the_slowest_ranks_after_the_first() -> None:
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    rank0, rank1 = [9.0, 1.0, 3.0, 2.5, 4.0], [8.0, 2.0, 1.5, 2.6, 1.0]
    run = predicted_run(make_profile(layers=4), schedule, microbatch_size=1, layout=(2, 2),
                        step_times=[rank0, rank1], peak_bytes=[1.0, 1.0], rank_of_report=[0, 1])
    assert run.measured_steps_s == (2.0, 3.0, 2.6, 4.0)
    assert run.measured_step_s == statistics.median(run.measured_steps_s) == 2.8
    assert run.num_steps == 4 and run.to_dict()["measured_steps_s"] == [2.0, 3.0, 2.6, 4.0]
