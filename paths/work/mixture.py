"""Mixtures by ratio: a GRPO step draws its prompts from the dataset's sources in set proportions.

A dataset sharded from several `--input`s holds each source's rows (an environment's rows carry
its label in `env`; rows of a plain prompt file are the source `prompts`). Without a mixture a
step draws rows uniformly, so sources come in the ratio of their sizes. `--set
mixture="reasoning-gym:basic_arithmetic=3,verifiers:calc_tools=1"` sets the ratio whatever the
sizes: every source of the path's rows gets a weight (0 leaves one out), and

- a local trainer's epoch interleaves the sources by smooth weighted round robin on integer
  credits (within an epoch, any window of k prompts holds each source's share of k to within one
  prompt for two sources, to within two for more; the order starts afresh each epoch, so a step
  across an epoch's end may be off by one more), each source's rows in a shuffled
  cycle of their own (a small source repeats, a large one is sampled), from the seed and epoch
  alone, so a resumed run draws what it would have drawn;
- a rollout batch's prompts (the seed picks them) are apportioned by largest remainder with a
  seeded tie-break, then drawn uniformly within each source; the trainer re-derives them from the
  same seed, so a worker cannot choose its prompts by choosing a mixture. The trainer publishes
  the mixture with each policy version and workers take it from there.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from paths.errors import ConfigurationError

PLAIN = "prompts"  # the source of rows that came from no environment


def source_of(record: dict[str, Any]) -> str:
    return record.get("env") or PLAIN


def parse_mixture(text: str) -> dict[str, float]:
    """`SOURCE=W,SOURCE=W` as {source: weight}; a one-line error naming what is wrong."""
    weights: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, value = item.rpartition("=")
        try:
            w = float(value)
        except ValueError:
            w = math.nan
        if not eq or not name.strip() or not math.isfinite(w) or w < 0:
            raise ConfigurationError(f"mixture item {item!r} is not SOURCE=WEIGHT with a weight >= 0: write e.g. --set mixture='reasoning-gym:basic_arithmetic=3,verifiers:calc_tools=1'")
        if name.strip() in weights:
            raise ConfigurationError(f"mixture names {name.strip()!r} twice: give each source one weight")
        weights[name.strip()] = w
    return weights


class Mixture:
    """The dataset rows of a path grouped by source, with each source's share of the draws."""

    def __init__(self, records: list[dict[str, Any]], text: str, what: str):
        weights = parse_mixture(text)
        members: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            members.setdefault(source_of(r), []).append(i)
        unknown = sorted(set(weights) - set(members))
        missing = sorted(set(members) - set(weights))
        have = ", ".join(f"{s} ({len(v)} rows)" for s, v in sorted(members.items()))
        if unknown or missing:
            wrong = f"names {', '.join(unknown)}, which it does not hold" if unknown else f"gives no weight to {', '.join(missing)}"
            raise ConfigurationError(f"mixture {text!r} {wrong}: {what} holds {have}; give each of them a weight (0 leaves one out)")
        total = sum(weights.values())
        if total <= 0:
            raise ConfigurationError(f"mixture {text!r} gives every source weight 0: give at least one a weight > 0")
        self.text = text
        self.sources = [s for s in sorted(members) if weights[s] > 0]
        self.shares = np.array([weights[s] / total for s in self.sources])
        self.members = [np.array(members[s]) for s in self.sources]

    def order(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n row indices: sources interleaved by smooth weighted round robin, each source's rows in
        shuffled cycles."""
        weights = [max(1, round(float(w) * 1_000_000)) for w in self.shares]  # integers: float credits drift and break ties unevenly
        total = sum(weights)
        credit = [0] * len(weights)
        picks = np.empty(n, dtype=np.int64)
        for i in range(n):
            for s, w in enumerate(weights):
                credit[s] += w
            s = max(range(len(weights)), key=lambda k: credit[k])
            credit[s] -= total
            picks[i] = s
        out = np.empty(n, dtype=np.int64)
        for s, rows in enumerate(self.members):
            at = np.flatnonzero(picks == s)
            if len(at):
                out[at] = np.concatenate([rng.permutation(rows) for _ in range(-(-len(at) // len(rows)))])[: len(at)]
        return out

    def pick(self, count: int, rng: random.Random) -> list[int]:
        """count row indices: each source's share of count by largest remainder (ties broken by
        rng), rows uniform within a source, in a shuffled order."""
        exact = self.shares * count
        counts = np.floor(exact).astype(int)
        rest = sorted(range(len(self.sources)), key=lambda s: (-(exact[s] - counts[s]), rng.random()))
        for s in rest[: count - int(counts.sum())]:
            counts[s] += 1
        out = [int(self.members[s][rng.randrange(len(self.members[s]))]) for s in range(len(self.sources)) for _ in range(counts[s])]
        rng.shuffle(out)
        return out
