"""Colours and labels shared by the pictures: one colour per action kind, colour-blind-friendly (Okabe-Ito)."""

from __future__ import annotations

from evenpipe.schedule.ir import ActionKind

__all__ = ["KIND_COLOR", "KIND_LABEL", "TRANSFER_HATCH", "rank_color"]

K = ActionKind

KIND_COLOR: dict[ActionKind, str] = {
    K.FORWARD: "#0072B2",           # blue
    K.BACKWARD: "#009E73",          # green
    K.BACKWARD_INPUT: "#56B4E9",    # sky blue
    K.BACKWARD_WEIGHT: "#F0E442",   # yellow
    K.RECOMPUTE: "#CC79A7",         # pink
    K.SEND_F: "#7F9FBF",            # grey-blue: activation message
    K.SEND_B: "#7FBF9F",            # grey-green: gradient message
    K.EVICT: "#D55E00",             # vermilion: BPipe evict
    K.RETURN: "#E69F00",            # orange: BPipe load (acceptor returns)
    K.OFFLOAD: "#8C564B",           # brown: host offload
    K.RELOAD: "#C49C94",            # light brown: host reload
}
"""Fill colour of compute boxes and transfer bars (transfers are coloured by their sending kind)."""

KIND_LABEL: dict[ActionKind, str] = {
    K.FORWARD: "F forward",
    K.BACKWARD: "B backward",
    K.BACKWARD_INPUT: "I input grad",
    K.BACKWARD_WEIGHT: "W weight grad",
    K.RECOMPUTE: "R recompute",
    K.SEND_F: "activation send",
    K.SEND_B: "gradient send",
    K.EVICT: "BPipe evict",
    K.RETURN: "BPipe load",
    K.OFFLOAD: "host offload",
    K.RELOAD: "host reload",
}
"""Legend text per kind."""

TRANSFER_HATCH: dict[ActionKind, str] = {K.EVICT: "////", K.RETURN: "\\\\\\\\", K.OFFLOAD: "xx", K.RELOAD: "xx"}
"""Hatching that tells BPipe and host transfers apart from pipeline messages even in grey-scale."""

_RANK_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]


def rank_color(rank: int) -> str:
    """A distinct line colour per rank (cycles after eight)."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]
