"""Accelerator presets: memory, dense bf16 peak, HBM and interconnect bandwidths.

Bandwidths are per GPU and unidirectional, in GB/s (10^9 bytes). Figures are the vendors' datasheet numbers
(NVIDIA A100 datasheet 2021, H100 datasheet 2023, H200 product brief 2024); inter-node figures assume one
InfiniBand NIC per GPU as in DGX systems (HDR 200 Gb/s for A100, NDR 400 Gb/s for H100/H200). Override any field
with ``dataclasses.replace``; a measured profile can be loaded the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evenpipe.errors import ConfigError, choice_error

if TYPE_CHECKING:
    import pathlib

__all__ = ["Hardware", "HARDWARE_PRESETS", "hardware_preset", "load_hardware", "GIB"]

GIB = float(2**30)
"""Bytes per GiB."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One GPU type and the node it sits in."""

    name: str
    """Preset name."""
    memory_gib: float
    """Device memory in GiB."""
    peak_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    hbm_bandwidth_gbps: float
    """Device memory bandwidth, GB/s."""
    nvlink_gbps: float
    """Intra-node GPU-to-GPU bandwidth per GPU, one direction, GB/s."""
    internode_gbps: float
    """Inter-node network bandwidth per GPU, one direction, GB/s."""
    gpus_per_node: int = 8
    """GPUs sharing one NVLink domain."""
    nvlink_latency_s: float = 5e-6
    """Latency of one intra-node message (seconds)."""
    internode_latency_s: float = 10e-6
    """Latency of one inter-node message (seconds)."""
    memory_reserve_gib: float = 2.0
    """Memory not available to the model: CUDA context, NCCL buffers, allocator fragmentation."""
    host_gbps: float = 32.0
    """GPU-host (PCIe) bandwidth per GPU, one direction, GB/s: what host offload moves activations over. The
    datasheets give both directions together: PCIe Gen4 x16 64 GB/s (A100), Gen5 128 GB/s (H100, H200)."""
    host_latency_s: float = 10e-6
    """Latency of one host copy (seconds)."""

    def __post_init__(self) -> None:
        for field_name in ("memory_gib", "peak_tflops", "hbm_bandwidth_gbps", "nvlink_gbps", "internode_gbps",
                           "host_gbps"):
            if not getattr(self, field_name) > 0:
                raise ConfigError(f"hardware {field_name} must be > 0, got {getattr(self, field_name)}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if min(self.nvlink_latency_s, self.internode_latency_s, self.host_latency_s, self.memory_reserve_gib) < 0:
            raise ConfigError("hardware latencies and memory_reserve_gib must be >= 0")

    @property
    def usable_memory_gib(self) -> float:
        return self.memory_gib - self.memory_reserve_gib


HARDWARE_PRESETS: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="a100-40gb", memory_gib=40.0, peak_tflops=312.0, hbm_bandwidth_gbps=1555.0,
             nvlink_gbps=300.0, internode_gbps=25.0),
    Hardware(name="a100-80gb", memory_gib=80.0, peak_tflops=312.0, hbm_bandwidth_gbps=2039.0,
             nvlink_gbps=300.0, internode_gbps=25.0),
    Hardware(name="h100-80gb", memory_gib=80.0, peak_tflops=989.0, hbm_bandwidth_gbps=3350.0,
             nvlink_gbps=450.0, internode_gbps=50.0, host_gbps=64.0),
    Hardware(name="h200", memory_gib=140.0, peak_tflops=989.0, hbm_bandwidth_gbps=4800.0,
             nvlink_gbps=450.0, internode_gbps=50.0, host_gbps=64.0),
)}
"""Named hardware presets; see :func:`hardware_preset`."""


def hardware_preset(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive); unknown names raise ConfigError listing the valid ones."""
    try:
        return HARDWARE_PRESETS[name.lower()]
    except KeyError:
        raise choice_error("GPU preset", name, list(HARDWARE_PRESETS)) from None


def load_hardware(path: str | pathlib.Path) -> Hardware:
    """Read a measured profile: a JSON object with an optional ``"base"`` preset name and any Hardware fields
    to override, e.g. ``{"base": "h100-80gb", "name": "my-h100", "internode_gbps": 40.0}``."""
    import json  # here: planning and simulating with presets never read files
    import pathlib

    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read hardware profile {str(p)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"hardware profile {str(p)!r}: expected a JSON object, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - fields - {"base"})
    if unknown:
        raise ConfigError(f"hardware profile {str(p)!r}: unknown field(s) {', '.join(unknown)}; "
                          f"allowed: base, {', '.join(sorted(fields))}")
    overrides = {k: v for k, v in data.items() if k != "base"}
    if "base" in data:
        return dataclasses.replace(hardware_preset(str(data["base"])), **overrides)
    try:
        return Hardware(**overrides)
    except TypeError as e:
        raise ConfigError(f"hardware profile {str(p)!r}: {e}") from None
