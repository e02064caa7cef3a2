"""Seeded k-means (k-means++ start, Lloyd iterations) in torch, and DiPaCo's product k-means:
the feature vector is split into G contiguous blocks and each block gets its own k-means, so a
document's G cluster indices pick one expert per level."""

from __future__ import annotations

import torch

from paths.errors import ConfigurationError


def kmeans(x_ND: torch.Tensor, k: int, seed: int, iters: int = 50) -> torch.Tensor:
    """k centroids (k, D) of the rows of x; deterministic for a given seed."""
    n = x_ND.shape[0]
    if n < k:
        raise ConfigurationError(f"k-means needs at least {k} documents to fit {k} clusters, got {n}: shard more data or lower the experts")
    g = torch.Generator().manual_seed(seed)
    x_ND = x_ND.double()
    centroids = [x_ND[torch.randint(n, (1,), generator=g)].squeeze(0)]
    d2_N = ((x_ND - centroids[0]) ** 2).sum(1)
    for _ in range(1, k):  # k-means++: next centre with probability proportional to distance^2
        probs = d2_N / d2_N.sum() if d2_N.sum() > 0 else torch.full((n,), 1.0 / n, dtype=torch.float64)
        c = x_ND[torch.multinomial(probs, 1, generator=g)].squeeze(0)
        centroids.append(c)
        d2_N = torch.minimum(d2_N, ((x_ND - c) ** 2).sum(1))
    c_KD = torch.stack(centroids)
    for _ in range(iters):
        assign_N = torch.cdist(x_ND, c_KD).argmin(1)
        new_KD = c_KD.clone()
        for j in range(k):
            members = x_ND[assign_N == j]
            if len(members):
                new_KD[j] = members.mean(0)
        if torch.equal(new_KD, c_KD):
            break
        c_KD = new_KD
    return c_KD.float()


def split_dims(dim: int, levels: int) -> list[tuple[int, int]]:
    """The [begin, end) feature ranges of each level's block (contiguous, nearly equal)."""
    if dim < levels:
        raise ConfigurationError(f"features of {dim} dimensions cannot be split over {levels} levels")
    bounds = [round(i * dim / levels) for i in range(levels + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def product_kmeans(x_ND: torch.Tensor, levels: int, k: int, seed: int) -> torch.Tensor:
    """Centroids (G, k, D/G): one k-means per block of features (a single one when G = 1)."""
    blocks = split_dims(x_ND.shape[1], levels)
    width = max(e - b for b, e in blocks)
    out = torch.zeros(levels, k, width)
    for level, (b, e) in enumerate(blocks):
        out[level, :, : e - b] = kmeans(x_ND[:, b:e], k, seed + level)
    return out


def level_distances(x_ND: torch.Tensor, centroids_GKW: torch.Tensor) -> torch.Tensor:
    """Squared distance of each row to each level's centroids: (N, G, k)."""
    levels = centroids_GKW.shape[0]
    out = []
    for level, (b, e) in enumerate(split_dims(x_ND.shape[1], levels)):
        out.append(torch.cdist(x_ND[:, b:e].float(), centroids_GKW[level, :, : e - b]) ** 2)
    return torch.stack(out, dim=1)
