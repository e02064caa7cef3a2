"""Document routers: each scores every target path for a document; routing takes the best path
(or the best one with room left, when balanced). Four kinds, all saved to `router/<name>/` so that
`paths route` and evaluation put new documents where training put theirs:

- `hash`   a stable hash of the id (or the text): the uniform baseline;
- `domain` a record field names the domain; a mapping file gives its path (one-level plans can
           go without one: the sorted domains take experts 0, 1, ...);
- `moe`    the base MoE's own routers over the document's first tokens: probabilities averaged
           over the prefix and over the layers of each level; score = sum of log-probabilities;
- `kmeans` DiPaCo: (product) k-means over the mean hidden state of the prefix (the base model's,
           or any HF encoder's with --features-model); score = -sum of squared distances.

Shapes: N documents, P target paths, G levels, E experts, T prefix tokens, H hidden size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from paths.errors import ConfigurationError, DataError, NotFound
from paths.plan import Plan
from sharding.inputs import Record
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest, read_verified

ROUTERS = ("hash", "domain", "moe", "kmeans")
STATE = "router.safetensors"


@dataclass(slots=True)
class Doc:
    """A record with its token ids (EOS included)."""

    record: Record
    ids: list[int]

    @property
    def key(self) -> str:
        return self.record.id or self.record.text


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@dataclass(slots=True)
class Router:
    """What every router shares: the plan and the target paths (in the plan's order)."""

    plan: Plan | None  # None: the targets are expert domains, not paths of a plan
    paths: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = ""
    needs_fit: ClassVar[bool] = False

    @property
    def choices(self) -> np.ndarray:
        """(P, G) expert index per level of each target path."""
        return np.array([self.plan.parse(p) for p in self.paths], dtype=np.int64)

    def fit(self, docs: list[Doc], run: Run) -> None:
        """Learn what the router needs from a sample (no-op for most kinds)."""

    def scores(self, docs: list[Doc], run: Run) -> np.ndarray:
        """(N, P) float32: higher is a better path for the document."""
        raise NotImplementedError

    def level_scores_to_paths(self, m_NGE: np.ndarray) -> np.ndarray:
        """Sum each level's score of the path's expert: (N, G, E) -> (N, P)."""
        c_PG = self.choices
        return sum(m_NGE[:, g, c_PG[:, g]] for g in range(self.plan.levels)).astype(np.float32)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What must be saved besides router.json."""
        return {}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "plan": self.plan.to_json() if self.plan else None, "paths": self.paths, "options": self.options}


class HashRouter(Router):
    """Path = hash mod P; the next paths (cyclically) are its second, third... choices."""

    kind = "hash"

    def scores(self, docs: list[Doc], run: Run) -> np.ndarray:
        p = len(self.paths)
        first = np.array([stable_hash(d.key) % p for d in docs], dtype=np.int64)  # (N,)
        return -((np.arange(p)[None, :] - first[:, None]) % p).astype(np.float32)


class DomainRouter(Router):
    """Every document of a domain goes to that domain's path."""

    kind = "domain"
    needs_fit = True

    def fit(self, docs: list[Doc], run: Run) -> None:
        if self.options.get("domain_map"):
            return
        if self.plan is None:  # targets are the experts' domains themselves
            self.options["domain_map"] = {d: d for d in self.paths}
            return
        domains = sorted({d.record.domain for d in docs if d.record.domain is not None})
        if self.plan.levels != 1:
            raise ConfigurationError(
                f"the domain router needs --domain-map on a {self.plan.levels}-level plan (one expert per domain works only with --levels 1)"
            )
        if len(domains) > len(self.paths):
            raise ConfigurationError(
                f"{len(domains)} domains ({', '.join(domains[:6])}...) but only {len(self.paths)} paths: pass --domain-map to share paths"
            )
        self.options["domain_map"] = {d: self.paths[i] for i, d in enumerate(domains)}

    def scores(self, docs: list[Doc], run: Run) -> np.ndarray:
        mapping: dict[str, str] = self.options["domain_map"]
        index = {p: i for i, p in enumerate(self.paths)}
        out = np.full((len(docs), len(self.paths)), -np.inf, dtype=np.float32)
        for n, d in enumerate(docs):
            domain = d.record.domain
            if domain not in mapping:
                raise DataError(
                    f"document {d.record.id or n} has domain {domain!r}, which the router does not know "
                    f"(known: {', '.join(sorted(mapping))}): add it to --domain-map"
                )
            out[n, index[mapping[domain]]] = 0.0
        return out


class _ModelRouter(Router):
    """Routers that run a model over each document's first `prefix_tokens` tokens."""

    _model: Any = None

    def model(self, run: Run):
        if self._model is None:
            from paths.models import load_base_model

            self._model = load_base_model(run)
            limit = getattr(self._model.config, "max_position_embeddings", None)
            if limit and self.options["prefix_tokens"] > limit:
                raise ConfigurationError(
                    f"--prefix-tokens {self.options['prefix_tokens']} is longer than the model's context ({limit}): lower it"
                )
        return self._model

    def batches(self, docs: list[Doc], batch: int = 32):
        """(input_ids (B, T), attention_mask (B, T)) of the prefixes, right-padded."""
        t = self.options["prefix_tokens"]
        for i in range(0, len(docs), batch):
            prefixes = [d.ids[:-1][:t] or d.ids[:1] for d in docs[i : i + batch]]
            width = max(len(p) for p in prefixes)
            ids = torch.zeros(len(prefixes), width, dtype=torch.long)
            mask = torch.zeros(len(prefixes), width, dtype=torch.long)
            for r, p in enumerate(prefixes):
                ids[r, : len(p)] = torch.tensor(p)
                mask[r, : len(p)] = 1
            yield ids, mask


class MoERouter(_ModelRouter):
    """The base MoE's routers, averaged over the prefix and the layers of each level."""

    kind = "moe"

    def scores(self, docs: list[Doc], run: Run) -> np.ndarray:
        from paths.families import fill, get_family

        model = self.model(run)
        family = get_family(run.read_meta()["base"]["family"])
        layers = self.plan.sparse_layers
        modules = [model.get_submodule(fill(family.router["memory"], layer).rsplit(".", 1)[0]) for layer in layers]
        captured: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(_capture(captured, layer)) for layer, m in zip(layers, modules)]
        out = []
        try:
            with torch.inference_mode():
                for ids, mask in self.batches(docs):
                    model(input_ids=ids, attention_mask=mask)
                    b, t = ids.shape
                    w_BT1 = (mask / mask.sum(1, keepdim=True)).unsqueeze(-1).float()
                    per_level = []
                    for span in self.plan.level_layers:
                        probs = [captured[layer].reshape(b, t, -1).float().softmax(-1) for layer in span if layer in captured]  # dense layers route nothing
                        p_BE = torch.stack([(p_BTE * w_BT1).sum(1) for p_BTE in probs]).mean(0)
                        per_level.append(p_BE)
                    out.append(torch.stack(per_level, dim=1).clamp_min(1e-12).log())  # (B, G, E)
        finally:
            for h in hooks:
                h.remove()
        return self.level_scores_to_paths(torch.cat(out).numpy())


