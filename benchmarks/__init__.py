"""Benchmarks: each script measures one thing side by side in one run and prints ratios."""

from __future__ import annotations

import sys


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, for a script's PNG; where matplotlib is not
    installed (it is the ``plots`` extra), one line on stderr and exit code 2."""
    try:
        import matplotlib
    except ImportError:
        print("error: the plots need matplotlib: pip install 'bon-pipeline[plots]'", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
