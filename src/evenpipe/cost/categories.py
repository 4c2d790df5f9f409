"""The memory categories a rank's peak is reported in, measured (``train --json-out``) and predicted
(``estimate --json``), both under the key :data:`PEAK_BYTES_KEY`: a list with one ``{category: bytes}`` mapping
per pipeline rank."""

from __future__ import annotations

__all__ = ["MEMORY_CATEGORIES", "STATE_CATEGORIES", "PEAK_BYTES_KEY"]

PEAK_BYTES_KEY = "peak_bytes_by_category"
"""The JSON key of the per-rank mappings."""

STATE_CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state", "gathered_states")
"""Model states: exact counts of the tensors a rank holds (local shards). ``gathered_states`` are what FSDP
(``--sharding full``) holds during a step besides the shards: every stage's all-gathered weights and their
unsharded gradients, from the stage's first forward until the step's reduce-scatter (0 without FSDP)."""

MEMORY_CATEGORIES = STATE_CATEGORIES + ("own_activations", "hosted_activations", "offloaded_activations",
                                        "communication_buffers")
"""Every category: model states (with FSDP's gathered weights and gradients), the rank's own saved activations on
its device, a BPipe partner's hosted activations, the rank's own activations offloaded to host memory
(``train --offload``; host memory, not the device's), and the pipeline messages in flight (receive buffers not
yet consumed, sends not yet completed)."""