def _capture(store: dict[int, torch.Tensor], layer: int):
    def hook(module: torch.nn.Module, args: Any, output: Any):
        store[layer] = output[0] if isinstance(output, tuple) else output  # (B*T, E) logits

    return hook


class KMeansRouter(_ModelRouter):
    """DiPaCo's router: product k-means over the mean hidden state of the prefix."""

    kind = "kmeans"
    needs_fit = True
    centroids: torch.Tensor | None = None  # (G, E, D/G)
    _features: Any = None

    def features(self, docs: list[Doc], run: Run) -> torch.Tensor:
        """(N, D) mean hidden state over each prefix."""
        if self.options.get("features_model"):
            return self._encoder_features(docs)
        model = self.model(run).base_model
        out = []
        with torch.inference_mode():
            for ids, mask in self.batches(docs):
                h_BTH = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                out.append((h_BTH * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
        return torch.cat(out)

    def _encoder_features(self, docs: list[Doc]) -> torch.Tensor:
        from transformers import AutoModel, AutoTokenizer

        if self._features is None:
            folder = self.options["features_model"]
            try:
                self._features = (AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder, dtype=torch.float32).eval())
            except (OSError, ValueError) as exc:
                raise ConfigurationError(f"--features-model {folder} cannot be loaded ({exc}): give an HF model folder") from None
        tok, model = self._features
        out = []
        with torch.inference_mode():
            for i in range(0, len(docs), 32):
                texts = [d.record.text for d in docs[i : i + 32]]
                enc = tok(texts, truncation=True, max_length=self.options["prefix_tokens"], padding=True, return_tensors="pt")
                h_BTH = model(**enc).last_hidden_state.float()
                mask = enc["attention_mask"].unsqueeze(-1)
                out.append((h_BTH * mask).sum(1) / mask.sum(1))
        return torch.cat(out)

    def fit(self, docs: list[Doc], run: Run) -> None:
        from sharding.kmeans import product_kmeans

        self.centroids = product_kmeans(self.features(docs, run), self.plan.levels, self.plan.num_experts, self.options.get("seed", 0))

    def scores(self, docs: list[Doc], run: Run) -> np.ndarray:
        from sharding.kmeans import level_distances

        assert self.centroids is not None, "fit() or load before scoring"
        return self.level_scores_to_paths(-level_distances(self.features(docs, run), self.centroids).numpy())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"centroids": self.centroids.contiguous()}


