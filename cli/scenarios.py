"""The embedded default end to end: a local folder as the object store and a tiny model.

Each stage is a (title, callable) pair; the CLI runs them in order and renders each result, so
later stages (shard, train, compose) are appended here as they exist. Running it again reuses what
the run already holds.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

from storage import admin

DEFAULT_ROOT = "runs/quickstart"
PRESET = "tiny-mixtral"
LEVELS = 2
PATH = "p01-02"
DATASET = "corpus"
LM_DATASET = "corpus-moe"
TRAIN_STEPS = 4
RL_DATASET = "arithmetic"
RL_PROMPTS = 800
RL_STEPS = 8
REWARDS = ["math_answer", "format=0.5"]
COMPOSED = "quickstart"
DOMAINS = {"code": "p00-00", "prose": "p01-02", "math": "p03-03"}

Stage = tuple[str, Callable[[], Any]]


def _opening(run, root: str, levels: int) -> Iterator[Stage]:
    """Every scenario's start: the run, the tiny base (reused when there), the plan."""
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose, describe

    yield f"paths storage init {root}", lambda: f"run at {run.url}"
    if "base" in run.read_meta():
        yield f"paths init {root} --preset {PRESET}", lambda: "(the run already holds a base model: reused)"
    else:
        yield f"paths init {root} --preset {PRESET}", lambda: _init(init_run, root)
    yield f"paths decompose {root} --levels {levels}", lambda: _decomposed(decompose(run, levels))
    yield f"paths plan {root}", lambda: describe(run)


def stages(root: str = DEFAULT_ROOT) -> Iterator[Stage]:
    """The quickstart's stages in order, for a run at `root`."""
    from paths.models import materialize

    run = admin.init(root)
    yield from _opening(run, root, LEVELS)
    corpus = os.path.join(os.path.dirname(os.path.abspath(root)), "quickstart-corpus")
    domain_map = os.path.join(corpus, "domains.json")
    yield "write a corpus found on this machine (code: stdlib sources, prose: pydoc topics, math: generated)", lambda: _corpus(corpus, domain_map)
    yield (
        f"paths shard {root} --dataset {DATASET} --input '{corpus}/*.jsonl' --id-field id --router domain --domain-field domain --domain-map {domain_map}",
        lambda: _shard(run, corpus, domain_map),
    )
    yield f"paths shard {root} --dataset {LM_DATASET} --input '{corpus}/*.jsonl' --id-field id --router moe", lambda: _shard_lm(run, corpus)
    yield f"while paths claim {root} --ttl 60; do paths train --dataset {LM_DATASET} --steps {TRAIN_STEPS}; done", lambda: _train_all(run)
    yield f"paths status {root}", lambda: _status(run)
    tasks = os.path.join(os.path.dirname(os.path.abspath(root)), "quickstart-tasks", "arithmetic.jsonl")  # not in the corpus glob
    yield f"paths gen-tasks arithmetic --n {RL_PROMPTS} --levels 1,2 --out {tasks}", lambda: _tasks(tasks)
    yield f"paths shard {root} --dataset {RL_DATASET} --input {tasks} --kind prompts --text-field prompt --id-field id --router moe --holdout 0.2", lambda: _shard_rl(run, tasks)
    yield (
        f"paths release {root} --path P && paths claim {root} --path P && paths train --mode grpo --init final "
        f"--dataset {RL_DATASET} --reward math_answer --reward format=0.5 --steps {RL_STEPS}   (P: the path with the most held-out prompts)",
        lambda: _grpo(run),
    )
    yield f"paths compose {root} --into moe --name {COMPOSED} --overwrite", lambda: _compose(run)
    yield (
        f"paths finetune-moe {root} --model composed:{COMPOSED} --dataset {LM_DATASET} --train router --steps {FT_STEPS} --overwrite   (Branch-Train-MiX: routers learn on mixed data)",
        lambda: _finetune(run),
    )
    models = ["base", *(f"path:{p}" for p in sorted(set(DOMAINS.values()))), f"composed:{COMPOSED}", f"composed:{COMPOSED}-ft"]
    yield f"paths eval {root} --dataset {DATASET} " + " ".join(f"--model {m}" for m in models), lambda: _eval(run, models)
    yield from _hdee_stages(run, root, corpus)
    out = os.path.join(os.path.dirname(os.path.abspath(root)), f"quickstart-{PATH}")
    yield f"paths materialize {root} --path {PATH} --out {out}", lambda: materialize(run, PATH, out)
    yield f"AutoModelForCausalLM.from_pretrained({out!r})", lambda: _load(out)
    yield f"paths storage ls {root} --prefix composed/{COMPOSED}", lambda: admin.ls(run, f"composed/{COMPOSED}")
    yield f"paths storage du {root}", lambda: admin.du(run)
    yield f"paths storage verify {root}", lambda: admin.verify(run)


