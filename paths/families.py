"""MoE families as data: one TOML per family in configs/families/ (mergekit's habit).

A family says where the router and expert tensors live (in memory: fused 3-D; on disk: per expert),
which class a path becomes, and how MoE config fields map to the path's. A path takes one of two
forms (`path_form`): "dense", the family's dense sibling with the chosen expert as each layer's
MLP (Mixtral -> Mistral), or "moe", the family's own class with one routed expert per layer, for a
family no dense class reproduces (a gated shared expert, norms no dense class has): its router
(one row, the chosen expert's) gives weight 1 whatever it holds, since softmax over one expert is
1. A family whose router cannot run with one expert (DeepSeek-V3's group-limited top-k takes two
experts a group) pads its "moe" paths (`[path]`): `experts = 2` with the others zero and never
chosen, `router = "zeros"`, and `fill` for router extras such as a selection bias that always
picks expert 0. A family whose router scales the chosen weights (`routed_scaling_factor`) names
that field as `forced_weight_field`: forcing one expert gives it that weight, in the MoE and in
the path alike. Adding a family is adding a file; nothing here names a family.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from paths.errors import ConfigurationError
from paths.plan import Plan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PARTS = ("gate", "up", "down")
Part = Literal["gate", "up", "down"]


def _regex(template: str) -> re.Pattern[str]:
    """'a.${layer}.b.${expert}' -> a regex with named groups layer and expert."""
    out = re.escape(template)
    out = out.replace(re.escape("${layer}"), r"(?P<layer>\d+)").replace(re.escape("${expert}"), r"(?P<expert>\d+)")
    return re.compile(out + "$")


def _field(config: Any, name: str | None) -> Any:
    """A config field from a config.json dict or a transformers config (None: not there, or no name)."""
    if name is None:
        return None
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def fill(template: str, layer: int, expert: int | None = None) -> str:
    """Expand a tensor-name template."""
    name = template.replace("${layer}", str(layer))
    return name.replace("${expert}", str(expert)) if expert is not None else name


@dataclass(frozen=True, slots=True)
class TensorRole:
    """What a tensor of the MoE is: shared, a router, or one projection of one expert."""

    kind: Literal["shared", "router", "expert", "fused"]
    layer: int | None = None
    expert: int | None = None
    part: str | None = None  # gate/up/down per expert; gate_up/down for fused tensors


@dataclass(frozen=True, slots=True)
class Family:
    """One MoE family and its dense sibling, read from configs/families/<name>.toml."""

    name: str
    moe_model_type: str
    moe_architecture: str
    dense_model_type: str
    dense_architecture: str
    num_experts_field: str
    num_experts_aliases: tuple[str, ...]
    top_k_field: str
    router: dict[str, str]
    experts_memory: dict[str, str]
    experts_disk: dict[str, str]
    experts_dense: dict[str, str]
    dense_copy: tuple[str, ...]
    dense_rename: dict[str, str]
    require: dict[str, Any]
    upcycle_set: dict[str, Any]
    path_form: Literal["dense", "moe"] = "dense"
    dense_set: dict[str, Any] | None = None  # fields the path config sets (a "moe" path: one expert, top-1)
    router_extras: tuple[str, ...] = ()  # router tensors besides its weight (a selection bias), one entry per expert
    forced_weight_field: str | None = None  # the config field a forced expert's weight is (else 1)
    groups_field: str | None = None  # the config field of group-limited routing's groups (each needs 2 experts or more)
    path_experts: int = 1  # experts a "moe" path holds: the chosen one first, zeros after it
    path_router: Literal["row", "zeros"] = "row"  # a "moe" path's router: the chosen expert's row of the base's, or zeros
    path_fill: dict[str, list[float]] | None = None  # router extras of a "moe" path, as values
    dense_layers: dict[str, str] | None = None  # config fields that make layers dense: first_k, only (a list), step

    def sparse_layers(self, config: Any) -> list[int]:
        """The layers with experts: every one, but those the config makes dense (the class's rules,
        named in the family's `dense_layers`)."""
        spec = self.dense_layers or {}
        first = int(_field(config, spec.get("first_k")) or 0)
        only = set(_field(config, spec.get("only")) or [])
        step = int(_field(config, spec.get("step")) or 1)
        return [l for l in range(int(_field(config, "num_hidden_layers"))) if l >= first and l not in only and (l + 1) % step == 0]

    def plan(self, config: dict[str, Any], levels: int) -> Plan:
        """The plan of an MoE of this family with `levels` levels over its layers with experts."""
        return Plan(int(config["num_hidden_layers"]), self.num_experts(config), levels, tuple(self.sparse_layers(config)))

    def forced_weight(self, config: Any) -> float:
        """The weight a token sent to one expert gets (routed_scaling_factor for DeepSeek-V3's router)."""
        value = _field(config, self.forced_weight_field)
        return 1.0 if value is None else float(value)

    def router_groups(self, config: Any) -> int:
        """Groups of group-limited routing (DeepSeek-V3's n_group; 1 where routing is not grouped)."""
        return int(_field(config, self.groups_field) or 1)

    @property
    def has_dense_sibling(self) -> bool:
        return self.path_form == "dense"

    # -- tensor names ---------------------------------------------------------------------------
    def disk_expert(self, layer: int, expert: int, part: Part) -> str:
        """Per-expert tensor name as saved on disk."""
        return fill(self.experts_disk[part], layer, expert)

    def dense_mlp(self, layer: int, part: Part) -> str:
        """Where a path keeps its chosen expert's projection, as saved (the dense sibling's MLP, or
        expert 0 of a "moe" path)."""
        return fill(self.experts_dense[part], layer)

    def path_expert_parameters(self, layer: int) -> list[str]:
        """The path's own parameters of a layer (its expert), as a loaded model names them."""
        if self.has_dense_sibling:
            return [self.dense_mlp(layer, p) for p in PARTS]
        return [fill(t, layer) for t in self.experts_memory.values()]

    def mlp_module(self, layer: int) -> str:
        """The module of a path model whose input is what the MoE's router sees."""
        if self.has_dense_sibling:
            return self.dense_mlp(layer, "gate").rsplit(".", 2)[0]
        return fill(self.router["memory"], layer).rsplit(".", 2)[0]

    def classify(self, name: str) -> TensorRole:
        """The role of a tensor of the MoE, by its disk or memory name."""
        for layout in ("disk", "memory"):
            m = _regex(self.router[layout]).match(name)
            if m:
                return TensorRole("router", int(m["layer"]))
        for template in self.router_extras:
            m = _regex(template).match(name)
            if m:
                return TensorRole("router", int(m["layer"]), part="extra")
        for part, template in self.experts_disk.items():
            m = _regex(template).match(name)
            if m:
                return TensorRole("expert", int(m["layer"]), int(m["expert"]), part)
        for part, template in self.experts_memory.items():
            m = _regex(template).match(name)
            if m:
                return TensorRole("fused", int(m["layer"]), None, part)
        return TensorRole("shared")

    # -- configs --------------------------------------------------------------------------------
    def num_experts(self, moe_config: dict[str, Any]) -> int:
        """Experts per layer of an MoE config."""
        for key in (self.num_experts_field, *self.num_experts_aliases):
            if key in moe_config:
                return int(moe_config[key])
        raise ConfigurationError(f"{self.name} config has no {self.num_experts_field}: it is not an MoE config")

    def check_moe_config(self, moe_config: dict[str, Any]) -> None:
        """Refuse MoE configs that paths cannot decompose (e.g. dense layers in between)."""
        for key, want in self.require.items():
            if key in moe_config and moe_config[key] != want:
                raise ConfigurationError(
                    f"{self.name} config has {key}={moe_config[key]!r}; paths needs {key}={want!r} "
                    "(every layer an MoE layer)"
                )

    def dense_config(self, moe_config: dict[str, Any]) -> dict[str, Any]:
        """The config of a path of this MoE: the dense sibling's, every shared field copied (or, a
        "moe" path, the MoE's own with one expert and top-1)."""
        if self.dense_copy == ("*",):
            out = {k: v for k, v in moe_config.items() if k not in (*self.num_experts_aliases, "architectures", "model_type")}
        else:
            out = {k: moe_config[k] for k in self.dense_copy if k in moe_config}
        for src, dst in self.dense_rename.items():
            out[dst] = moe_config[src]
        out.update(self.dense_set or {})
        out["model_type"] = self.dense_model_type
        out["architectures"] = [self.dense_architecture]
        return out

    def moe_config(self, dense_config: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
        """The MoE config of a dense model upcycled to `experts` experts."""
        out = {k: dense_config[k] for k in self.dense_copy if k in dense_config}
        for src, dst in self.dense_rename.items():
            out[src] = dense_config[dst]
        out.update(self.upcycle_set)
        out.update({self.num_experts_field: experts, self.top_k_field: top_k})
        out["model_type"] = self.moe_model_type
        out["architectures"] = [self.moe_architecture]
        return out


@cache
def families() -> dict[str, Family]:
    """Every family described in configs/families/, by name."""
    out = {}
    folder = os.path.join(CONFIGS, "families")
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".toml"):
            with open(os.path.join(folder, fname), "rb") as f:
                d = tomllib.load(f)
            out[d["name"]] = _check(Family(
                name=d["name"],
                moe_model_type=d["moe_model_type"],
                moe_architecture=d["moe_architecture"],
                dense_model_type=d["dense_model_type"],
                dense_architecture=d["dense_architecture"],
                num_experts_field=d["num_experts_field"],
                num_experts_aliases=tuple(d.get("num_experts_aliases", ())),
                top_k_field=d["top_k_field"],
                router={k: v for k, v in d["router"].items() if k != "extras"},
                router_extras=tuple(d["router"].get("extras", ())),
                forced_weight_field=d.get("forced_weight_field"),
                groups_field=d.get("groups_field"),
                path_experts=int(d.get("path", {}).get("experts", 1)),
                path_router=d.get("path", {}).get("router", "row"),
                path_fill=d.get("path", {}).get("fill"),
                dense_layers=d.get("dense_layers"),
                experts_memory=d["experts"]["memory"],
                experts_disk=d["experts"]["disk"],
                experts_dense=d["experts"]["dense"],
                dense_copy=tuple(d["dense_config"]["copy"]),
                dense_rename=d["dense_config"].get("rename", {}),
                require=d.get("require", {}),
                upcycle_set=d.get("upcycle_set", {}),
                path_form=d.get("path_form", "dense"),
                dense_set=d["dense_config"].get("set"),
            ), os.path.join(folder, fname))
    return out


def _check(fam: Family, path: str) -> Family:
    """A family file's values that the code branches on: a typo is one line, not a broken path."""
    if fam.path_form not in ("dense", "moe") or fam.path_router not in ("row", "zeros") or fam.path_experts < 1:
        raise ConfigurationError(f"{path}: path_form must be dense or moe, [path] router row or zeros, [path] experts >= 1")
    if fam.dense_layers and fam.path_form == "dense":
        raise ConfigurationError(f"{path}: dense_layers needs path_form = \"moe\" (a dense sibling has one MLP width for every layer)")
    for template, values in (fam.path_fill or {}).items():
        if len(values) != fam.path_experts:
            raise ConfigurationError(f"{path}: [path] fill {template} has {len(values)} values for {fam.path_experts} experts: give one per expert")
    return fam


def get_family(name: str) -> Family:
    """A family by name."""
    try:
        return families()[name]
    except KeyError:
        raise ConfigurationError(f"unknown MoE family {name!r}: supported are {', '.join(sorted(families()))}") from None


def family_of_config(config: dict[str, Any], what: str) -> Family:
    """The family of an MoE config (by model_type), or a clear error naming the supported ones."""
    model_type = config.get("model_type")
    for fam in families().values():
        if fam.moe_model_type == model_type:
            return fam
    supported = ", ".join(f"{f.moe_model_type} ({f.moe_architecture})" for f in families().values())
    raise ConfigurationError(f"{what} is a {model_type!r} model, not a supported MoE: supported are {supported}; "
                             f"a family is data: add configs/families/<name>.toml, written like the ones there (README: MoE families)")


def family_of_dense_config(config: dict[str, Any], what: str) -> Family:
    """The family whose dense sibling this config is (for upcycling)."""
    model_type = config.get("model_type")
    for fam in families().values():
        if fam.has_dense_sibling and fam.dense_model_type == model_type:
            return fam
    supported = ", ".join(f"{f.dense_model_type} ({f.dense_architecture})" for f in families().values() if f.has_dense_sibling)
    raise ConfigurationError(f"{what} is a {model_type!r} model; upcycling supports {supported}")
