"""What an environment costs: a verifiers environment against the same prompts as a plain dataset,
and the throughput of multi-turn episodes.

    .venv/bin/python bench/environments.py [--prompts 64] [--group 8] [--max-new-tokens 32] [--repeats 3] [--sft-steps 150] [--preset tiny-mixtral ...]

1. Single turn. The same questions (the rows of `verifiers:calc_single`) sharded twice into one
   run: as a plain JSONL prompt dataset scored by a `module:function` reward that reads the answer
   the way the rubric does (the direct prompt path), and as the environment (chat template,
   verifiers' rubric through `Rubric.score_group`). The same tiny-mixtral path samples G
   completions of every prompt with the same seed, so both arms sample the same number of tokens
   (a random-init model rarely samples EOS; the tokens are counted and printed). The direct arm
   samples the same chat-rendered prompt tokens (so the comparison isolates the environment:
   its rows and rubric); a third arm, plain-text prompts without the chat template, shows what the
   template's extra prompt tokens cost on top. Timed: a GRPO
   rollout's sampling and scoring (`sample_and_score`), the median of `--repeats` alternating runs.
   Goal: the environment path costs <= 10% more. The rubric's cost is per completion, not per
   token, so its share shrinks as the model grows: `--preset` repeats this arm for each preset
   named (tiny-mixtral's path has 0.19M parameters, small-mixtral's 4.46M, bench-mixtral's ~98M).
2. Multi-turn. A path warmed up by SFT on `calc_tools.demonstrations()` (it calls the `add` tool,
   mostly with the wrong numbers) runs G episodes of every prompt of `verifiers:calc_tools`
   through verifiers' rollout loop; reported: model tokens/s, environment tokens, turns per episode
   and batched forwards, against single-turn sampling of the same model and prompts at the same
   budget (`complete`, the peer being our own direct path). Also timed: the trainer's replay of
   those episodes (what `--rollouts store` does to every episode batch of a rollout worker:
   verifiers runs each episode again with the batch's model turns, the environment answering
   anew, and the rubric scores it), as a share of the worker's sampling time.
Appended to bench/out/environments.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def direct_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """calc_single's rubric as a plain reward: 1 for the right answer in tags, 0.2 for tags."""
    out = []
    for c, a in zip(completions, answer):
        found = ANSWER.findall(c)
        out.append((1.0 if found and found[-1] == a else 0.0) + (0.2 if found else 0.0))
    return out


def single_turn(run, work: str, a) -> dict:
    import torch

    from paths.train_config import load_config
    from paths.work.grpo import sample_and_score
    from paths.work.episodes import dataset_rewards
    from paths.work.rewards import Reward
    from paths.work.tasks import write_jsonl
    from sharding.dataset import read_prompts
    from sharding.shard import ShardOptions, shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.models import materialize

    spec = f"verifiers:calc_single:n={a.prompts},eval_n=1"
    shard(run, ShardOptions(dataset="env", inputs=[spec], kind="prompts", router="hash", balance=False, holdout=0.0))
    env_records = [r for p in ("p00", "p01", "p02", "p03") for r in read_prompts(run, "env", p)]
    plain = os.path.join(work, "plain.jsonl")
    write_jsonl([{"id": r["id"], "prompt": r["messages"][-1]["content"], "answer": r["answer"]} for r in env_records], plain)
    shard(run, ShardOptions(dataset="plain", inputs=[plain], kind="prompts", text_field="prompt", id_field="id", holdout=0.0))
    plain_records = [r for p in ("p00", "p01", "p02", "p03") for r in read_prompts(run, "plain", p)]
    cfg = load_config(sets=[f"group_size={a.group}", f"max_new_tokens={a.max_new_tokens}", f"batch_size={a.prompts}"], mode="grpo")
    folder = os.path.join(work, "p00-init")
    materialize(run, "p00", folder)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    same_tokens = [{k: v for k, v in r.items() if k not in ("messages", "info", "env")} for r in env_records]  # the chat-rendered prompt ids, no environment
    arms = {"direct": (same_tokens, [Reward.of("direct", direct_reward)]), "environment": (env_records, dataset_rewards(run, "env", [])),
            "plain-text": (plain_records, [Reward.of("direct", direct_reward)])}
    times: dict[str, list[float]] = {k: [] for k in arms}
    tokens: dict[str, int] = {}
    for _ in range(a.repeats):
        for name, (records, rewards) in arms.items():
            torch.manual_seed(0)
            t0 = time.perf_counter()
            s = sample_and_score(model, records, rewards, cfg, tok)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = sum(len(c) for c in s.completion_ids)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(env_records) * a.group
    return {"prompts": len(env_records), "completions": n, "tokens": tokens, "seconds": med,
            "prompt_tokens": {"chat": sum(len(r["ids"]) for r in env_records) / len(env_records), "plain-text": sum(len(r["ids"]) for r in plain_records) / len(plain_records)},
            "plain_text_overhead": (med["environment"] / tokens["environment"]) / (med["plain-text"] / tokens["plain-text"]) - 1, "path_parameters": sum(p.numel() for p in model.parameters()),
            "rubric_ms_per_completion": 1000 * (med["environment"] / tokens["environment"] - med["direct"] / tokens["direct"]) * tokens["environment"] / n,
            "rollouts_per_s": {k: n / v for k, v in med.items()}, "tokens_per_s": {k: tokens[k] / med[k] for k in med},
            "overhead": (med["environment"] / tokens["environment"]) / (med["direct"] / tokens["direct"]) - 1}