# HDEE: domain experts of different sizes and step budgets (harder domains get more), against
# the same three domains with one size and budget, each set ensembled (ELMForest posterior).
HDEE = {"code-m": ("code", "tiny-m", 40), "prose-s": ("prose", "tiny-s", 30), "math-xs": ("math", "tiny-xs", 20)}
HOMOGENEOUS = {"code-h": ("code", "tiny-s", 30), "prose-h": ("prose", "tiny-s", 30), "math-h": ("math", "tiny-s", 30)}
EXPERT_DATASET = "experts"


def _hdee_stages(run, root: str, corpus: str) -> Iterator[Stage]:
    for name, (domain, preset, steps) in {**HDEE, **HOMOGENEOUS}.items():
        yield f"paths expert add {root} --name {name} --domain {domain} --preset {preset} --steps {steps}", lambda n=name: _add_expert(run, n)
    yield f"paths expert ls {root}", lambda: _experts(run)
    yield (
        f"paths shard {root} --dataset {EXPERT_DATASET} --input '{corpus}/*.jsonl' --id-field id --router domain --targets domains --domain-field domain --holdout 0.1",
        lambda: _shard_experts(run, corpus),
    )
    yield f"while paths claim {root} --ttl 60; do paths train --dataset {EXPERT_DATASET}; done   (each expert runs its own --steps budget)", lambda: _train_experts(run)
    for name, members in (("hdee", HDEE), ("homogeneous", HOMOGENEOUS)):
        yield (
            f"paths compose {root} --into ensemble --name {name} --members {','.join(members)} --mix posterior --prior-data {EXPERT_DATASET} --overwrite",
            lambda n=name, m=members: _ensemble(run, n, list(m)),
        )
    models = [f"composed:{COMPOSED}", "composed:homogeneous", "composed:hdee", *(f"expert:{n}" for n in HDEE)]
    yield f"paths eval {root} --dataset {EXPERT_DATASET} " + " ".join(f"--model {m}" for m in models), lambda: _eval_experts(run, models)


def _add_expert(run, name: str) -> str:
    from experts.domain import add_expert
    from paths.units import expert_info

    domain, preset, steps = {**HDEE, **HOMOGENEOUS}[name]
    if run.store.exists(f"{run.expert(name)}/manifest.json"):
        info = expert_info(run, name)
        return f"expert {name} is already registered ({info['parameters']:,} parameters)"
    info = add_expert(run, name, domain, preset=preset, steps=steps)
    return f"expert {name} ({domain}): {info['config']['num_hidden_layers']} layers x {info['config']['hidden_size']}, {info['parameters']:,} parameters, {steps} steps"


def _experts(run) -> str:
    from paths.units import list_experts

    rows = [f"{n:8} {e['domain']:6} {e['parameters']:>9,} parameters  {e['steps']} steps" for n, e in list_experts(run).items()]
    return "\n".join(rows)


def _shard_experts(run, corpus: str) -> dict[str, Any]:
    from sharding.shard import ShardOptions, shard

    return shard(run, ShardOptions(dataset=EXPERT_DATASET, inputs=[f"{corpus}/*.jsonl"], id_field="id", router="domain", targets="domains", domain_field="domain", holdout=0.1))


def _train_experts(run) -> str:
    """The worker loop over the experts: each trains its own budget."""
    from paths.units import expert_names, step_budget
    from paths.work.claims import claim
    from paths.errors import NothingToClaim
    from paths.work.train import train
    from paths.train_config import load_config

    lines = []
    while True:
        try:
            lease = claim(run, expert_names(run), ttl=60, worker="quickstart")
        except NothingToClaim:
            break
        cfg = load_config(sets=["seq_len=128", "batch_size=8", "warmup_steps=2", "lr=2e-3"], steps=step_budget(run, lease.path), checkpoint_every=0)
        out = train(run, lease.path, "lm", EXPERT_DATASET, cfg, lease, show_progress=False)
        lines.append(f"{out['path']}: {out['steps']} steps, {out['tokens']:,} tokens, loss {out['final_loss']:.3f}")
    return "\n".join(sorted(lines) + ["nothing left to claim (exit 3)"]) if lines else "every expert is already trained (nothing to claim: exit 3)"


