"""The quickstart's environments scenario, as data (the stages of cli/scenarios.py).

A reasoning-gym task and a multi-turn verifiers environment with a tool (`calc_tools`, in
examples/environments/), the Branch-Train-MiX way: an SFT warm-up of one dense path on worked
examples of both (the seed), the seed upcycled into a 2-expert MoE, GRPO of one path per
environment (the tool episodes run through verifiers' own rollout loop), compose, and the
held-out reward before GRPO (the seed), after it (each path) and after compose.

The warm-up is a cold start with habits RL has to fix: half the tool demonstrations answer at once
without the tool (a tiny model cannot add, so those answers are mostly wrong), and most reasoning-gym
answers come as `Answer: x` instead of in the `<answer>` tags the scorer reads. What GRPO learns in
seconds on a CPU is the behaviour the rewards pay for (call the tool; answer in tags), not new
arithmetic: the held-out gain is the share of prompts where that behaviour now gets the answer.
"""

from __future__ import annotations

import os

from cli.scenarios import (
    Action,
    Command,
    ForEach,
    Scenario,
    Stage,
    _has_base,
    _report,
    _run,
    _write_json,
    settings,
)

ENVS_ROOT = "runs/quickstart-envs"
ENVS_PRESET = "mini-mixtral"
GYM = 'reasoning-gym:basic_arithmetic:size=1000,eval_size=128,min_terms=1,max_terms=2,max_digits=1,operators=["+","-"],allow_parentheses=false,allow_negation=false'
TOOLS = "verifiers:calc_tools:n=400,eval_n=64,low=1,high=9"
WARM_STEPS = 200
WARM = ("seq_len=224", "batch_size=16", "warmup_steps=10", "lr=3e-3", "weight_decay=0")
WARM_TOOLS, WARM_GYM = 400, 300  # worked examples of each environment in the warm-up
WARM_DIRECT, WARM_UNTAGGED = 0.5, 0.8  # shares that answer without the tool / as `Answer: x` (no <answer> tags, scored 0): what GRPO unlearns
GRPO = {"p00": ("tools", TOOLS, 10, ("batch_size=4", "group_size=8", "max_new_tokens=128", "lr=3e-4")),
        "p01": ("gym", GYM, 20, ("batch_size=8", "group_size=8", "max_new_tokens=24", "lr=2e-4"))}


