"""Presentation of traces: pictures (matplotlib, Agg, no pyplot state), Chrome traces and text tables.

Submodules (import the ones you need; ``chrome_trace`` and ``tables`` never import matplotlib):
``timeline`` (timeline.png), ``memory`` (memory.png), ``chrome_trace`` (trace.json), ``tables`` (text),
``bundle`` (all files of one trace into a folder), ``style`` (colours per action kind).
Plot functions take the caller's Axes (``plot_*``) or a path (``save_*``).
"""

__all__: list[str] = []
