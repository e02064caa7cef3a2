"""Rollouts nobody has to trust, measured: honest divergence per dtype, how often forgeries are
caught, and what the checks cost the trainer, against TOPLOC (Prime Intellect's verifiable
inference, INTELLECT-2) on the same rows.

    .venv/bin/python bench/verify_rollouts.py [--seed-steps 300] [--batches 6] [--trials 30] [--steps 8]

Setup (bench/async_rl.py's): the SFT cold start of a mini-mixtral path on worked arithmetic (a
trained model, not a random one: its distributions are sharp, as a real policy's are), upcycled
into 4 experts; path p00's prompts; the quickstart swarm's sampling settings (batch 8 x G 8, 24
new tokens, temperature 1).
1. Honest divergence: an honest worker writes --batches batches in fp32, bf16 and int8 from policy
   version 0; the trainer's teacher-forced check of every row: the share of positions whose seeded
   point falls outside the sampled token's CDF interval, the largest distance (probability mass),
   its 99.9th percentile, and the largest behaviour-probability gap; next to verify.py's tolerances.
2. Detection: fp32 batches with a quarter of their rows forged (moved between prompts, the answer's
   last token edited, best-of-4 with true log-probs), rewards and log-probs recomputed truthfully,
   checked with the default settings (the fewest rows for >= 99%): rejected share over --trials
   batches per kind, against the stated probability.
3. Cost: the asynchronous trainer over pre-written honest batches at the swarm's settings
   (--external 4 included): seconds of checks per step against the step's seconds; and the peer,
   TOPLOC 0.1.6 (built from source against this torch, `make bench`), on the same checked rows:
   proofs built on the worker, and on the trainer a teacher-forced pass plus proof validation; and
   whether TOPLOC accepts the best-of-4 forgery (its activations are honest: it does).
Appended to bench/out/verify_rollouts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from async_rl import new_run  # noqa: E402
from rl_paths import sft_seed  # noqa: E402

SWARM = ["batch_size=8", "group_size=8", "max_new_tokens=24", "temperature=1.0"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "verify_rollouts"))
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--seed-steps", type=int, default=300)
    ap.add_argument("--batches", type=int, default=6, help="honest batches per dtype")
    ap.add_argument("--trials", type=int, default=30, help="forged batches per kind")
    ap.add_argument("--steps", type=int, default=8, help="trainer steps for the cost")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)

    import torch

    from paths.train_config import load_config
    from paths.work.grpo import logprobs_in_chunks, pack, sample_and_score, score_samples
    from paths.work.rewards import load_reward
    from paths.work.rollouts import TOLERANCES, Rejected, admit, decode, load_key, new_key, publish, rollout_worker
    from paths.work.rollouts.seeds import batch_seed, row_uniforms
    from paths.work.rollouts.source import StoreRollouts
    from paths.work.rollouts.verify import Tolerance, position_misses
    from sharding.dataset import read_prompts
    from storage.layout import open_run

    torch.set_num_threads(2)
    t0 = time.time()
    tasks, seed_dir = os.path.join(a.work, "tasks.jsonl"), os.path.join(a.work, "seed-p00")
    if not os.path.exists(os.path.join(seed_dir, "config.json")):  # the trained seed is built once per --work
        tasks, seed_dir = sft_seed(a.work, a.prompts, a.seed_steps)
    run = open_run(new_run(a.work, f"run-{int(t0)}", tasks, seed_dir))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.models import materialize

    init = os.path.join(a.work, f"p00-{int(t0)}")
    materialize(run, "p00", init)
    make = lambda: AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(init)
    cfg = load_config(sets=[*SWARM, "rollouts=store", "max_async=1000", "rollout_wait=0", "checkpoint_every=0", "warmup_steps=2", "lr=1e-4", "external=4",
                           "rollout_dtypes=fp32,bf16,int8"], mode="grpo")
    rewards = [load_reward("math_answer"), load_reward("format=0.2")]
    records = read_prompts(run, "rl", "p00")
    salt = "5a" * 32
    record = publish(run, "p00", 0, make(), salt, max_async=1000, step=0)
    src = StoreRollouts(run, "p00", "rl", cfg, records, rewards, tokenizer, make)
    keys = {}
    for name in ("fp32", "bf16", "int8", "forger", "p01"):
        path = os.path.join(a.work, "keys", f"{name}-{int(t0)}.key")
        admit(run, name, new_key(path))
        keys[name] = load_key(path)
    out: dict = {"settings": SWARM, "seed_steps": a.seed_steps}

    # 1. honest divergence per dtype
    loose = Tolerance(1.0, 1.0, 1.0)
    divergence = {}
    for dtype in ("fp32", "bf16", "int8"):
        rollout_worker(run, "p00", "rl", cfg, rewards, key=keys[dtype], dtype=dtype, batches=a.batches, wait=30)
        misses, gaps, inside = [], [], []
        model = src.verifier.model(0, dtype)
        for o in run.store.list(f"rollouts/p00/batches/{dtype}"):
            b = decode(run.store.read(o.key), o.key, 1 << 30)
            u = row_uniforms(batch_seed(record["nonce"], dtype, b.meta["key"], b.position), len(b.completion_ids), cfg.max_new_tokens)
            recs = [records[i] for i in b.meta["prompt_index"] for _ in range(cfg.group_size)]
            for miss, ins, gap in position_misses(model, recs, b.completion_ids, u, b.behaviour_logp_NC, cfg.temperature, cfg.top_p, tokenizer.pad_token_id,
                                                  share_prompts=cfg.share_prompts and dtype != "bf16"):
                misses.append(miss), gaps.append(gap), inside.append(ins)
        miss, gap, ins = torch.cat(misses), torch.cat(gaps), torch.cat(inside)
        tol = TOLERANCES[dtype]
        divergence[dtype] = {"positions": len(miss), "outside_share": float((~ins).float().mean()), "max_miss": float(miss.max()), "q999_miss": float(miss.quantile(0.999)),
                             "max_prob_gap": float(gap.max()), "tolerance": {"slack": tol.slack, "near_share": tol.near_share, "prob": tol.prob}}
        d = divergence[dtype]
        print(f"honest {dtype}: {d['positions']} positions, {d['outside_share']:.4%} outside their interval (tolerance {tol.near_share:.0%}), largest miss {d['max_miss']:.2e} "
              f"(q99.9 {d['q999_miss']:.2e}; slack {tol.slack}), largest probability gap {d['max_prob_gap']:.2e} (tolerance {tol.prob})", flush=True)
    out["divergence"] = divergence

    # 2. detection at the default settings, in the tightest and the loosest dtype a worker may state
    model = make().eval()
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(0)

    def forged(kind: str, trial: int, dtype: str = "fp32"):
        honest = [decode(run.store.read(o.key), o.key, 1 << 30) for o in run.store.list(f"rollouts/p00/batches/{dtype}")]
        b = honest[trial % len(honest)]
        comps = [list(c) for c in b.completion_ids]
        rows = rng.sample(range(len(comps)), len(comps) // 4)
        if kind == "moved":  # the forged rows' completions rotated among themselves (other prompts)
            moved = [comps[r] for r in rows]
            for r, c in zip(rows, moved[1:] + moved[:1]):
                comps[r] = c
        elif kind == "edited":
            for r in rows:
                t = max(0, len(comps[r]) - 2)
                comps[r][t] = next(d for d in digits if d != comps[r][t])
        else:  # best of 4 fresh samples of each forged row's prompt, by reward
            torch.manual_seed(trial)
            for r in rows:
                rec = records[b.meta["prompt_index"][r // cfg.group_size]]
                tries = sample_and_score(model, [rec], rewards, load_config(sets=[*SWARM, "group_size=4"], mode="grpo"), tokenizer)
                comps[r] = tries.completion_ids[max(range(4), key=lambda k: tries.rewards[k])]
        changed = sum(comps[r] != b.completion_ids[r] for r in range(len(comps)))
        recs = [records[i] for i in b.meta["prompt_index"]]
        samples = score_samples(recs, comps, [c[-1] != tokenizer.eos_token_id for c in comps], rewards, cfg, tokenizer)
        ids, att, p, _ = pack(recs, comps, cfg.group_size, tokenizer.pad_token_id, torch.device("cpu"))
        logp = logprobs_in_chunks(src.verifier.model(0, dtype), ids, att, p, cfg.temperature, len(ids))  # the true log-probs, as the stated dtype computes them
        width = max(len(c) for c in comps)
        from paths.work.rollouts.batch import Batch

        return Batch(b.key, {**b.meta, "rewards": samples.rewards}, comps, logp[:, :width], 0), changed

    detection = {}
    for dtype in ("fp32", "int8"):
        for kind in ("moved", "edited", "best-of-4"):
            caught = changed_rows = 0
            for trial in range(a.trials):
                batch, changed = forged(kind, trial, dtype)
                changed_rows += changed
                try:
                    src.verifier.verify(batch, record, lambda h: False)
                except Rejected:
                    caught += 1
            detection[f"{dtype} {kind}"] = {"rejected": caught / a.trials, "forged_rows_mean": changed_rows / a.trials}
            print(f"forged ({kind}, 25% of rows, stated {dtype}): {caught}/{a.trials} batches rejected with {src.verifier.rows} of 64 rows checked; stated "
                  f"{src.verifier.detect:.4f} (rows actually different: {changed_rows / a.trials:.1f} of 16)", flush=True)
    out["detection"] = {"rows_checked": src.verifier.rows, "stated": src.verifier.detect, **detection}
    honest = [decode(run.store.read(o.key), o.key, 1 << 30) for o in run.store.list("rollouts/p00/batches/fp32")]

    # 3. cost: the trainer over honest batches (p01's for SAPO's external groups), and TOPLOC
    from paths.work.rollouts import publish as publish_version

    publish_version(run, "p01", 0, make(), salt, max_async=1000, step=0)
    rollout_worker(run, "p01", "rl", cfg, rewards, key=keys["p01"], batches=2, wait=30)
    rollout_worker(run, "p00", "rl", cfg, rewards, key=keys["fp32"], batches=a.steps, wait=30)
    from paths.work.rollouts.verify import BatchVerifier
    from paths.work.train import train

    def verify_fresh(self, batch, *args):  # as in a live run, where each step's batch comes from a newer version: loaded each time
        self._model = None
        return verify(self, batch, *args)

    verify = BatchVerifier.verify
    BatchVerifier.verify = verify_fresh
    for o in run.store.list("rollouts/p00/batches"):
        if not o.key.split("/")[3] == "fp32":
            run.store.delete(o.key)  # the cost run takes the fp32 worker's batches only
    train(run, "p00", "grpo", "rl", load_config(sets=[*SWARM, "rollouts=store", "max_async=1000", "rollout_wait=0", "checkpoint_every=0", "warmup_steps=2", "lr=1e-4",
                                                      "external=4"], steps=a.steps, mode="grpo"), None, show_progress=False, rewards=["math_answer", "format=0.2"])
    BatchVerifier.verify = verify
    steps = [json.loads(x) for x in run.store.read("work/p00/metrics.jsonl").decode().splitlines()]
    step_s = [b["time"] - c["time"] for c, b in zip(steps, steps[1:])]
    verify_s = [m["verify_seconds"] for m in steps[1:]]
    share = sum(verify_s) / sum(step_s)
    print(f"cost: checks {sum(verify_s) / len(verify_s):.3f} s of a {sum(step_s) / len(step_s):.3f} s trainer step = {share:.1%} (goal <= 15%), "
          f"{src.verifier.rows} of 64 rows seed-checked, the version loaded each step", flush=True)
    out["cost"] = {"verify_s_per_step": sum(verify_s) / len(verify_s), "step_s": sum(step_s) / len(step_s), "share": share}
    out["toploc"] = toploc(make, records, honest, cfg, src, tokenizer, forged, record["nonce"])
    out["seconds"] = time.time() - t0
    print(f"reproduce: .venv/bin/python bench/verify_rollouts.py --seed-steps {a.seed_steps} --batches {a.batches} --trials {a.trials} --steps {a.steps}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "verify_rollouts.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), **out}) + "\n")


def toploc(make, records, honest, cfg, src, tokenizer, forged, nonce: str) -> dict:
    """TOPLOC on the rows we check: proofs of the final hidden states (bf16, its only dtype) built
    for every row on the worker, validated on the trainer after a teacher-forced pass of the checked
    rows; against our seed check of the same rows."""
    try:
        from toploc import build_proofs_base64, verify_proofs_base64
    except ImportError as exc:
        print(f"TOPLOC not importable ({exc}): `make bench` builds it from source against this torch; skipped")
        return {"skipped": str(exc)}
    import torch

    from paths.work.grpo import pack
    from paths.work.rollouts.seeds import batch_seed

    model = make().eval()
    k = src.verifier.rows

    def hidden(recs, comps):
        ids, att, p, _ = pack(recs, comps, 1, tokenizer.pad_token_id, torch.device("cpu"))
        with torch.inference_mode():
            h = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[-1].to(torch.bfloat16)
        return [[h[i, att[i].bool()][: att[i].sum() - len(c)]] + list(h[i, att[i].bool()][att[i].sum() - len(c):]) for i, c in enumerate(comps)]

    worker_s = trainer_s = ours_s = 0.0
    for b in honest:
        recs = [records[i] for i in b.meta["prompt_index"] for _ in range(cfg.group_size)]
        t = time.perf_counter()
        proofs = [build_proofs_base64(acts, decode_batching_size=32, topk=128, skip_prefill=False) for acts in hidden(recs, b.completion_ids)]  # the worker, every row
        worker_s += time.perf_counter() - t
        rows = sorted(random.sample(range(len(b.completion_ids)), k))
        t = time.perf_counter()
        acts = hidden([recs[r] for r in rows], [b.completion_ids[r] for r in rows])
        results = [verify_proofs_base64(x, proofs[r], decode_batching_size=32, topk=128, skip_prefill=False) for x, r in zip(acts, rows)]
        trainer_s += time.perf_counter() - t
        assert all(v.exp_mismatches == 0 for res in results for v in res)
        t = time.perf_counter()
        src.verifier.check_seeds(b, [records[i] for i in b.meta["prompt_index"]], batch_seed(nonce, b.worker, b.meta["key"], b.position), rows)
        ours_s += time.perf_counter() - t
    batch, _ = forged("best-of-4", 0)
    recs = [records[i] for i in batch.meta["prompt_index"] for _ in range(cfg.group_size)]
    acts = hidden(recs, batch.completion_ids)  # the forger proves its chosen rows' activations honestly
    accepted = all(v.exp_mismatches == 0 for x in acts for v in verify_proofs_base64(x, build_proofs_base64(x, decode_batching_size=32, topk=128, skip_prefill=False),
                                                                                         decode_batching_size=32, topk=128, skip_prefill=False))
    n = len(honest)
    print(f"TOPLOC per batch: worker proofs {worker_s / n:.3f} s (ours: no proofs), trainer {trainer_s / n:.3f} s for {k} rows; our seed check {ours_s / n:.3f} s for the same rows: "
          f"ratio ours/TOPLOC on the trainer {ours_s / max(1e-9, trainer_s):.2f}x; TOPLOC accepts the best-of-4 forgery: {accepted} (the seed check rejects it)", flush=True)
    return {"worker_s": worker_s / n, "trainer_s": trainer_s / n, "ours_s": ours_s / n, "ratio_trainer": ours_s / max(1e-9, trainer_s), "accepts_best_of_4": accepted}


if __name__ == "__main__":
    main()
