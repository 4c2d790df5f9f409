"""evenpipe: pipeline-parallel training with balanced activation memory (BPipe), one schedule IR driving a
runtime, a validator, a simulator and a planner.

The planning parts (``evenpipe.schedule``, ``evenpipe.sim``, ``evenpipe.cost``, ``evenpipe.plan``) import
without torch; torch lives in ``evenpipe.runtime`` and ``evenpipe.models``.
"""

__version__ = "0.1.0"
