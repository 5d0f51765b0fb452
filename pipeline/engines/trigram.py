"""Saving and loading ADED's tri-gram matrix (pipeline.decoding.trigram.TrigramMatrix) as a NumPy
.npz with columns a, b, c, prob and top_t. The decoding layer holds the pure type; its file I/O
lives here, with the engines that load it."""

from __future__ import annotations

import numpy as np

from pipeline.decoding.trigram import TrigramMatrix


def save_trigram(matrix: TrigramMatrix, path: str) -> None:
    rows = [(a, b, c, p) for (a, b), conts in matrix.table.items() for c, p in conts.items()]
    arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
    np.savez(path, a=arr[:, 0].astype(np.int64), b=arr[:, 1].astype(np.int64), c=arr[:, 2].astype(np.int64),
             prob=arr[:, 3], top_t=np.array(matrix.top_t))


def load_trigram(path: str, top_t: int = 12) -> TrigramMatrix:
    """The matrix saved at ``path``; an empty path gives an empty matrix keeping ``top_t``
    continuations per context. ValueError (naming the file) when it is not a saved matrix."""
    if not path:
        return TrigramMatrix(top_t)
    try:
        data = np.load(path)
        matrix = TrigramMatrix(int(data["top_t"]))
        for a, b, c, p in zip(data["a"].tolist(), data["b"].tolist(), data["c"].tolist(), data["prob"].tolist()):
            matrix.table.setdefault((a, b), {})[c] = p
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a saved tri-gram matrix ({exc})") from None
    return matrix
