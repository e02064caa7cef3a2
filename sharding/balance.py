"""Balanced assignment of documents to paths under a capacity, as DiPaCo balances its shards.

Capacity per path = ceil((1 + slack) * N / P). Documents are placed greedily, the most decided
first (largest margin between their best and second-best path), each into its best-ranked path
that still has room; a document whose ranked paths are all full goes to the path with the most
room left. Ties break by document order, so the result is deterministic.
"""

from __future__ import annotations

import math

import numpy as np

from paths.errors import ConfigurationError


def capacity(n_docs: int, n_paths: int, slack: float) -> int:
    """Documents a path may take."""
    if slack < 0:
        raise ConfigurationError(f"--slack must be >= 0, got {slack}")
    return max(1, math.ceil((1 + slack) * n_docs / n_paths))


def top_k(scores_NP: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of the k best paths per document, best first; ties by lower index."""
    k = min(k, scores_NP.shape[1])
    order = np.argsort(-scores_NP, axis=1, kind="stable")[:, :k]
    return order.astype(np.int32), np.take_along_axis(scores_NP, order, axis=1).astype(np.float32)


def assign(prefs_NK: np.ndarray, pref_scores_NK: np.ndarray, n_paths: int, slack: float | None) -> np.ndarray:
    """Path index per document: the best preference, or (with a slack) under the capacity."""
    if slack is None or len(prefs_NK) == 0:
        return prefs_NK[:, 0].astype(np.int64)
    n = len(prefs_NK)
    cap = capacity(n, n_paths, slack)
    if pref_scores_NK.shape[1] > 1:
        margin = pref_scores_NK[:, 0] - pref_scores_NK[:, 1]
        margin = np.where(np.isfinite(margin), margin, np.finfo(np.float32).max)
    else:
        margin = np.zeros(n, dtype=np.float32)
    order = np.lexsort((np.arange(n), -margin))  # most decided first, then document order
    load = np.zeros(n_paths, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in order:
        for p in prefs_NK[i]:
            if load[p] < cap:
                break
        else:
            p = int(np.argmin(load))
        out[i] = p
        load[p] += 1
    return out
