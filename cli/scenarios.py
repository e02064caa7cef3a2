"""The quickstart's scenarios as data: each stage is the `paths` command line a user would type,
run through the click app in this process, so the command printed is the command that ran.

A stage is a `Command` (one argv), a `WorkerLoop` (`while paths claim ...; do paths train ...;
done`: the one worker loop, exit 3 ends it), a `ForEach` of commands (one claim-and-train per
owner), a `Parallel` of lanes (machines: each its commands in turn, with its own environment),
or an `Action` for what is not a `paths` command (writing a corpus found on the machine,
loading a path with stock transformers, scoring a path's held-out reward). Arguments that depend
on the run (the path GRPO trains) are computed when the stage runs. Running a scenario again reuses
what the run already holds.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from storage.layout import Run

DEFAULT_ROOT = "runs/quickstart"
PRESET = "tiny-mixtral"
LEVELS = 2
PATH = "p01-02"
DATASET = "corpus"
LM_DATASET = "corpus-moe"
TRAIN_STEPS = 4
COMPOSED = "quickstart"
FT_STEPS = 10
DOMAINS = {"code": "p00-00", "prose": "p01-02", "math": "p03-03"}
# HDEE: domain experts of different sizes and step budgets (harder domains get more), against
# the same three domains with one size and budget, each set ensembled (ELMForest posterior).
HDEE = {"code-m": ("code", "tiny-m", 40), "prose-s": ("prose", "tiny-s", 30), "math-xs": ("math", "tiny-xs", 20)}
HOMOGENEOUS = {"code-h": ("code", "tiny-s", 30), "prose-h": ("prose", "tiny-s", 30), "math-h": ("math", "tiny-s", 30)}
EXPERT_DATASET = "experts"
RL_ROOT = "runs/quickstart-rl"
RL_PRESET = "mini-mixtral"  # hidden 128: the smallest preset that learns 2-number arithmetic in seconds
RL_TASKS = ["--n", "1600", "--levels", "1", "--families", "add,sub", "--max-operand", "12"]
SEED_STEPS = 300
RL_STEPS = 100
RL_REWARDS = ["--reward", "math_answer", "--reward", "format=0.2"]
SWARM_ROOT = "runs/quickstart-swarm"
SWARM_STEPS = 100
SWARM_LR = "1e-4"
SWARM_MAX_ASYNC = 2
SWARM_EXTERNAL = 4  # prompt groups a step taken from the other path's rollouts (SAPO): 16 a step in all, as the rl scenario's
SWARM_SAMPLING = ("batch_size=12", "group_size=8", "max_new_tokens=24")  # trainers and workers must agree on these
FLEX_ROOT = "runs/quickstart-flexolmo"
FLEX_DOMAINS = {"code": "p00", "prose": "p01", "math": "p02"}  # p03: the public expert, never trained
FLEX_DATASET = "domains"
FLEX_STEPS = 60
FLEX_OPTED_OUT = "math"

Argv = Sequence[str] | Callable[[], Sequence[str]]


def settings(*pairs: str) -> list[str]:
    """`--set K=V` for each pair."""
    return [a for p in pairs for a in ("--set", p)]


@dataclass(frozen=True)
class Command:
    """One `paths` command. `unless` returns a reason to show it without running it (the run holds
    its result already); `note` is printed after its output."""

    argv: Argv
    note: str = ""
    unless: Callable[[], str | None] | None = None

    def line(self) -> list[str]:
        return list(self.argv() if callable(self.argv) else self.argv)


@dataclass(frozen=True)
class WorkerLoop:
    """`while paths claim ...; do paths train ...; done`: claim until exit 3 (nothing left)."""

    claim: list[str]
    train: list[str]
    note: str = ""


@dataclass(frozen=True)
class ForEach:
    """`paths claim --path P && paths train ...` for each (label, P); a path already claimed or
    done is reported as `label: already trained`."""

    items: dict[str, str]
    claim: Callable[[str], list[str]]
    train: list[str]
    note: str = ""


@dataclass(frozen=True)
class Action:
    """A step that is not a `paths` command; its result is rendered."""

    title: str
    fn: Callable[[], Any]


@dataclass(frozen=True)
class Parallel:
    """Lanes of `paths` commands run at once, each lane in its own processes one command after the
    other (`(a && b) & (c) & wait`), with its own environment: the machines of a swarm."""

    lanes: dict[str, list[list[str]]]
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    note: str = ""


Stage = Command | WorkerLoop | ForEach | Action | Parallel


@dataclass
class Scenario:
    """A named list of stages over a run at `root`."""

    root: str
    stages: list[Stage] = field(default_factory=list)


def title(stage: Stage) -> str:
    """The command line shown for a stage (what a user would type)."""
    if isinstance(stage, Command):
        return "paths " + shlex.join(stage.line()) + (f"   {stage.note}" if stage.note and stage.note.startswith("(") else "")
    if isinstance(stage, WorkerLoop):
        return f"while paths {shlex.join(stage.claim)}; do paths {shlex.join(stage.train)}; done" + (f"   {stage.note}" if stage.note else "")
    if isinstance(stage, Parallel):  # each command with its lane's environment: two lanes sharing one claim file would train one path twice
        def lane(name: str, argvs: list[list[str]]) -> str:
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in stage.env.get(name, {}).items())
            return "(" + " && ".join(f"{env}paths {shlex.join(a)}" for a in argvs) + ")"

        lanes = [lane(name, argvs) for name, argvs in stage.lanes.items()]
        return " &\n  ".join(lanes) + " &\n  wait" + (f"   {stage.note}" if stage.note else "")
    if isinstance(stage, ForEach):
        claim = shlex.join(stage.claim("$P")).replace("'$P'", "$P")
        return f"for P in {' '.join(stage.items.values())}; do paths {claim} && paths {shlex.join(stage.train)}; done" + (f"   {stage.note}" if stage.note else "")
    return stage.title


def _opening(root: str, levels: int) -> list[Stage]:
    """Every scenario's start: the run, the tiny base (reused when there), the plan."""
    return [
        Command(["storage", "init", root]),  # idempotent: an existing run is opened
        Command(["init", root, "--preset", PRESET], unless=lambda: _has_base(root)),
        Command(["decompose", root, "--levels", str(levels)]),
        Command(["plan", root]),
    ]


