"""Row-wise top-k of a score matrix with a deterministic order for ties."""

from __future__ import annotations

import numpy as np


def top_k(scores_QN: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(k, N)`` largest entries of each row of ``scores_QN``, best first.

    Equal scores come in column order (lower column first), also where a tie straddles
    the cut: of the documents tied at the k-th score, the earliest ones are kept. Costs
    O(Q·N) plus a sort of ``Q·k`` entries (no full sort of each row).

    Returns ``(index_Qk, score_Qk)``.
    """
    q, n = scores_QN.shape
    k = min(k, n)
    if k == 0 or q == 0:
        return np.zeros((q, 0), dtype=np.int64), np.zeros((q, 0), dtype=scores_QN.dtype)
    kth = np.partition(scores_QN, n - k, axis=1)[:, n - k : n - k + 1]  # the k-th largest
    above = scores_QN > kth
    tied = scores_QN == kth
    # Of the tied entries, keep the first (k - #above) in column order.
    need = k - above.sum(axis=1, keepdims=True)
    keep = above | (tied & (np.cumsum(tied, axis=1) <= need))
    cols = np.nonzero(keep)[1].reshape(q, k)  # row-major: each row's k columns, ascending
    vals = np.take_along_axis(scores_QN, cols, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")  # ascending columns break the ties
    return np.take_along_axis(cols, order, axis=1), np.take_along_axis(vals, order, axis=1)