def multi_turn(run, work: str, a) -> dict:
    import calc_tools
    import torch

    from paths.models import fetch_final
    from paths.train_config import load_config
    from paths.work.episodes import episode_sampler
    from paths.work.sampling import complete
    from paths.work.tasks import write_jsonl
    from paths.work.train import train
    from sharding.dataset import dataset_manifest, read_prompts
    from sharding.shard import ShardOptions, shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    demos = os.path.join(work, "demos.jsonl")
    write_jsonl(calc_tools.demonstrations(400, low=1, high=9), demos)
    mapping = os.path.join(work, "map.json")
    json.dump({"all": "p00"}, open(mapping, "w"))
    rows = [json.loads(x) | {"domain": "all"} for x in open(demos)]
    write_jsonl(rows, demos)
    shard(run, ShardOptions(dataset="demos", inputs=[demos], kind="prompts", text_field="prompt", answer_field="completion", router="domain", domain_field="domain",
                            domain_map=mapping, holdout=0.0))
    train(run, "p00", "sft", "demos", load_config(sets=["batch_size=8", "lr=3e-3", "warmup_steps=10", "checkpoint_every=0", "seq_len=224", "weight_decay=0"], steps=a.sft_steps),
          None, show_progress=False)
    spec = f"verifiers:calc_tools:n={a.prompts},eval_n=1,low=1,high=9"
    shard(run, ShardOptions(dataset="tools", inputs=[spec], kind="prompts", holdout=0.0))
    records = [r for p in sorted(dataset_manifest(run, "tools")["paths"]) for r in read_prompts(run, "tools", p)]
    final = os.path.join(work, "final")
    fetch_final(run, "p00", final)
    model, tok = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    sampler = episode_sampler(run, "tools", dataset_manifest(run, "tools")["environments"])
    budget = 96
    ep_s, ep_tokens, direct_s, direct_tokens, replay_s = [], 0, [], 0, []
    for _ in range(a.repeats):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        s = sampler.samples(model, records, [], tok, group=a.group, budget=budget, temperature=1.0, top_p=1.0, chunk=len(records) * a.group)
        ep_s.append(time.perf_counter() - t0)
        ep_tokens, stats = sum(sum(m) for m in s.model_masks), {"per_episode_" + k.split("/")[1]: v for k, v in sampler.last.items()}
        torch.manual_seed(0)
        t0 = time.perf_counter()
        ids, _ = complete(model, records, a.group, tok, max_new_tokens=budget, temperature=1.0, chunk=len(records) * a.group)
        direct_s.append(time.perf_counter() - t0)
        direct_tokens = sum(len(c) for c in ids)
        t0 = time.perf_counter()
        replayed = sampler.replay(records, [], tok, a.group, budget, s.completion_ids, s.model_masks, None)
        replay_s.append(time.perf_counter() - t0)
        assert replayed.rewards == s.rewards, "the replay scored the episodes otherwise"
    e, d = statistics.median(ep_s), statistics.median(direct_s)
    return {"episodes": len(records) * a.group, "model_tokens": ep_tokens, "episode_seconds": e, "model_tokens_per_s": ep_tokens / e, "direct_tokens": direct_tokens,
            "direct_seconds": d, "direct_tokens_per_s": direct_tokens / d, "ratio": (ep_tokens / e) / (direct_tokens / d),
            "replay_seconds": statistics.median(replay_s), "replay_share": statistics.median(replay_s) / e, "mean_reward": sum(s.rewards) / len(s.rewards), **stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--preset", action="append", help="model preset(s) of the single-turn arm (repeatable; default tiny-mixtral)")
    a = p.parse_args()
    a.preset = a.preset or ["tiny-mixtral"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from storage.layout import open_run

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    singles = {}
    with tempfile.TemporaryDirectory(prefix="paths-bench-envs-") as work:
        for preset in a.preset:
            init_run(os.path.join(work, preset), preset=preset, seed=0)
            run = open_run(os.path.join(work, preset))
            decompose(run, 1)
            os.makedirs(os.path.join(work, f"{preset}-work"))
            singles[preset] = single_turn(run, os.path.join(work, f"{preset}-work"), a)
        if "tiny-mixtral" not in a.preset:
            init_run(os.path.join(work, "tiny-mixtral"), preset="tiny-mixtral", seed=0)
        run = open_run(os.path.join(work, "tiny-mixtral"))
        if "tiny-mixtral" not in a.preset:
            decompose(run, 1)
        multi = multi_turn(run, work, a)
    for preset, single in singles.items():
        print(f"single turn, {single['prompts']} prompts x {a.group} ({preset} path, {single['path_parameters'] / 1e6:.2f}M parameters, fp32, CPU); "
              f"completion tokens: direct {single['tokens']['direct']}, environment {single['tokens']['environment']}")
        for k in ("direct", "environment", "plain-text"):
            print(f"  {k:12s} {single['seconds'][k]:.3f} s  {single['rollouts_per_s'][k]:8.1f} rollouts/s  {single['tokens_per_s'][k]:9.0f} tokens/s")
        print(f"  environment path costs {single['overhead'] * 100:+.1f}% per token against the direct prompt path on the same prompt tokens (goal <= +10%); "
              f"the rubric adds {single['rubric_ms_per_completion']:.3f} ms per completion")
        print(f"  against plain-text prompts ({single['prompt_tokens']['plain-text']:.0f} prompt tokens, not the chat template's {single['prompt_tokens']['chat']:.0f}): "
              f"{single['plain_text_overhead'] * 100:+.1f}%")
    print(f"multi-turn calc_tools, {multi['episodes']} episodes (after {a.sft_steps} SFT steps on worked episodes): {multi['per_episode_turns']:.2f} turns, "
          f"{multi['model_tokens'] / multi['episodes']:.1f} model + {multi['per_episode_environment_tokens']:.1f} environment tokens per episode, {multi['per_episode_forwards']:.0f} batched sampling calls, "
          f"mean reward {multi['mean_reward']:.3f}")
    print(f"  episodes {multi['model_tokens_per_s']:9.0f} model tokens/s; single-turn sampling of the same prompts {multi['direct_tokens_per_s']:9.0f} tokens/s: "
          f"{multi['ratio']:.2f}x")
    print(f"  the trainer's replay of those episodes (rollout workers' batches): {multi['replay_seconds']:.3f} s, {multi['replay_share']:.1%} of the episodes' sampling time")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "environments.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "args": vars(a), "single_turn": singles, "multi_turn": multi}) + "\n")
    print("reproduce: .venv/bin/python bench/environments.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