def report_out(root: str) -> str:
    """Where the quickstart writes a run's report: beside a local run (runs/quickstart-report/),
    under reports/ for a bucket."""
    return f"{root.rstrip('/')}-report" if "://" not in root else os.path.join("reports", root.rstrip("/").rsplit("/", 1)[-1])


def _report(root: str) -> Command:
    return Command(["report", root, "--out", report_out(root), "--overwrite"], note="(open it in a browser: charts and tables of everything above)")


def main_scenario(root: str = DEFAULT_ROOT) -> Scenario:
    """Decompose, shard, train every path, compose, fine-tune the routers, evaluate, then HDEE
    domain experts ensembled, and the storage commands."""
    here = os.path.dirname(os.path.abspath(root))
    corpus = os.path.join(here, "quickstart-corpus")
    domain_map = os.path.join(corpus, "domains.json")
    out = os.path.join(here, f"quickstart-{PATH}")
    documents = ["--input", f"{corpus}/*.jsonl", "--id-field", "id"]
    models = ["base", *(f"path:{p}" for p in sorted(set(DOMAINS.values()))), f"composed:{COMPOSED}", f"composed:{COMPOSED}-ft"]
    stages: list[Stage] = [
        *_opening(root, LEVELS),
        Action("write a corpus found on this machine (code: stdlib sources, prose: pydoc topics, math: generated)", lambda: _corpus(corpus, domain_map, DOMAINS)),
        Command(["shard", root, "--dataset", DATASET, *documents, "--router", "domain", "--domain-field", "domain", "--domain-map", domain_map]),
        Command(["shard", root, "--dataset", LM_DATASET, *documents, "--router", "moe"]),
        WorkerLoop(["claim", root, "--ttl", "60", "--worker", "quickstart"],
                   ["train", root, "--dataset", LM_DATASET, "--steps", str(TRAIN_STEPS), "--checkpoint-every", "2", *settings("seq_len=64", "batch_size=4", "warmup_steps=1"), "--no-progress"]),
        Command(["status", root]),
        Command(["compose", root, "--into", "moe", "--name", COMPOSED, "--overwrite"]),
        Command(["finetune-moe", root, "--model", f"composed:{COMPOSED}", "--dataset", LM_DATASET, "--train", "router", "--steps", str(FT_STEPS), "--checkpoint-every", "0",
                 *settings("seq_len=64", "batch_size=4", "warmup_steps=1", "lr=1e-2", "weight_decay=0"), "--overwrite", "--no-progress"],
                note="(Branch-Train-MiX: routers learn on mixed data)"),
        Command(["eval", root, "--dataset", DATASET, *(a for m in models for a in ("--model", m)), "--split", "train", "--max-tokens", "20000"],
                note="each domain's documents were routed to one path; the tiny corpus holds out few"),
        *_hdee(root, corpus),
        Command(["materialize", root, "--path", PATH, "--out", out]),
        Action(f"AutoModelForCausalLM.from_pretrained({out!r})", lambda: _load(out)),
        Command(["storage", "ls", root, "--prefix", f"composed/{COMPOSED}"]),
        Command(["storage", "du", root]),
        Command(["storage", "verify", root]),
        _report(root),
    ]
    return Scenario(root, stages)


