"""The schedule IR: per-rank lists of actions.

Vocabulary
----------
- **rank**: one pipeline process (one GPU). Ranks are numbered ``0 .. num_ranks-1`` within one pipeline replica.
- **stage**: a contiguous group of layers. With interleaving a rank holds several stages (virtual chunks);
  ``Schedule.stage_to_rank[s]`` says where stage ``s`` lives. Stage ``s`` feeds stage ``s+1``.
- **micro-batch**: a slice of the global batch, numbered ``0 .. num_microbatches-1``.

An :class:`Action` is one step of one rank (:mod:`evenpipe.schedule.action`, whose names this module
re-exports). Its text form is one token, ``{stage}{KIND}{microbatch}`` with an optional ``@{peer}`` for
transfers, e.g. ``0F3``, ``2I1``, ``1W0``, ``0SEND_F3@1``, ``0EVICT2@3``. The compute tokens (``F``, ``B``, ``I``, ``W``) are the same as torch.distributed.pipelining's, so compute-only schedules
round-trip through its CSV form.
"""

from __future__ import annotations

import json
from typing import Iterator, Sequence

from evenpipe.errors import ScheduleFormatError
from evenpipe.schedule.action import (_COMPUTE_CODES, COMPUTE_KINDS, MATCHING_RECV, RECV_KINDS, SEND_KINDS, Action,
                                      ActionKind, count_kinds, parse_action)
from evenpipe.schedule.columns import Columns, actions_of_columns, columns_of_actions

__all__ = [  # the actions (re-exported) are the IR's vocabulary
    "Schedule",
    "Action",
    "ActionKind",
    "COMPUTE_KINDS",
    "SEND_KINDS",
    "RECV_KINDS",
    "MATCHING_RECV",
    "parse_action",
    "count_kinds",
]


