"""Plans and path ids: layers split into G contiguous levels; a path picks one expert per level.

Where the MoE has dense layers (DeepSeek-V3's first ones, Qwen-MoE's `mlp_only_layers`), the
levels split the sparse layers evenly and a path's expert list holds -1 for a dense layer: its MLP
is a shared parameter of every path.

`p03-11` is the path taking expert 3 in every layer of level 0 and expert 11 in level 1. E^G paths
in all: G=1 gives one path per expert (Branch-Train-MiX / HDEE), G=2 with E=16 gives DiPaCo's 256.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from paths.errors import ConfigurationError

_ID = re.compile(r"p(\d+(?:-\d+)*)")


@dataclass(frozen=True, slots=True)
class Plan:
    """How the layers of an E-expert MoE are grouped into levels."""

    num_layers: int
    num_experts: int
    levels: int
    sparse: tuple[int, ...] | None = None  # the layers with experts (None: every layer)

    def __post_init__(self) -> None:
        if self.sparse is not None and tuple(self.sparse) == tuple(range(self.num_layers)):
            object.__setattr__(self, "sparse", None)  # every layer has experts: the plain form (and its JSON) as before
        if not 1 <= self.levels <= len(self.sparse_layers):
            which = "layers" if self.sparse is None else "layers with experts"
            raise ConfigurationError(f"--levels must be between 1 and the number of {which} ({len(self.sparse_layers)}), got {self.levels}")
        if self.num_experts < 1:
            raise ConfigurationError(f"a plan needs at least one expert, got {self.num_experts}")

    @property
    def sparse_layers(self) -> list[int]:
        """The layers with experts, in order."""
        return list(range(self.num_layers)) if self.sparse is None else list(self.sparse)

    @property
    def level_layers(self) -> list[range]:
        """The layers of each level: contiguous, as even as possible in layers with experts,
        earlier levels larger (a dense layer inside a level has no expert to choose)."""
        sparse = self.sparse_layers
        base, extra = divmod(len(sparse), self.levels)
        out, start = [], 0
        for g in range(self.levels):
            n = base + (1 if g < extra else 0)
            out.append(range(sparse[start], sparse[start + n - 1] + 1))
            start += n
        return out

    @property
    def width(self) -> int:
        """Digits per expert index in path ids (at least 2: p03-11)."""
        return max(2, len(str(self.num_experts - 1)))

    @property
    def num_paths(self) -> int:
        """E^G."""
        return self.num_experts**self.levels

    def path_id(self, choice: tuple[int, ...]) -> str:
        """The id of the path choosing these experts per level."""
        return "p" + "-".join(f"{e:0{self.width}d}" for e in choice)

    def parse(self, path_id: str) -> tuple[int, ...]:
        """Expert per level of a path id, validated against this plan."""
        m = _ID.fullmatch(path_id)
        fix = f"path ids look like {self.path_id(tuple([0] * self.levels))} ({self.levels} levels, experts 0..{self.num_experts - 1})"
        if not m:
            raise ConfigurationError(f"malformed path id {path_id!r}: {fix}")
        parts = m.group(1).split("-")
        if len(parts) != self.levels or any(len(p) != self.width for p in parts):
            raise ConfigurationError(f"path id {path_id!r} does not fit this plan: {fix}")
        choice = tuple(int(p) for p in parts)
        if any(e >= self.num_experts for e in choice):
            raise ConfigurationError(f"path id {path_id!r} names an expert out of range: {fix}")
        return choice

    def experts_per_layer(self, path_id: str) -> list[int]:
        """The expert a path uses in each layer."""
        choice = self.parse(path_id)
        out = [-1] * self.num_layers  # -1: a dense layer
        sparse = set(self.sparse_layers)
        for g, layers in enumerate(self.level_layers):
            for layer in layers:
                if layer in sparse:
                    out[layer] = choice[g]
        return out

    def all_paths(self) -> list[str]:
        """Every path id, in order."""
        return [self.path_id(c) for c in itertools.product(range(self.num_experts), repeat=self.levels)]

    def select(self, spec: str) -> list[str]:
        """'all' or a comma-separated list of ids (validated, de-duplicated, in given order)."""
        if spec.strip() == "all":
            return self.all_paths()
        ids = [s.strip() for s in spec.split(",") if s.strip()]
        if not ids:
            raise ConfigurationError("--paths is empty: give 'all' or ids like p00-01,p02-03")
        for i in ids:
            self.parse(i)
        return list(dict.fromkeys(ids))

    def to_json(self) -> dict[str, Any]:
        """JSON form, as stored in run.json and path.json."""
        return {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "levels": self.levels,
            "level_layers": [[r.start, r.stop] for r in self.level_layers],
            **({"sparse": list(self.sparse)} if self.sparse is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Plan":
        """Inverse of to_json."""
        return cls(num_layers=d["num_layers"], num_experts=d["num_experts"], levels=d["levels"], sparse=tuple(d["sparse"]) if "sparse" in d else None)
