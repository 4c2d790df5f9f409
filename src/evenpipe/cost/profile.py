"""The profile: what ``evenpipe profile`` measured on one machine for one model, as a versioned JSON record.

Pure (no torch, no file access): :meth:`Profile.from_json` parses text, :meth:`Profile.to_json` writes it; the
commands read and write the files. Units: seconds and bytes, per micro-batch of ``microbatch_size`` sequences of
``seq_len`` tokens.

Vocabulary. A *layer kind* is one of the three pieces a pipeline stage is made of: the embedding (stage 0 only),
a transformer block, and the head with its loss (last stage only). For each kind and profiled size the profile
holds one :class:`LayerSample`:

- ``forward_s``: forward under the runtime's activation stash (its saved-tensor hooks cost time too);
- ``backward_s``: full backward (``B``); ``backward_input_s`` / ``backward_weight_s``: the zero-bubble split
  (``I`` and ``W``); ``recompute_s``: a forward rebuilding the graph before backward (``R``);
- ``saved_bytes``: bytes autograd saves for backward, *not* counting the layer's input; ``input_saved_bytes``:
  the bytes of the input the layer also saves (0 if it does not); a stage's activation unit is the sum of both
  over its layers (a received stage input is kept for backward in any case, see :mod:`evenpipe.cost.profile_fit`);
- ``output_bytes``: the layer's output (the boundary message when a stage ends after it);
- ``weight_grad_bytes``: bytes still saved between ``I`` and ``W``;
- ``forward_flops``: the layer's forward FLOPs (matrix products and attention), for achieved FLOP/s.

Besides the layers: the optimizer step's time per kind (its parameters), point-to-point message times between two
processes over the runtime's backend, on a CPU host what moving bytes costs the computes running meanwhile
(``transfer_cpu_s_per_byte``), and the machine (device, threads, torch version, dtype).
"""

from __future__ import annotations

import enum
import json
import math
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from evenpipe.errors import ConfigError, parse_choice

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "LayerKind", "LayerSample", "LinkSample", "Machine", "ModelInfo",
           "Profile", "ProfileError", "TIME_FIELDS", "QUANTITIES", "load_profile"]

PROFILE_FORMAT = "evenpipe.profile"
"""``format`` field of a profile's JSON form."""
PROFILE_VERSION = 1
"""``version`` field; bumped when a field changes meaning."""


class ProfileError(ConfigError):
    """A profile file that cannot be used: not a profile, another schema version, damaged, or another model."""


class LayerKind(enum.Enum):
    """The pieces a pipeline stage is built from."""

    EMBEDDING = "embedding"
    """Token (and position) embedding: stage 0 only."""
    BLOCK = "block"
    """One transformer block."""
    HEAD = "head"
    """Final norm, output projection and the cross-entropy loss: last stage only."""

    @classmethod
    def parse(cls, value: "str | LayerKind") -> "LayerKind":
        return parse_choice(cls, value, "layer kind")