KINDS: dict[str, type[Router]] = {r.kind: r for r in (HashRouter, DomainRouter, MoERouter, KMeansRouter)}


def make_router(kind: str, plan: Plan, paths: list[str], options: dict[str, Any]) -> Router:
    """A new, unfitted router of a kind."""
    if kind not in KINDS:
        raise ConfigurationError(f"unknown router {kind!r}: choose one of {', '.join(ROUTERS)}")
    return KINDS[kind](plan=plan, paths=list(paths), options=dict(options))


def load_domain_map(path: str, paths: list[str], plan: Plan | None) -> dict[str, str]:
    """A JSON or TOML file {domain: path id or expert index (one-level plans)}."""
    try:
        raw = open(path, "rb").read()
        if path.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                import tomli as tomllib
            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"--domain-map {path} cannot be read ({exc}): give a JSON or TOML table of domain = path id") from None
    if not isinstance(data, dict) or not data:
        raise ConfigurationError(f"--domain-map {path} must be a non-empty table of domain = path id")
    out = {}
    for domain, target in data.items():
        pid = plan.path_id((int(target),)) if plan is not None and isinstance(target, int) and plan.levels == 1 else str(target)
        if pid not in paths:
            what = "a registered expert domain" if plan is None else "a decomposed path"
            raise ConfigurationError(f"--domain-map {path} sends {domain!r} to {target!r}, which is not {what} of this run")
        out[str(domain)] = pid
    return out


def save_router(run: Run, name: str, router: Router, provenance: dict[str, Any]) -> dict[str, Any]:
    """router/<name>/router.json + router.safetensors, manifest last."""
    from safetensors.torch import save

    writer = ArtifactWriter(run.store, run.router(name))
    writer.write(STATE, save(router.tensors(), metadata={"kind": router.kind}))
    body = {**router.to_json(), "provenance": provenance}
    writer.write_json("router.json", body)
    writer.commit(kind="router", router=router.kind)
    return body


def load_router(run: Run, name: str) -> Router:
    """A saved router, checked against its manifest."""
    from safetensors.torch import load

    try:
        read_manifest(run.store, run.router(name))
    except NotFound:
        raise NotFound(f"no router {name!r} in {run.url} (router/{name}/): shard a dataset with it first, or name another") from None
    body = json.loads(read_verified(run.store, run.router(name), "router.json"))
    router = make_router(body["kind"], Plan.from_json(body["plan"]) if body["plan"] else None, body["paths"], body["options"])
    tensors = load(read_verified(run.store, run.router(name), STATE))
    if isinstance(router, KMeansRouter):
        router.centroids = tensors["centroids"]
    return router