class Schedule:
    """A pipeline schedule: the ordered actions of every rank plus the stage layout.

    ``actions[r]`` is what rank ``r`` executes, in order. ``stage_to_rank[s]`` is the rank holding stage ``s``.
    A schedule is made from ``actions`` or from ``columns`` (:mod:`evenpipe.schedule.columns`, the integer form
    the builder, validator and simulator read); the other form is derived when first asked for. Immutable;
    equality compares name, sizes, layout and actions (not ``meta``).
    """

    __slots__ = ("name", "num_ranks", "num_microbatches", "stage_to_rank", "meta", "_actions", "_columns",
                 "_validated")

    name: str
    """Schedule family, e.g. ``1f1b`` or ``bpipe``."""
    num_ranks: int
    """Pipeline ranks (p)."""
    num_microbatches: int
    """Micro-batches per step (m)."""
    stage_to_rank: tuple[int, ...]
    """Rank of each stage; ``len(stage_to_rank)`` is the number of stages (p times the chunks per rank)."""
    meta: dict[str, object]
    """Free-form facts a generator wants to keep (e.g. the BPipe budget); JSON-serialisable."""
    _actions: tuple[tuple[Action, ...], ...] | None
    _columns: Columns | None
    _validated: bool
    """Set by :func:`evenpipe.schedule.validate.validate` once this object passed (a fact about immutable
    contents, like the derived form; read it with :func:`~evenpipe.schedule.validate.passed_validation`)."""

    def __init__(self, *, name: str, num_ranks: int, num_microbatches: int, stage_to_rank: tuple[int, ...],
                 actions: tuple[tuple[Action, ...], ...] | None = None, meta: dict[str, object] | None = None,
                 columns: "Columns | None" = None) -> None:
        if (actions is None) == (columns is None):
            raise ScheduleFormatError("a schedule needs exactly one of actions and columns")
        init = object.__setattr__
        init(self, "name", name)
        init(self, "num_ranks", num_ranks)
        init(self, "num_microbatches", num_microbatches)
        init(self, "stage_to_rank", stage_to_rank)
        init(self, "meta", {} if meta is None else meta)
        init(self, "_actions", actions)
        init(self, "_columns", columns)
        init(self, "_validated", False)
        if num_ranks < 1:
            raise ScheduleFormatError(f"num_ranks must be >= 1, got {num_ranks}")
        if num_microbatches < 1:
            raise ScheduleFormatError(f"num_microbatches must be >= 1, got {num_microbatches}")
        lists = len(actions) if actions is not None else columns.num_ranks  # type: ignore[union-attr]
        if lists != num_ranks:
            raise ScheduleFormatError(f"schedule has {lists} action lists for {num_ranks} ranks")
        for s, r in enumerate(stage_to_rank):
            if not 0 <= r < num_ranks:
                raise ScheduleFormatError(f"stage {s} placed on rank {r}; ranks are 0..{num_ranks - 1}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Schedule is immutable: cannot assign {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Schedule is immutable: cannot delete {name!r}")

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Per-rank action lists (built from the columns on first use)."""
        acts = self._actions
        if acts is None:
            acts = actions_of_columns(self._columns)  # type: ignore[arg-type]
            object.__setattr__(self, "_actions", acts)
        return acts

    @property
    def columns(self) -> "Columns":
        """The integer columns of the actions (built from the actions on first use)."""
        cols = self._columns
        if cols is None:
            cols = columns_of_actions(self._actions)  # type: ignore[arg-type]
            object.__setattr__(self, "_columns", cols)
        return cols

    def _key(self) -> tuple[object, ...]:
        return (self.name, self.num_ranks, self.num_microbatches, self.stage_to_rank)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        if self is other:
            return True
        if self._key() != other._key():
            return False
        if self._actions is not None and other._actions is not None:
            return self._actions == other._actions
        a, b = self.columns, other.columns
        return (a.kinds == b.kinds and a.stages == b.stages and a.microbatches == b.microbatches
                and a.peers == b.peers)

    def __hash__(self) -> int:
        return hash(self._key() + (self.actions,))

    def __repr__(self) -> str:
        return (f"Schedule(name={self.name!r}, num_ranks={self.num_ranks!r}, num_microbatches="
                f"{self.num_microbatches!r}, stage_to_rank={self.stage_to_rank!r}, actions={self.actions!r}, "
                f"meta={self.meta!r})")

    def __reduce__(self) -> tuple[object, ...]:
        return (_schedule_from_state, (self._key(), self.actions, self.meta))

    # -- layout -------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_chunks(self) -> int:
        """Stages per rank (V); 1 unless interleaved or looped."""
        return max(1, self.num_stages // self.num_ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def compute_only(self) -> "Schedule":
        """The same schedule with transfer actions removed (what torch's compute CSV holds); itself when it has
        none (schedules are immutable)."""
        cols = self.columns
        compute = _COMPUTE_CODES
        if all(compute.issuperset(ks) for ks in cols.kinds):
            return self
        keep = [[i for i, c in enumerate(ks) if c in compute] for ks in cols.kinds]
        return self.with_columns(Columns(*(tuple(list(map(col.__getitem__, idx)) for col, idx in zip(table, keep))
                                           for table in (cols.kinds, cols.stages, cols.microbatches, cols.peers))))

    def with_actions(self, actions: Sequence[Sequence[Action]], name: str | None = None,
                     meta: dict[str, object] | None = None) -> "Schedule":
        return Schedule(name=name or self.name, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                        stage_to_rank=self.stage_to_rank, actions=tuple(tuple(a) for a in actions),
                        meta=dict(self.meta if meta is None else meta))

    def with_columns(self, columns: "Columns", name: str | None = None,
                     meta: dict[str, object] | None = None) -> "Schedule":
        """:meth:`with_actions` for the integer form."""
        return Schedule(name=name or self.name, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                        stage_to_rank=self.stage_to_rank, columns=columns,
                        meta=dict(self.meta if meta is None else meta))

    def renamed(self, name: str, meta: dict[str, object]) -> "Schedule":
        """The same actions (in whichever form this schedule holds them) under another name and ``meta``."""
        return Schedule(name=name, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                        stage_to_rank=self.stage_to_rank, actions=self._actions,
                        columns=self._columns if self._actions is None else None, meta=dict(meta))

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, index, action)`` for every action."""
        for r, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                yield r, i, a

    # -- text form ----------------------------------------------------------------------------------------
    def to_text(self) -> str:
        """Compact text: a header line, then one line per rank of space-separated tokens."""
        layout = ",".join(str(r) for r in self.stage_to_rank)
        lines = [f"# {self.name} ranks={self.num_ranks} microbatches={self.num_microbatches} layout={layout}"]
        for r, acts in enumerate(self.actions):
            lines.append(f"{r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("#"):
            raise ScheduleFormatError("schedule text must start with '# NAME ranks=P microbatches=M layout=...'")
        header = dict(part.split("=", 1) for part in lines[0][1:].split()[1:] if "=" in part)
        name = lines[0][1:].split()[0]
        try:
            num_ranks, num_mb = int(header["ranks"]), int(header["microbatches"])
            layout = tuple(int(x) for x in header["layout"].split(","))
        except (KeyError, ValueError) as e:
            raise ScheduleFormatError(f"bad schedule header {lines[0]!r}: {e}") from None
        actions: list[tuple[Action, ...]] = [() for _ in range(num_ranks)]
        for ln in lines[1:]:
            rank_s, _, body = ln.partition(":")
            actions[int(rank_s)] = tuple(parse_action(t) for t in body.split())
        return cls(name=name, num_ranks=num_ranks, num_microbatches=num_mb, stage_to_rank=layout,
                   actions=tuple(actions))

    # -- JSON -----------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "num_ranks": self.num_ranks, "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank), "meta": self.meta,
            "actions": [[str(a) for a in acts] for acts in self.actions],
        })

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        d = json.loads(text)
        return cls(name=d["name"], num_ranks=d["num_ranks"], num_microbatches=d["num_microbatches"],
                   stage_to_rank=tuple(d["stage_to_rank"]), meta=d.get("meta", {}),
                   actions=tuple(tuple(parse_action(t) for t in acts) for acts in d["actions"]))

    # -- torch.distributed.pipelining CSV --------------------------------------------------------------------
    def to_torch_csv(self) -> str:
        """Compute actions as torch.distributed.pipelining's CSV: one row per rank, tokens like ``0F0``."""
        return "\n".join(",".join(str(a) for a in acts if a.kind.is_compute) for acts in self.actions) + "\n"

    @classmethod
    def from_torch_csv(cls, text: str, *, name: str = "custom", num_microbatches: int | None = None,
                       stage_to_rank: Sequence[int] | None = None) -> "Schedule":
        """Read torch's compute CSV. Layout defaults to round-robin stages (``stage % ranks``)."""
        rows = [ln for ln in text.splitlines() if ln.strip()]
        actions = tuple(tuple(parse_action(t) for t in row.split(",") if t.strip()) for row in rows)
        for acts in actions:
            for a in acts:
                if not a.kind.is_compute:
                    raise ScheduleFormatError(f"torch CSV holds compute actions only, got {a}")
        all_actions = [a for acts in actions for a in acts]
        num_stages = 1 + max((a.stage for a in all_actions), default=0)
        mb = num_microbatches or 1 + max((a.microbatch for a in all_actions), default=0)
        layout = tuple(stage_to_rank) if stage_to_rank is not None else tuple(
            s % len(actions) for s in range(num_stages))
        return cls(name=name, num_ranks=len(actions), num_microbatches=mb, stage_to_rank=layout, actions=actions)


def _schedule_from_state(key: tuple[object, ...], actions: tuple[tuple[Action, ...], ...],
                         meta: dict[str, object]) -> Schedule:
    name, num_ranks, num_microbatches, stage_to_rank = key
    return Schedule(name=name, num_ranks=num_ranks, num_microbatches=num_microbatches,  # type: ignore[arg-type]
                    stage_to_rank=stage_to_rank, actions=actions, meta=meta)  # type: ignore[arg-type]