TIME_FIELDS = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "recompute_s")
"""The time fields of a :class:`LayerSample`."""
_BYTE_FIELDS = ("saved_bytes", "input_saved_bytes", "output_bytes", "weight_grad_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSample:
    """One layer kind measured at one micro-batch size (see the module docstring for each field)."""

    microbatch_size: int
    """Sequences per micro-batch."""
    seq_len: int
    """Tokens per sequence."""
    forward_s: float
    """Forward seconds (mean of repeats)."""
    backward_s: float
    """Full backward seconds."""
    backward_input_s: float
    """Input-gradient seconds (zero-bubble ``I``)."""
    backward_weight_s: float
    """Weight-gradient seconds (zero-bubble ``W``)."""
    recompute_s: float
    """Recompute (forward with graph, before backward) seconds."""
    saved_bytes: float
    """Bytes saved for backward, the layer's input excluded."""
    input_saved_bytes: float
    """Bytes of the input that the layer saves too (0 or the input's size)."""
    output_bytes: float
    """Bytes of the layer's output."""
    weight_grad_bytes: float
    """Bytes still saved between ``I`` and ``W``."""
    forward_flops: float = 0.0
    """Forward FLOPs of the layer at this size (0 when not counted)."""

    def __post_init__(self) -> None:
        if self.microbatch_size < 1 or self.seq_len < 1:
            raise ProfileError(f"layer sample needs microbatch_size and seq_len >= 1, got {self.microbatch_size}, "
                               f"{self.seq_len}")
        for name in TIME_FIELDS + _BYTE_FIELDS + ("forward_flops",):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ProfileError(f"layer sample field {name} must be a finite number >= 0, got {value!r}")

    def value(self, quantity: str) -> float:
        """The field named ``quantity`` (one of the time or byte fields)."""
        return float(getattr(self, quantity))


QUANTITIES = TIME_FIELDS + _BYTE_FIELDS
"""Every per-layer quantity the fit extrapolates."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSample:
    """Median one-way time of one message size between two processes."""

    num_bytes: int
    """Message size."""
    seconds: float
    """One-way time (half a ping-pong round trip)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """Where the profile was measured."""

    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """CPU model or GPU name."""
    num_threads: int
    """torch intra-op threads per process (the runtime uses one per process on CPU)."""
    num_processes: int
    """Processes measuring at the same time (one per pipeline rank on a CPU host, as training runs)."""
    torch_version: str
    """``torch.__version__``."""
    dtype: str
    """Parameter and activation dtype, e.g. ``float32``."""
    backend: str
    """torch.distributed backend of the link measurement (``gloo`` or ``nccl``)."""
    hostname: str = ""
    """Host name (informational)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """The model the profile belongs to."""

    name: str
    """Preset name or the Hugging Face config path."""
    arch: str
    """``gpt`` or ``llama``."""
    num_layers: int
    """Transformer blocks."""
    hidden: int
    """Model width."""
    vocab: int
    """Vocabulary size."""
    seq_len: int
    """Sequence length the model was built for."""
    params: Mapping[str, int] = field(default_factory=dict)
    """Parameter count per layer kind (``embedding``, ``block``, ``head``)."""

    def params_of(self, kind: LayerKind) -> int:
        return int(self.params.get(kind.value, 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Everything one ``evenpipe profile`` run measured."""

    machine: Machine
    """Where."""
    model: ModelInfo
    """What."""
    layers: Mapping[LayerKind, tuple[LayerSample, ...]]
    """Per layer kind, one sample per profiled size (ascending micro-batch size)."""
    optimizer_s: Mapping[LayerKind, float]
    """Seconds per layer, per kind, that training spends on a layer's gradients after the schedule: the gradient
    norm it reports and the AdamW step (profiles without a ``block_chain`` field timed the AdamW step alone)."""
    link: tuple[LinkSample, ...] = ()
    """Point-to-point message times, ascending size (empty when not measured)."""
    step_overhead_s: float = 0.0
    """Fixed seconds per training step outside the schedule's actions (sharing the loss, clearing gradients)."""
    transfer_cpu_s_per_byte: float = 0.0
    """Seconds of compute each of two processes loses per byte it sends or receives meanwhile (a CPU host, where
    the backend's threads copy on the computing cores; 0 where not measured). Read by :class:`Link`."""
    handoff_latency_s: float = 0.0
    """Mean seconds a boundary message of the smallest profiled micro-batch takes between two processes that
    compute the model's block between hand-offs, when its receive was posted before its send (0 where not
    measured). Read by :func:`~evenpipe.cost.profile_fit.link_from_profile` as the link's latency at that size."""
    late_receive_s: float = 0.0
    """Mean extra seconds such a message takes when its receive is posted after its send (gloo moves it only then,
    and on a CPU host the sender's communication thread waits for its busy core; 0 where not measured): the link's
    ``late_receive_s``."""
    handoff_bytes: int = 0
    """Size of the messages ``handoff_latency_s`` and ``late_receive_s`` timed."""
    alternation_forward: float = 1.0
    """How many times its profiled time a block's forward (and recompute) takes on a rank that holds two chunks
    of the model and runs them in an interleaved schedule's order, against one chunk run again and again as the
    layer times are measured (1 where not measured). :meth:`~evenpipe.cost.profile_fit.ProfileModel.sim_costs`
    applies it to schedules whose ranks hold more than one stage."""
    alternation_backward: float = 1.0
    """The same for a block's backward (and its ``I`` and ``W`` parts)."""
    alternation_blocks: int = 0
    """Blocks in each of the two chunks the alternation factors were timed with (0: not measured)."""
    repeats: int = 0
    """Timed repeats per mean."""
    warmup: int = 0
    """Untimed warm-up runs before timing."""
    block_chain: int = 1
    """Distinct blocks timed in a row for the block times (1: one block timed alone, as profiles before this
    field were)."""

    def __post_init__(self) -> None:
        missing = [k.value for k in LayerKind if not self.layers.get(k)]
        if missing:
            raise ProfileError(f"profile has no samples for layer kind(s) {', '.join(missing)}")

    @property
    def microbatch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({s.microbatch_size for s in self.layers[LayerKind.BLOCK]}))

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(sorted({s.seq_len for s in self.layers[LayerKind.BLOCK]}))

    # -- JSON -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "machine": asdict(self.machine), "model": {**asdict(self.model), "params": dict(self.model.params)},
            "layers": {k.value: [asdict(s) for s in v] for k, v in self.layers.items()},
            "optimizer_s": {k.value: v for k, v in self.optimizer_s.items()},
            "link": [asdict(s) for s in self.link], "step_overhead_s": self.step_overhead_s,
            "transfer_cpu_s_per_byte": self.transfer_cpu_s_per_byte,
            "handoff_latency_s": self.handoff_latency_s, "late_receive_s": self.late_receive_s,
            "handoff_bytes": self.handoff_bytes, "alternation_forward": self.alternation_forward,
            "alternation_backward": self.alternation_backward, "alternation_blocks": self.alternation_blocks,
            "repeats": self.repeats, "warmup": self.warmup, "block_chain": self.block_chain,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "profile") -> "Profile":
        """Parse and check a profile's dict form; :class:`ProfileError` (one line) for anything unusable."""
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ProfileError(f"{where} is not an evenpipe profile (format {got!r}, expected {PROFILE_FORMAT!r})")
        if doc.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where} has schema version {doc.get('version')!r}; this evenpipe reads version "
                               f"{PROFILE_VERSION} (profile the model again with `evenpipe profile`)")
        try:
            layers = {LayerKind.parse(k): tuple(sorted((LayerSample(**s) for s in v),
                                                       key=lambda s: (s.seq_len, s.microbatch_size)))
                      for k, v in doc["layers"].items()}
            return cls(machine=Machine(**doc["machine"]), model=ModelInfo(**doc["model"]), layers=layers,
                       optimizer_s={LayerKind.parse(k): float(v) for k, v in doc["optimizer_s"].items()},
                       link=tuple(LinkSample(**s) for s in doc.get("link", [])),
                       step_overhead_s=float(doc.get("step_overhead_s", 0.0)),
                       transfer_cpu_s_per_byte=_non_negative(doc.get("transfer_cpu_s_per_byte", 0.0),
                                                             "transfer_cpu_s_per_byte"),
                       handoff_latency_s=_non_negative(doc.get("handoff_latency_s", 0.0), "handoff_latency_s"),
                       late_receive_s=_non_negative(doc.get("late_receive_s", 0.0), "late_receive_s"),
                       handoff_bytes=int(_non_negative(doc.get("handoff_bytes", 0), "handoff_bytes")),
                       alternation_forward=_non_negative(doc.get("alternation_forward", 1.0), "alternation_forward",
                                                         zero=False),
                       alternation_backward=_non_negative(doc.get("alternation_backward", 1.0),
                                                          "alternation_backward", zero=False),
                       alternation_blocks=int(_non_negative(doc.get("alternation_blocks", 0), "alternation_blocks")),
                       repeats=int(doc.get("repeats", 0)),
                       warmup=int(doc.get("warmup", 0)), block_chain=int(doc.get("block_chain", 1)))
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"{where} is damaged: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, where: str = "profile") -> "Profile":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{where} is not JSON ({e})") from None
        return cls.from_dict(doc, where=where)

    def check_model(self, name: str, *, num_layers: int | None = None, hidden: int | None = None) -> None:
        """Refuse a profile of another model (``ProfileError`` naming both)."""
        mismatch = [f"{what} {mine} vs {theirs}" for what, mine, theirs in
                    (("layers", self.model.num_layers, num_layers), ("hidden", self.model.hidden, hidden))
                    if theirs is not None and mine != theirs]
        if self.model.name != name or mismatch:
            raise ProfileError(f"the profile is of model {self.model.name!r}, not {name!r}"
                               + (f" ({', '.join(mismatch)})" if mismatch else "")
                               + "; profile this model with `evenpipe profile`")


def _non_negative(value: Any, name: str, *, zero: bool = True) -> float:
    """``value`` as a finite float >= 0 (> 0 without ``zero``: a time factor of 0 is no factor), else
    ``ValueError`` naming ``name`` (reported as a damaged profile)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    if not ((out >= 0 if zero else out > 0) and math.isfinite(out)):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
    return out


def load_profile(path: "str | pathlib.Path", *, model: str | None = None, num_layers: int | None = None,
                 hidden: int | None = None) -> Profile:
    """The profile at ``path`` (``--profile PATH`` of any command); with ``model`` (and sizes), refuse a profile of
    another model. One-line :class:`ProfileError` for a missing file, another schema version or a damaged file."""
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
