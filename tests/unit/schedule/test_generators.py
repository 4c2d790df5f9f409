"""Golden compute orders for small cases and the closed-form properties of each family."""

from __future__ import annotations

import pytest

from evenpipe.schedule import ActionKind, ScheduleFamily, build_schedule, held_units, witness_timing

K = ActionKind


def compute_text(family: str, P: int, M: int, V: int = 1) -> list[str]:
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V).compute_only()
    return [" ".join(str(a) for a in acts) for acts in s.actions]


def test_1f1b_matches_megatron_p4_m8() -> None:
    # Megatron's non-interleaved schedule: warm-up P-r-1 forwards, steady F/B pairs, cool-down backwards.
    rows = compute_text("1f1b", 4, 8)
    assert rows[0] == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert rows[1] == "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7"
    assert rows[3] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"


def test_1f1b_fewer_microbatches_than_ranks() -> None:
    assert compute_text("1f1b", 4, 2)[0] == "0F0 0F1 0B0 0B1"
    assert compute_text("1f1b", 4, 2)[3] == "3F0 3B0 3F1 3B1"


def test_gpipe_is_all_forward_then_all_backward() -> None:
    assert compute_text("gpipe", 2, 3) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_interleaved_matches_megatron_p2_m4_v2() -> None:
    # groups of P micro-batches per chunk; warm-up 2(P-r-1)+(V-1)P = 4 on rank 0, 2 on rank 1
    rows = compute_text("interleaved", 2, 4, 2)
    assert rows[0] == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert rows[1] == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"


def test_interleaved_one_round_when_m_below_2p() -> None:
    # M=6, P=4: one round of 6 (torch's rounds); warm-up 2(P-r-1) + (V-1)*6
    rows = compute_text("interleaved", 4, 6, 2)
    assert rows[0].split()[:13] == ["0F0", "0F1", "0F2", "0F3", "0F4", "0F5", "4F0", "4F1", "4F2", "4F3", "4F4",
                                    "4F5", "4B0"]
    assert rows[3].split()[:8] == ["3F0", "3F1", "3F2", "3F3", "3F4", "3F5", "7F0", "7B0"]


def test_interleaved_v1_is_1f1b() -> None:
    assert compute_text("interleaved", 4, 8, 1) == compute_text("1f1b", 4, 8)


def test_looped_bfs_chunk_major() -> None:
    rows = compute_text("looped-bfs", 2, 3, 2)
    assert rows[0] == "0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2"


def test_looped_bfs_v1_is_gpipe() -> None:
    assert compute_text("looped-bfs", 3, 5, 1) == compute_text("gpipe", 3, 5)


def test_zb_h1_golden_p3_m4() -> None:
    assert compute_text("zb-h1", 3, 4) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 3), (8, 16), (5, 20)])
def test_memory_peaks(P: int, M: int) -> None:
    assert held_units(build_schedule("1f1b", num_ranks=P, num_microbatches=M)) == [min(P - r, M) for r in range(P)]
    assert held_units(build_schedule("gpipe", num_ranks=P, num_microbatches=M)) == [M] * P
    zb = build_schedule("zb-h1", num_ranks=P, num_microbatches=M)
    assert max(held_units(zb)) == min(P, M)  # counted until W: 1F1B's peak
    # between F and I, zb-h1 holds exactly what 1F1B holds between F and B
    for r, acts in enumerate(zb.actions):
        held = peak = 0
        for a in acts:
            held += {K.FORWARD: 1, K.BACKWARD_INPUT: -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak == min(P - r, M)


@pytest.mark.parametrize("P,M,V", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 4), (8, 16, 2), (3, 9, 4)])
def test_interleaved_first_rank_peak_is_megatron_in_flight(P: int, M: int, V: int) -> None:
    s = build_schedule("interleaved", num_ranks=P, num_microbatches=M, num_chunks=V)
    assert held_units(s)[0] == min(2 * (P - 1) + (V - 1) * P + 1, V * M)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (8, 24)])
def test_bubbles(P: int, M: int) -> None:
    fb = {K.FORWARD: 1, K.BACKWARD: 2}
    one = witness_timing(build_schedule("1f1b", num_ranks=P, num_microbatches=M).compute_only(), fb).makespan
    gp = witness_timing(build_schedule("gpipe", num_ranks=P, num_microbatches=M).compute_only(), fb).makespan
    assert one - 3 * M == gp - 3 * M == 3 * (P - 1)  # bubble fraction (P-1)/(M+P-1)
    unit = {K.FORWARD: 1, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1}
    zb = witness_timing(build_schedule("zb-h1", num_ranks=P, num_microbatches=M).compute_only(), unit).makespan
    assert zb - 3 * M == P - 1  # a third of 1F1B's bubble with F = I = W = 1
    for V in (2, 4):
        # chunks take 1/V of a stage: per-chunk F=1, B=2 means a full stage of F=V, B=2V
        il = build_schedule("interleaved", num_ranks=P, num_microbatches=M, num_chunks=V).compute_only()
        assert witness_timing(il, fb).makespan - 3 * V * M == 3 * (P - 1)  # V-fold smaller than 3V(P-1)


def test_families_parse() -> None:
    assert ScheduleFamily.parse("1F1B") is ScheduleFamily.ONE_F_ONE_B
    assert ScheduleFamily.parse("looped_bfs") is ScheduleFamily.LOOPED_BFS
    assert ScheduleFamily.parse(ScheduleFamily.BPIPE) is ScheduleFamily.BPIPE
    assert [f.value for f in ScheduleFamily] == ["gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2",
                                                 "zb-v", "v-half", "v-min", "dualpipev", "bpipe", "latency-aware"]