def _hdee(root: str, corpus: str) -> list[Stage]:
    stages: list[Stage] = [
        Command(["expert", "add", root, "--name", name, "--domain", domain, "--preset", preset, "--steps", str(steps)], unless=lambda n=name: _has_expert(root, n))
        for name, (domain, preset, steps) in {**HDEE, **HOMOGENEOUS}.items()
    ]
    stages += [
        Command(["expert", "ls", root]),
        Command(["shard", root, "--dataset", EXPERT_DATASET, "--input", f"{corpus}/*.jsonl", "--id-field", "id", "--router", "domain", "--targets", "domains",
                 "--domain-field", "domain", "--holdout", "0.1"]),
        WorkerLoop(["claim", root, "--ttl", "60", "--worker", "quickstart"],
                   ["train", root, "--dataset", EXPERT_DATASET, "--checkpoint-every", "0", *settings("seq_len=128", "batch_size=8", "warmup_steps=2", "lr=2e-3"), "--no-progress"],
                   note="(each expert runs its own --steps budget)"),
    ]
    for name, members in (("hdee", HDEE), ("homogeneous", HOMOGENEOUS)):
        stages.append(Command(["compose", root, "--into", "ensemble", "--name", name, "--members", ",".join(members), "--mix", "posterior",
                               "--prior-data", EXPERT_DATASET, "--prior-docs", "100", "--overwrite"]))
    models = [f"composed:{COMPOSED}", "composed:homogeneous", "composed:hdee", *(f"expert:{n}" for n in HDEE)]
    stages.append(Command(["eval", root, "--dataset", EXPERT_DATASET, *(a for m in models for a in ("--model", m)), "--max-tokens", "20000"],
                          note="hdee: experts sized and trained by domain; homogeneous: one size and budget; the MoE was trained on the moe-routed corpus"))
    return stages


def _seed_stages(seed_root: str, seed_dir: str, tasks: str, seed_map: str, prompts: list[str]) -> list[Stage]:
    """The SFT cold start of the RL scenarios: one mini-mixtral path on worked arithmetic,
    written out as the seed of the upcycled MoE (reused when the run holds it)."""
    return [
        Command(["storage", "init", seed_root]),
        Command(["init", seed_root, "--preset", RL_PRESET], unless=lambda: _has_base(seed_root)),
        Command(["decompose", seed_root, "--levels", "1"]),
        Command(["gen-tasks", "arithmetic", *RL_TASKS, "--out", tasks]),
        Action("every task family to the seed path p00", lambda: _write_json(seed_map, {"add": "p00", "sub": "p00"})),
        Command(["shard", seed_root, "--dataset", "arith-sft", "--input", tasks, *prompts, "--answer-field", "solution", "--router", "domain", "--domain-field", "family",
                 "--domain-map", seed_map]),
        ForEach({"p00 (the seed)": "p00"}, lambda p: ["claim", seed_root, "--path", p, "--ttl", "60", "--worker", "quickstart"],
                ["train", seed_root, "--mode", "sft", "--dataset", "arith-sft", "--steps", str(SEED_STEPS), "--checkpoint-every", "0",
                 *settings("seq_len=80", "batch_size=16", "warmup_steps=10", "lr=3e-3", "weight_decay=0"), "--no-progress"],
                note="(SFT cold start: prompt -> worked solution, loss on the completion only)"),
        Command(["materialize", seed_root, "--path", "p00", "--final", "--out", seed_dir]),
    ]