def _ensemble(run, name: str, members: list[str]) -> str:
    from compose.ensemble import compose_ensemble

    record = compose_ensemble(run, name, members=members, mix="posterior", prior_data=EXPERT_DATASET, prior_docs=100, overwrite=True)
    prior = ", ".join(f"{m} {p:.2f}" for m, p in zip(record["order"], record["prior"]))
    return f"ensemble composed/{name}: {', '.join(record['order'])}; cached prior {prior} (loads with trust_remote_code=True)"


def _eval_experts(run, models: list[str]) -> str:
    domains = {d: d for d in ("code", "math", "prose")}
    return _eval_domains(run, EXPERT_DATASET, models, domains, "heldout") + (
        "\n(hdee: experts sized and trained by domain; homogeneous: one size and budget; the MoE was trained on the moe-routed corpus)"
    )


def _init(init_run: Callable[..., dict], root: str) -> str:
    meta = init_run(root, preset=PRESET)
    b = meta["base"]
    return f"{b['family']} MoE: {b['num_layers']} layers x {b['num_experts']} experts, tokenizer of {meta['tokenizer']['vocab_size']} tokens"


def _decomposed(out: dict[str, Any]) -> str:
    return f"{len(out['paths'])} paths of {out['parameters_per_path']:,} parameters (path.json only, no weights copied)"


def _load(folder: str) -> str:
    """Load the dense path with stock transformers and run it once."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("def quickstart():", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    n = sum(p.numel() for p in model.parameters())
    expected = json.load(open(os.path.join(folder, "path.json")))["parameters"]
    return (
        f"{type(model).__name__} with {n:,} parameters (path.json says {expected:,}); "
        f"logits for {ids.shape[1]} prompt tokens: {tuple(logits.shape)}"
    )


def _corpus(folder: str, domain_map: str, domains: dict[str, str] = DOMAINS) -> str:
    import json

    from sharding.corpus import write_corpus

    files = write_corpus(folder)
    with open(domain_map, "w") as f:
        json.dump(domains, f)
    return f"wrote {', '.join(os.path.basename(p) for p in files)} and {os.path.basename(domain_map)} ({domains}) in {folder}"


def _shard(run, corpus: str, domain_map: str) -> dict[str, Any]:
    from sharding.shard import ShardOptions, shard

    opts = ShardOptions(
        dataset=DATASET, inputs=[f"{corpus}/*.jsonl"], id_field="id", router="domain",
        domain_field="domain", domain_map=domain_map,
    )
    return shard(run, opts)


def _shard_lm(run, corpus: str) -> dict[str, Any]:
    from sharding.shard import ShardOptions, shard

    return shard(run, ShardOptions(dataset=LM_DATASET, inputs=[f"{corpus}/*.jsonl"], id_field="id", router="moe"))


def _train_all(run) -> str:
    """The worker loop, in this process: claim until exit 3, training each path a few steps."""
    from paths.work.claims import claim
    from paths.units import decomposed_paths
    from paths.errors import NothingToClaim
    from paths.work.train import train
    from paths.train_config import load_config

    _, ids = decomposed_paths(run)
    cfg = load_config(sets=["seq_len=64", "batch_size=4", "warmup_steps=1"], steps=TRAIN_STEPS, checkpoint_every=2)
    lines = []
    while True:
        try:
            lease = claim(run, ids, ttl=60, worker="quickstart")
        except NothingToClaim:
            break
        out = train(run, lease.path, "lm", LM_DATASET, cfg, lease, show_progress=False)
        lines.append(f"{out['path']}: {out['steps']} steps, {out['tokens']:,} tokens, loss {out['final_loss']:.3f}" + (f" (resumed from step {out['resumed_from']})" if out["resumed_from"] else ""))
    return "\n".join(lines + ["nothing left to claim (exit 3)"]) if lines else "every path is already trained (nothing to claim: exit 3)"


def _status(run) -> str:
    from cli.render import render_status
    from paths.work.status import status

    return render_status(status(run))


def _tasks(path: str) -> str:
    from paths.work.tasks import arithmetic, write_jsonl

    write_jsonl(arithmetic(RL_PROMPTS, [1, 2]), path)
    return f"wrote {RL_PROMPTS} prompts with exact answers to {path}"


def _shard_rl(run, tasks: str) -> dict[str, Any]:
    from sharding.shard import ShardOptions, shard

    return shard(run, ShardOptions(dataset=RL_DATASET, inputs=[tasks], kind="prompts", text_field="prompt", id_field="id", router="moe", holdout=0.2))


def _grpo(run) -> str:
    """GRPO on one LM-trained path; reward on its held-out prompts before and after."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.work.claims import claim, release
    from paths.work.grpo import evaluate
    from paths.work.rewards import load_reward
    from paths.models import fetch_final
    from paths.work.train import train
    from paths.train_config import load_config
    from sharding.dataset import read_prompts

    from sharding.dataset import dataset_manifest

    paths = dataset_manifest(run, RL_DATASET)["paths"]
    rl_path = max(sorted(paths), key=lambda p: paths[p]["heldout_docs"])
    rewards = [load_reward(r) for r in REWARDS]
    heldout = read_prompts(run, RL_DATASET, rl_path, "heldout")

    def score_final() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as folder:
            fetch_final(run, rl_path, folder)
            model = AutoModelForCausalLM.from_pretrained(folder)
            return evaluate(model, AutoTokenizer.from_pretrained(folder), heldout, rewards, max_new_tokens=16)

    before = score_final()
    release(run, rl_path, "open", by="quickstart")
    lease = claim(run, [rl_path], ttl=60, worker="quickstart")
    cfg = load_config(sets=["batch_size=4", "group_size=8", "max_new_tokens=16", "warmup_steps=1", "lr=1e-3"], steps=RL_STEPS, checkpoint_every=4)
    out = train(run, rl_path, "grpo", RL_DATASET, cfg, lease, show_progress=False, rewards=REWARDS, init="final")
    after = score_final()
    fmt = lambda d: ", ".join(f"{k} {v:.3f}" for k, v in d.items() if k != "prompts")  # noqa: E731
    return (
        f"{rl_path}: {out['steps']} GRPO steps ({out['tokens']:,} completion tokens) from its lm-trained final/\n"
        f"held-out reward on {before['prompts']} prompts (greedy): before {fmt(before)}\n"
        f"                                         after  {fmt(after)}\n"
        "(a 189K-parameter model trained for seconds does not do arithmetic: the numbers show the loop, not skill)"
    )


