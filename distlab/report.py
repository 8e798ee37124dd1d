"""Small helpers shared by the studies' reports."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when the plot extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'distlab[plot]')")
        return None
    return plt
