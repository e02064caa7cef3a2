"""Naming an environment: `verifiers:MODULE[:k=v,...]` or `reasoning-gym:TASK[:k=v,...]`.

A spec is accepted wherever a prompt dataset is made (`paths shard --input`) and wherever rewards
are named (`--reward`). Argument values are read as JSON where they parse (`size=200`,
`hard=true`, `names=["a","b"]`), else kept as text. The package a spec needs and the version
installed here are recorded in the dataset's manifest, so a machine with another version stops
with one line instead of scoring differently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from paths.errors import ConfigurationError

Kind = Literal["verifiers", "reasoning-gym"]
PACKAGES: dict[str, str] = {"verifiers": "verifiers", "reasoning-gym": "reasoning-gym"}
EXTRA = "pip install 'paths[envs]'"
_ARG_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.-]*=)")  # a comma before the next `key=`: values may hold commas (JSON lists)


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """One environment with its arguments, as the user wrote it."""

    kind: Kind
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        args = ",".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(self.args.items()))
        return f"{self.kind}:{self.name}" + (f":{args}" if args else "")

    @property
    def label(self) -> str:
        """The short name metrics use: kind and name, no arguments."""
        return f"{self.kind}:{self.name}"

    @property
    def package(self) -> str:
        return PACKAGES[self.kind]

    def installed(self) -> str:
        """The installed version of the package this environment needs; a one-line error if none."""
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            raise ConfigurationError(f"environment {self.text!r} needs the {self.package} package, which is not installed: {EXTRA}") from None

    def provenance(self) -> dict[str, str]:
        return {"spec": self.text, "package": self.package, "version": self.installed()}


def is_env(text: str) -> bool:
    return text.partition(":")[0] in PACKAGES


def parse(text: str) -> EnvSpec:
    """`KIND:NAME[:k=v,...]` as an EnvSpec; a one-line error naming what is wrong."""
    kind, _, rest = text.partition(":")
    if kind not in PACKAGES:
        raise ConfigurationError(f"{text!r} is not an environment: write verifiers:MODULE[:k=v,...] or reasoning-gym:TASK[:k=v,...]")
    name, _, arg_text = rest.partition(":")
    if not name and kind == "verifiers":
        raise ConfigurationError(f"environment {text!r} names no module: write verifiers:MODULE[:k=v,...]")
    args: dict[str, Any] = {}
    for item in filter(None, _ARG_SPLIT.split(arg_text)):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigurationError(f"environment {text!r}: argument {item!r} is not k=v: write {kind}:{name or 'NAME'}:k=v,k2=v2")
        try:
            args[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip()] = value
    return EnvSpec(kind, name, args)  # type: ignore[arg-type]


def check_versions(recorded: list[dict[str, str]], what: str) -> None:
    """Stop when an environment's package here is missing or not the version `what` was made with."""
    for entry in recorded:
        spec = parse(entry["spec"])
        try:
            here = metadata.version(entry["package"])
        except metadata.PackageNotFoundError:
            raise ConfigurationError(f"{what} uses environment {spec.text!r} from {entry['package']} {entry['version']}, which is not installed here: "
                                     f"pip install '{entry['package']}=={entry['version']}'") from None
        if here != entry["version"]:
            raise ConfigurationError(f"{what} was made with {entry['package']} {entry['version']} but this machine has {here}: "
                                     f"pip install '{entry['package']}=={entry['version']}'")