def _upcycled_seed(root: str, seed_root: str) -> list[Stage]:
    """The RL scenarios' start: the SFT seed (in `seed_root`, reused when there), upcycled into
    a 2-expert MoE at `root`, cut into two paths, the arithmetic prompts sharded by hash."""
    here = os.path.dirname(os.path.abspath(root))
    seed_dir = os.path.join(here, "quickstart-rl-seed-p00")
    tasks = os.path.join(here, "quickstart-tasks", "arithmetic.jsonl")  # not in the corpus glob
    prompts = ["--kind", "prompts", "--text-field", "prompt", "--id-field", "id", "--holdout", "0.2"]
    return [
        *_seed_stages(seed_root, seed_dir, tasks, os.path.join(here, "quickstart-tasks", "seed-map.json"), prompts),
        Command(["storage", "init", root]),
        Command(["upcycle", root, "--from", seed_dir, "--experts", "2", "--top-k", "2"], unless=lambda: _has_base(root)),
        Command(["decompose", root, "--levels", "1"]),
        Command(["shard", root, "--dataset", "arith", "--input", tasks, *prompts, "--router", "hash"]),
    ]


def rl_scenario(root: str = RL_ROOT) -> Scenario:
    """DeepSeek-R1's recipe in miniature, the Branch-Train-MiX way: an SFT cold start on worked
    arithmetic (the seed, one dense path), sparse upcycling of the seed into a 2-expert MoE, GRPO of
    each path on its half of the prompts by two workers at once (`paths claim && paths train` in
    each, a core and a claim file apiece: two machines), compose, and held-out accuracy of the seed,
    each path and the composed MoE; then rejection sampling from the composed model."""
    accepted = os.path.join(os.path.dirname(os.path.abspath(root)), "quickstart-tasks", "rejection-sampled.jsonl")
    models = ["base", "path:p00", "path:p01", "composed:rl"]
    stages: list[Stage] = [
        *_upcycled_seed(root, f"{root}-seed"),
        Parallel({f"worker {i}": [["claim", root, "--ttl", "60", "--worker", f"worker-{i}"],
                                  ["train", root, "--mode", "grpo", "--dataset", "arith", *RL_REWARDS, "--steps", str(RL_STEPS), "--checkpoint-every", "0", "--eval-every", "10",
                                   *settings("batch_size=16", "group_size=8", "max_new_tokens=24", "warmup_steps=2", "lr=1e-4"), "--no-progress"]] for i in (1, 2)},
                 {f"worker {i}": {"PATHS_HOME": os.path.join(f"{root}-home", f"worker-{i}"), "OMP_NUM_THREADS": "1"} for i in (1, 2)},
                 note="(two workers, one a path each: GRPO from the seed on its half of the prompts)"),
        Command(["compose", root, "--into", "moe", "--name", "rl", "--overwrite"]),
        Command(["eval", root, "--dataset", "arith", *(a for m in models for a in ("--model", m))],
                note="held-out math_answer accuracy (greedy); base is the upcycled seed: the SFT cold start, before GRPO"),
        Action("what GRPO did (from the eval just written)", lambda: _rl_gain(root)),
        Command(["rejection-sample", root, "--model", "composed:rl", "--dataset", "arith", "--shard", "p00", "--n", "4", *RL_REWARDS[:2], "--out", accepted, "--no-progress"],
                note="(R1's stage 3: verified completions, ready for `paths shard --kind prompts --answer-field completion` and --mode sft)"),
        Command(["storage", "verify", root]),
        _report(root),
    ]
    return Scenario(root, stages)