def _compose(run) -> str:
    from compose.merge import compose_moe

    record = compose_moe(run, COMPOSED, overwrite=True)
    return f"composed {len(record['paths'])} trained paths into composed/{COMPOSED}: {len(record['tensors'])} tensors updated in {record['seconds']}s (loads with AutoModelForCausalLM)"


FT_STEPS = 10


def _finetune(run) -> str:
    from compose.finetune import finetune_moe
    from paths.train_config import load_config

    cfg = load_config(sets=["seq_len=64", "batch_size=4", "warmup_steps=1", "lr=1e-2", "weight_decay=0"], steps=FT_STEPS, checkpoint_every=0)
    out = finetune_moe(run, COMPOSED, LM_DATASET, f"{COMPOSED}-ft", cfg, train="router", overwrite=True, show_progress=False)
    return f"composed/{out['name']}: routers trained {out['steps']} steps on {len(out['shards'])} path shards in turn ({out['tokens']:,} tokens, {out['backend']} MoE blocks), final loss {out['final_loss']:.3f}"


def _eval(run, models: list[str]) -> str:
    return _eval_domains(run, DATASET, models, DOMAINS, "train") + " (each domain's documents were routed to one path; the tiny corpus holds out few)"


# -- paths quickstart --scenario flexolmo ------------------------------------------------------
FLEX_ROOT = "runs/quickstart-flexolmo"
FLEX_DOMAINS = {"code": "p00", "prose": "p01", "math": "p02"}  # p03: the public expert, never trained
FLEX_DATASET = "domains"
FLEX_STEPS = 60
FLEX_OPTED_OUT = "math"