def envs_scenario(root: str = ENVS_ROOT) -> Scenario:
    """Seed, upcycle, GRPO one path per environment, compose, held-out reward before and after."""
    here = os.path.dirname(os.path.abspath(root))
    seed_root, seed_dir = f"{root}-seed", os.path.join(here, "quickstart-envs-seed-p00")
    warmup, seed_map = os.path.join(here, "quickstart-tasks", "envs-warmup.jsonl"), os.path.join(here, "quickstart-tasks", "envs-seed-map.json")
    route = os.path.join(here, "quickstart-tasks", "envs-map.json")
    prompts = ["--kind", "prompts", "--holdout", "0", "--router", "domain", "--domain-field"]
    stages: list[Stage] = [
        Command(["storage", "init", seed_root]),
        Command(["init", seed_root, "--preset", ENVS_PRESET], unless=lambda: _has_base(seed_root)),
        Command(["decompose", seed_root, "--levels", "1"]),
        Action("worked examples of both environments (tool episodes from calc_tools.demonstrations, reasoning-gym answers)", lambda: _warmup(warmup)),
        Action("every example to the seed path p00", lambda: _write_json(seed_map, {"all": "p00"})),
        Command(["shard", seed_root, "--dataset", "warmup", "--input", warmup, "--text-field", "prompt", "--answer-field", "completion", "--id-field", "id",
                 *prompts, "domain", "--domain-map", seed_map]),
        ForEach({"p00 (the seed)": "p00"}, lambda p: ["claim", seed_root, "--path", p, "--ttl", "60", "--worker", "quickstart"],
                ["train", seed_root, "--mode", "sft", "--dataset", "warmup", "--steps", str(WARM_STEPS), "--checkpoint-every", "0",
                 *settings(*WARM), "--no-progress"],
                note="(SFT warm-up on chat transcripts: the tool call, its result and the answer; loss on the completion only)"),
        Command(["materialize", seed_root, "--path", "p00", "--final", "--out", seed_dir]),
        Command(["storage", "init", root]),
        Command(["upcycle", root, "--from", seed_dir, "--experts", "2", "--top-k", "2"], unless=lambda: _has_base(root)),
        Command(["decompose", root, "--levels", "1"]),
        Action("each environment to its path", lambda: _write_json(route, {"verifiers:calc_tools": "p00", "reasoning-gym:basic_arithmetic": "p01"})),
    ]
    for path, (dataset, spec, _, _) in GRPO.items():
        stages.append(Command(["shard", root, "--dataset", dataset, "--input", spec, *prompts, "env", "--domain-map", route],
                              note="(the environment's train rows, its eval rows held out; its package version in the manifest)"))
    for path, (dataset, _, steps, sampling) in GRPO.items():
        stages.append(ForEach({f"{path} ({dataset})": path}, lambda p: ["claim", root, "--path", p, "--ttl", "120", "--worker", "quickstart"],
                              ["train", root, "--mode", "grpo", "--dataset", dataset, "--steps", str(steps), "--checkpoint-every", "0", *settings(*sampling, "warmup_steps=2"),
                               "--no-progress"],
                              note="(scored by the environment's own rubric / scorer" + ("; episodes: tool calls run by the environment, its tokens out of the loss)" if dataset == "tools" else ")")))
    stages.append(Command(["compose", root, "--into", "moe", "--name", "envs", "--overwrite"]))
    for path, (dataset, _, _, sampling) in GRPO.items():
        budget = next(s for s in sampling if s.startswith("max_new_tokens")).split("=")[1]
        stages.append(Command(["eval", root, "--dataset", dataset, "--model", "base", "--model", f"path:{path}", "--model", "composed:envs", "--max-new-tokens", budget],
                              note=f"held-out reward (greedy{', episodes' if dataset == 'tools' else ''}); base is the upcycled seed: before GRPO"))
    stages += [
        Action("what GRPO did (from the evals just written)", lambda: _gains(root)),
        Command(["storage", "verify", root]),
        _report(root),
    ]
    return Scenario(root, stages)


def _warmup(out: str) -> str:
    """Worked examples: calc_tools tool episodes and reasoning-gym answers, as chat prompt / completion."""
    import calc_tools

    from paths.envs.gym import rows
    from paths.envs.spec import parse
    from paths.work.tasks import write_jsonl

    tools = [r | {"domain": "all"} for r in calc_tools.demonstrations(WARM_TOOLS, seed=11, low=1, high=9, direct=WARM_DIRECT)]
    spec = parse(GYM)
    answer = lambda i, r: f"Answer: {r['answer']}" if i < round(WARM_UNTAGGED * WARM_GYM) else f"<answer>{r['answer']}</answer>"  # noqa: E731
    gym = [{"id": f"warm-{r['id']}", "prompt": r["prompt"], "completion": [{"role": "assistant", "content": answer(i, r)}], "domain": "all"}
           for i, r in enumerate(rows(type(spec)(spec.kind, spec.name, {**spec.args, "seed": 11, "size": WARM_GYM, "eval_size": 0})))]
    write_jsonl(tools + gym, out)
    return f"wrote {out}: {len(tools)} tool episodes, {len(gym)} reasoning-gym answers"


def _gains(root: str) -> str:
    """Each environment's held-out reward: the seed, its GRPO path, the composed MoE."""
    import json

    run = _run(root)
    lines = []
    for path, (dataset, *_) in GRPO.items():
        table = json.loads(run.store.read(run.store.list(f"eval/{dataset}")[-1].key))["table"]
        seed, trained, composed = (table[m]["overall"] for m in ("base", f"path:{path}", "composed:envs"))
        lines.append(f"{dataset}: seed {seed:.3f}; after GRPO ({path}) {trained:.3f} ({trained - seed:+.3f}); composed MoE {composed:.3f} ({composed - seed:+.3f})")
    return "\n".join(lines)