def swarm_scenario(root: str = SWARM_ROOT) -> Scenario:
    """Decentralised asynchronous RL through the bucket: the RL scenario's seed upcycled into two
    paths; a signing key per rollout worker, admitted to the run; for each path a GRPO trainer (`--rollouts store`, at most 2 policy versions of lag) and a
    CPU rollout worker, all four at once and knowing nothing of each other but the run; each
    trainer also takes 4 prompt groups a step from the other path's rollouts (SAPO), re-scored by
    its own verifiers. Then compose, the accuracy table, and the report."""
    seed_root = root[: -len("-swarm")] + "-rl-seed" if root.endswith("-swarm") else f"{root}-seed"  # the rl scenario's seed, reused when they run together
    sampling = settings(*SWARM_SAMPLING)
    lanes, env = {}, {}
    for p in ("p00", "p01"):
        lanes[f"trainer {p}"] = [["claim", root, "--path", p, "--ttl", "60", "--worker", f"trainer-{p}"],
                                 ["train", root, "--mode", "grpo", "--dataset", "arith", *RL_REWARDS, "--rollouts", "store", "--max-async", str(SWARM_MAX_ASYNC), "--external", str(SWARM_EXTERNAL),
                                  "--steps", str(SWARM_STEPS), "--checkpoint-every", "0", *sampling, *settings("warmup_steps=2", f"lr={SWARM_LR}", "rollout_wait=20"), "--no-progress"]]
        env[f"trainer {p}"] = {"PATHS_HOME": os.path.join(f"{root}-home", p), "OMP_NUM_THREADS": "1"}  # each trainer on its own machine: its own claim file
    keys: list[Stage] = []
    for p in ("p00", "p01"):
        key = os.path.join(f"{root}-home", "keys", f"cpu-{p}.key")  # on the worker's machine; only its .pub travels
        keys += [Command(["keys", "new", "--out", key], unless=lambda key=key: "(the worker's key exists)" if os.path.exists(key) else None),
                 Command(["keys", "admit", root, "--name", f"cpu-{p}", "--key", f"{key}.pub"], note="(the run's owner admits the worker: only signed batches of admitted keys are read)")]
        env[f"worker {p}"] = {"OMP_NUM_THREADS": "1"}
        lanes[f"worker {p}"] = [["rollout", root, "--path", p, "--dataset", "arith", "--key", key, "--batches", "1000", *RL_REWARDS, *sampling, "--no-progress"]]
    models = ["base", "path:p00", "path:p01", "composed:swarm"]
    stages: list[Stage] = [
        *_upcycled_seed(root, seed_root),
        *keys,
        Parallel(lanes, env, note="(two trainers and two CPU rollout workers at once; the run is their only link)"),
        Command(["compose", root, "--into", "moe", "--name", "swarm", "--overwrite"]),
        Command(["eval", root, "--dataset", "arith", *(a for m in models for a in ("--model", m))], note="held-out math_answer accuracy (greedy); base is the upcycled seed"),
        Action("what the swarm did (from the eval just written)", lambda: _rl_gain(root, "swarm")),
        Command(["storage", "du", root]),
        Command(["storage", "verify", root]),
        _report(root),
    ]
    return Scenario(root, stages)