def flexolmo_stages(root: str = FLEX_ROOT) -> Iterator[Stage]:
    """FlexOlmo: three data owners each train their domain expert anchored to the frozen shared
    weights; compose with routers from their domain embeddings; compose again with one owner out."""
    run = admin.init(root)
    yield from _opening(run, root, 1)
    corpus = os.path.join(os.path.dirname(os.path.abspath(root)), "quickstart-corpus")
    domain_map = os.path.join(corpus, "flexolmo-domains.json")
    yield "write a corpus found on this machine (code: stdlib sources, prose: pydoc topics, math: generated)", lambda: _corpus(corpus, domain_map, FLEX_DOMAINS)
    yield (
        f"paths shard {root} --dataset {FLEX_DATASET} --input '{corpus}/*.jsonl' --id-field id --router domain --domain-field domain --domain-map {domain_map} --holdout 0.1",
        lambda: _shard_flex(run, corpus, domain_map),
    )
    owners = ", ".join(f"{d}: {p}" for d, p in FLEX_DOMAINS.items())
    yield (
        f"for P in {' '.join(FLEX_DOMAINS.values())}; do paths claim {root} --path $P && paths train --dataset {FLEX_DATASET} --freeze shared --steps {FLEX_STEPS}; done   ({owners})",
        lambda: _train_anchored(run),
    )
    yield f"paths compose {root} --name flexolmo --router domain-embed --router-data {FLEX_DATASET} --overwrite", lambda: _compose_flex(run, "flexolmo", [])
    out = FLEX_DOMAINS[FLEX_OPTED_OUT]
    yield (
        f"paths compose {root} --name flexolmo-no-{FLEX_OPTED_OUT} --exclude {out} --router domain-embed --router-data {FLEX_DATASET} --overwrite   (the {FLEX_OPTED_OUT} owner opts out)",
        lambda: _compose_flex(run, f"flexolmo-no-{FLEX_OPTED_OUT}", [out]),
    )
    models = ["base", *(f"path:{p}" for p in FLEX_DOMAINS.values()), "composed:flexolmo", f"composed:flexolmo-no-{FLEX_OPTED_OUT}"]
    yield f"paths eval {root} --dataset {FLEX_DATASET} " + " ".join(f"--model {m}" for m in models), lambda: _eval_domains(run, FLEX_DATASET, models, FLEX_DOMAINS, "heldout")
    yield f"paths storage verify {root}", lambda: admin.verify(run)


def _shard_flex(run, corpus: str, domain_map: str) -> dict[str, Any]:
    from sharding.shard import ShardOptions, shard

    return shard(run, ShardOptions(dataset=FLEX_DATASET, inputs=[f"{corpus}/*.jsonl"], id_field="id", router="domain", domain_field="domain", domain_map=domain_map, holdout=0.1))


def _train_anchored(run) -> str:
    from paths.work.claims import claim
    from paths.errors import NothingToClaim
    from paths.work.train import train
    from paths.train_config import load_config

    cfg = load_config(sets=["seq_len=128", "batch_size=8", "warmup_steps=3", "lr=2e-3", "freeze=shared"], steps=FLEX_STEPS, checkpoint_every=0)
    lines = []
    for domain, pid in FLEX_DOMAINS.items():
        try:
            lease = claim(run, [pid], ttl=60, worker="quickstart")
        except NothingToClaim:
            lines.append(f"{pid} ({domain}): already trained")
            continue
        out = train(run, pid, "lm", FLEX_DATASET, cfg, lease, show_progress=False)
        lines.append(f"{pid} ({domain}): {out['steps']} steps, {out['tokens']:,} tokens, loss {out['final_loss']:.3f}, anchored={out['anchored']}")
    return "\n".join(lines) + "\n(attention, embeddings, norms and head stay bitwise the base's: only each owner's expert trained)"


def _compose_flex(run, name: str, exclude: list[str]) -> str:
    from compose.merge import compose_moe

    record = compose_moe(run, name, router="domain-embed", router_data=FLEX_DATASET, router_docs=32, exclude=exclude, overwrite=True)
    out = f"composed {', '.join(sorted(record['paths']))} into composed/{name} in {record['seconds']}s; shared tensors: {record['shared']}"
    if record["excluded"]["paths"]:
        out += f"\nleft out {', '.join(record['excluded']['paths'])}: experts {record['excluded']['removed_experts']['0']} removed from every layer ({len(record['excluded']['experts_kept']['0'])} left)"
    return out


def _eval_domains(run, dataset: str, models: list[str], domains: dict[str, str], split: str) -> str:
    from cli.render import render_eval
    from compose.evaluate import evaluate

    result = evaluate(run, dataset, models, split=split, max_tokens=20_000)
    names = {p: f"{d}:{p}" for d, p in domains.items()}
    result["shards"] = [names[s] for s in result["shards"] if s in names]
    result["table"] = {m: {names.get(k, k): v for k, v in row.items()} for m, row in result["table"].items()}
    return render_eval(result) + f"\n(perplexity per domain, {split} documents)"
