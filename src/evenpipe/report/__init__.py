"""Presentation of traces: pictures (matplotlib, Agg, no pyplot state), Chrome traces and text tables.

Plot functions take the caller's Axes (``plot_*``) or a path (``save_*``). Import the submodules you need;
``chrome_trace`` and ``tables`` never import matplotlib.
"""

__all__ = ["chrome_trace", "tables", "timeline", "memory", "style"]