def flexolmo_scenario(root: str = FLEX_ROOT) -> Scenario:
    """FlexOlmo: three data owners each train their domain expert anchored to the frozen shared
    weights; compose with routers from their domain embeddings; compose again with one owner out."""
    corpus = os.path.join(os.path.dirname(os.path.abspath(root)), "quickstart-corpus")
    domain_map = os.path.join(corpus, "flexolmo-domains.json")
    out = FLEX_DOMAINS[FLEX_OPTED_OUT]
    owners = ", ".join(f"{d}: {p}" for d, p in FLEX_DOMAINS.items())
    embed = ["--router", "domain-embed", "--router-data", FLEX_DATASET, "--router-docs", "32", "--overwrite"]
    models = ["base", *(f"path:{p}" for p in FLEX_DOMAINS.values()), "composed:flexolmo", f"composed:flexolmo-no-{FLEX_OPTED_OUT}"]
    stages: list[Stage] = [
        *_opening(root, 1),
        Action("write a corpus found on this machine (code: stdlib sources, prose: pydoc topics, math: generated)", lambda: _corpus(corpus, domain_map, FLEX_DOMAINS)),
        Command(["shard", root, "--dataset", FLEX_DATASET, "--input", f"{corpus}/*.jsonl", "--id-field", "id", "--router", "domain", "--domain-field", "domain",
                 "--domain-map", domain_map, "--holdout", "0.1"]),
        ForEach({f"{p} ({d})": p for d, p in FLEX_DOMAINS.items()}, lambda p: ["claim", root, "--path", p, "--ttl", "60", "--worker", "quickstart"],
                ["train", root, "--dataset", FLEX_DATASET, "--freeze", "shared", "--steps", str(FLEX_STEPS), "--checkpoint-every", "0",
                 *settings("seq_len=128", "batch_size=8", "warmup_steps=3", "lr=2e-3"), "--no-progress"],
                note=f"({owners}; attention, embeddings, norms and head stay bitwise the base's: only each owner's expert trains)"),
        Command(["compose", root, "--name", "flexolmo", *embed]),
        Command(["compose", root, "--name", f"flexolmo-no-{FLEX_OPTED_OUT}", "--exclude", out, *embed], note=f"(the {FLEX_OPTED_OUT} owner opts out)"),
        Command(["eval", root, "--dataset", FLEX_DATASET, *(a for m in models for a in ("--model", m)), "--max-tokens", "20000"], note="perplexity per domain, heldout documents"),
        Command(["storage", "verify", root]),
        _report(root),
    ]
    return Scenario(root, stages)


# -- what the stages look up when they run ------------------------------------------------------
def _run(root: str) -> Run:
    from storage.layout import open_run

    return open_run(root)


def _has_base(root: str) -> str | None:
    return "(the run already holds a base model: reused)" if "base" in _run(root).read_meta() else None


def _has_expert(root: str, name: str) -> str | None:
    from paths.units import expert_info

    run = _run(root)
    if not run.store.exists(f"{run.expert(name)}/manifest.json"):
        return None
    return f"(expert {name} is already registered: {expert_info(run, name)['parameters']:,} parameters)"


def _rl_gain(root: str, composed_name: str = "rl") -> str:
    """The seed's, each path's and the composed MoE's overall held-out accuracy, as gains."""
    import json

    run = _run(root)
    table = json.loads(run.store.read(run.store.list("eval/arith")[-1].key))["table"]
    seed = table["base"]["overall"]
    paths = {m: row["overall"] for m, row in table.items() if m.startswith("path:")}
    mean = sum(paths.values()) / len(paths)
    composed = table[f"composed:{composed_name}"]["overall"]
    # a share of the paths' mean gain only where there is one to share (a point or more)
    kept = f"{(composed - seed) / (mean - seed):.0%} of the paths' mean gain" if mean - seed >= 0.01 else f"the paths' mean gained {mean - seed:+.3f}: no gain to keep"
    shown = ", ".join(f"{m} {v:.3f} ({v - seed:+.3f})" for m, v in paths.items())
    return f"seed (SFT cold start) {seed:.3f}; after GRPO: {shown}; composed MoE {composed:.3f} ({composed - seed:+.3f}, {kept})"


def _write_json(path: str, body: Any) -> str:
    import json

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(body, f)
    return f"wrote {path}: {json.dumps(body)}"


def _corpus(folder: str, domain_map: str, domains: dict[str, str]) -> str:
    import json

    from sharding.corpus import write_corpus

    files = write_corpus(folder)
    with open(domain_map, "w") as f:
        json.dump(domains, f)
    return f"wrote {', '.join(os.path.basename(p) for p in files)} and {os.path.basename(domain_map)} ({domains}) in {folder}"


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
    with open(os.path.join(folder, "path.json")) as f:
        expected = json.load(f)["parameters"]
    return f"{type(model).__name__} with {n:,} parameters (path.json says {expected:,}); logits for {ids.shape[1]} prompt tokens: {tuple(logits.shape)}"
