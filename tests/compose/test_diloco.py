"""DiLoCo rounds in place (`paths diloco`): the outer step's arithmetic over the paths sharing each
module, every path's AdamW state kept across rounds, the outer step computed once by racing
workers (and a second computation a no-op that agrees), a path killed mid-round or between its
round's end and its sync resumed exactly by another worker, and the refusals."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load as st_load

from cli.main import main
from compose.diloco import outer_step, train
from compose.merge import compose_moe
from paths.errors import ConfigurationError, IntegrityError, NothingToClaim
from paths.models import materialize
from paths.train_config import load_config
from paths.units import claimable
from paths.work import diloco
from paths.work.claims import claim, keep_alive, read_claim
from sharding.shard import ShardOptions, shard
from storage.manifest import read_manifest, read_verified
from tests.sharding.conftest import docs, make_run, write_jsonl

SETS = ["seq_len=32", "batch_size=4", "warmup_steps=2"]


def rounds_run(url: str, tokenizer_dir: str, rounds: int = 3, every: int = 4, storage_options: dict | None = None, **outer):
    """4 paths (one level of 4 experts) with a hash-routed dataset `lm`, set up for DiLoCo rounds."""
    run = make_run(url, tokenizer_dir, 1, storage_options)
    inputs = f"{url}-in" if "://" not in url else os.path.join(os.environ.get("TMPDIR", "/tmp"), f"diloco-in-{time.time_ns()}")
    shard(run, ShardOptions(dataset="lm", inputs=[write_jsonl(os.path.join(inputs, "a.jsonl"), docs(200))], id_field="id", holdout=0.0))
    diloco.configure(run, rounds, every, **outer)
    return run


def work(run, steps: int, ttl: float = 60, checkpoint_every: int = 0, seed: int = 0, between=lambda: None) -> list[dict]:
    """`while paths claim --wait; do paths train; done` in this process; the summaries. `between()`
    runs after each `paths train` (an admin's command meanwhile)."""
    cfg = load_config(None, SETS, steps=steps, checkpoint_every=checkpoint_every, keep_checkpoints=20)
    rng, out = random.Random(seed), []
    while True:
        try:
            lease = claim(run, claimable(run), ttl=ttl, worker=f"w{seed}", rng=rng, wait=60)
        except NothingToClaim:
            return out
        beat = keep_alive(lease)
        try:
            out.append(train(run, lease.path, "lm", "lm", cfg, lease, show_progress=False, heartbeat=beat))
        except RuntimeError as exc:  # a worker killed by the test: its lease is left to expire
            assert "killed" in str(exc)
        finally:
            beat.stop()
        between()


def tensors(run, prefix: str) -> dict[str, torch.Tensor]:
    return st_load(read_verified(run.store, prefix, "model.safetensors"))


def test_rounds_keep_each_paths_optimizer_and_take_nesterov_steps_over_the_paths_sharing_each_module(tmp_path, tokenizer_dir):
    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=3, every=2)
    summaries = work(run, 6, checkpoint_every=1)
    assert sum("waiting" in s for s in summaries) >= 3 and sum("final" in s for s in summaries) == 4
    assert diloco.status(run)["rounds_done"] == 3 and read_claim(run, "p02")[0]["state"] == "done"

    # the outer step: each module over the paths that share it, Nesterov momentum carried across rounds
    lr, mu = 0.7, 0.9
    base = tensors(run, "base")
    start, m = base, {}
    for r in (1, 2, 3):
        paths = {p: tensors(run, run.diloco(r, p)) for p in ("p00", "p01", "p02", "p03")}
        got = tensors(run, run.composed(f"round-{r}"))
        for name, dense in (("model.layers.0.self_attn.q_proj.weight", None), ("model.embed_tokens.weight", None),
                            ("model.layers.1.block_sparse_moe.experts.2.w1.weight", "model.layers.1.mlp.gate_proj.weight")):
            through = ["p02"] if dense else list(paths)  # expert 2 of a one-level plan: path p02 alone
            d = torch.stack([paths[p][dense or name] - start[name] for p in through]).mean(0)
            m[name] = d if r == 1 else mu * m[name] + d
            assert torch.allclose(got[name], start[name] + lr * (d + mu * m[name]), atol=1e-6), (r, name)
        assert got["model.layers.1.block_sparse_moe.gate.weight"].equal(base["model.layers.1.block_sparse_moe.gate.weight"])  # routers: kept
        start = got

    # each path starts round r + 1 from its slice of composed/round-<r>/, with its AdamW moments and step count
    from paths import checkpoint

    cut = str(tmp_path / "cut")
    materialize(run, "p01", cut, source=run.composed("round-1"))
    step3 = tensors(run, run.checkpoint("p01", 3))
    step2 = tensors(run, run.checkpoint("p01", 2))  # the round's end, before the sync
    synced = st_load(open(os.path.join(cut, "model.safetensors"), "rb").read())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (step3[name] - synced[name]).abs().max() < (step3[name] - step2[name]).abs().max()  # one step away from the synced weights
    opt = st_load(read_verified(run.store, run.checkpoint("p01", 3), "optimizer.safetensors"))
    assert float(opt["0.step"]) == 3.0  # AdamW was not restarted at the round's start
    assert step2[name].equal(tensors(run, run.diloco(1, "p01"))[name])


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_the_outer_step_is_computed_once_by_racing_workers_and_again_is_a_noop_that_agrees(backend, store_url, tokenizer_dir, tmp_path):
    url, options = store_url
    run = rounds_run(url, tokenizer_dir, rounds=2, every=2, storage_options=options)
    torch.manual_seed(0)
    for p in ("p00", "p01", "p02", "p03"):  # every path's round 1, as its workers publish it
        folder = str(tmp_path / p)
        materialize(run, p, folder)
        weights = {k: v + 0.01 * torch.randn_like(v) for k, v in st_load(open(os.path.join(folder, "model.safetensors"), "rb").read()).items()}
        assert diloco.publish(run, 1, p, weights, lambda: None, step=2)
    assert outer_step(run, 2) is None  # round 2 has nobody in yet

    results, barrier = [None] * 4, threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        deadline = time.time() + 60
        while results[i] is None and time.time() < deadline:  # None: another worker is computing it
            results[i] = outer_step(run, 1, worker=f"w{i}")
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results) and sum(r["computed"] for r in results) == 1
    again = outer_step(run, 1, worker="late")
    assert again["computed"] is False and again["paths"] == 4
    assert b'"done"' in run.store.read("diloco/r1/outer.json")

    # republished weights under the same round: the committed outer step no longer agrees
    run.store.delete_prefix(run.diloco(1, "p03"))
    diloco.publish(run, 1, "p03", {k: v * 2 for k, v in tensors(run, run.diloco(1, "p02")).items()}, lambda: None)
    with pytest.raises(IntegrityError, match="computed from other weights of path p03"):
        outer_step(run, 1)


@pytest.mark.slow
def test_a_path_killed_mid_round_or_before_its_sync_is_taken_over_and_resumed_exactly(tmp_path, tokenizer_dir, monkeypatch):
    reference = rounds_run(str(tmp_path / "ref"), tokenizer_dir)
    work(reference, 12, checkpoint_every=2)

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir)
    from paths.trainer import Trainer

    killed: list[str] = []
    save, sync = Trainer.save_checkpoint, diloco.sync

    def save_then_die(self):  # kill -9 of p01's worker right after its checkpoint at step 6 (mid round 2)
        save(self)
        if self.unit == "p01" and self.step == 6 and "p01" not in killed:
            killed.append("p01")
            raise RuntimeError("killed after ckpt-6")

    def die_before_sync(model, run_, path, r):  # p02's worker dies between publishing round 1 and its sync
        if path == "p02" and "p02" not in killed:
            killed.append("p02")
            raise RuntimeError("killed before the sync")
        return sync(model, run_, path, r)

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_die)
    monkeypatch.setattr(diloco, "sync", die_before_sync)
    work(run, 12, ttl=5, checkpoint_every=2, seed=1)
    assert sorted(killed) == ["p01", "p02"]
    for p in ("p00", "p01", "p02", "p03"):
        record, _ = read_claim(run, p)
        assert record["state"] == "done", record
        got, want = tensors(run, run.final(p)), tensors(reference, reference.final(p))
        assert all(torch.equal(got[k], want[k]) for k in want), p
    assert read_claim(run, "p01")[0]["generation"] > read_claim(reference, "p01")[0]["generation"]  # taken over, not handed back
    for r in (1, 2, 3):
        a, b = tensors(run, run.composed(f"round-{r}")), tensors(reference, reference.composed(f"round-{r}"))
        assert all(torch.equal(a[k], b[k]) for k in b), r


def test_rounds_refuse_what_they_cannot_average(tmp_path, tokenizer_dir):
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from storage.layout import open_run

    init_run(str(tmp_path / "one"), preset="tiny-mixtral", tokenizer_dir=tokenizer_dir, seed=1)
    one = open_run(str(tmp_path / "one"))
    decompose(one, 1, "p00")
    with pytest.raises(ConfigurationError, match="1 decomposed path: a round's outer step averages"):
        diloco.configure(one, 2, 2)

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=2, every=2)
    with pytest.raises(ConfigurationError, match="trains in DiLoCo rounds: its composed model is composed/round-<last round>"):
        compose_moe(run, "moe")
    cfg = load_config(None, SETS, steps=5, checkpoint_every=0)
    with pytest.raises(ConfigurationError, match="train with --steps 4"):
        train(run, "p00", "lm", "lm", cfg, None, show_progress=False)
    from paths.work.train import train as train_without_outer_step

    with pytest.raises(ConfigurationError, match="train its paths with compose.diloco.train"):
        train_without_outer_step(run, "p00", "lm", "lm", load_config(None, SETS, steps=4), None, show_progress=False)
    with pytest.raises(ConfigurationError, match="drop --lora, --fsdp and --freeze"):
        train(run, "p00", "lm", "lm", load_config(None, [*SETS, "lora_rank=4"], steps=4), None, show_progress=False)
    lease = claim(run, ["p00"], ttl=60)
    lease.finish("open")
    with pytest.raises(ConfigurationError, match="already being trained"):
        diloco.configure(run, 3, 2)
    with pytest.raises(ConfigurationError, match="rounds count from 1"):
        run.diloco(0)
    with pytest.raises(IntegrityError, match="trains 2 DiLoCo rounds; there is no round 3"):
        outer_step(run, 3)


def test_cli_sets_rounds_up_and_shows_them(tmp_path, tokenizer_dir):
    run = make_run(str(tmp_path / "run"), tokenizer_dir, 1)
    cli = CliRunner()
    out = cli.invoke(main, ["diloco", run.url, "--rounds", "2", "--inner-steps", "3", "--outer-lr", "0.5", "--momentum", "0.8"])
    assert out.exit_code == 0, out.output
    assert "4 paths will train 2 rounds of 3 steps" in out.stderr
    out = cli.invoke(main, ["diloco", run.url, "--step"])
    assert out.exit_code == 0 and "round 1: 0/4 paths in, outer step not yet" in out.output, out.output
    out = cli.invoke(main, ["diloco", run.url, "--rounds", "2"])
    assert out.exit_code != 0 and "both --rounds R and --inner-steps H" in out.output
    spec = diloco.settings(run)
    assert (spec.total, spec.outer_lr, spec.momentum) == (6, 0.5, 0.8)
    plain = make_run(str(tmp_path / "plain"), tokenizer_dir, 1)
    out = cli.invoke(main, ["diloco", plain.url])
    assert out.exit_code == 1 and "does not train in DiLoCo rounds" in out.output


def test_two_workers_wait_for_each_other_at_round_ends_and_end_as_one_worker_does(tmp_path, tokenizer_dir):
    reference = rounds_run(str(tmp_path / "ref"), tokenizer_dir, rounds=2, every=2)
    work(reference, 4)
    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=2, every=2)
    done: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: done.setdefault(i, work(run, 4, seed=i))) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(v) for v in done.values()) >= 4 and diloco.status(run)["rounds_done"] == 2
    for p in ("p00", "p01", "p02", "p03"):
        assert read_claim(run, p)[0]["state"] == "done"
        got, want = tensors(run, run.final(p)), tensors(reference, reference.final(p))
        assert all(torch.equal(got[k], want[k]) for k in want), p


def test_a_round_whose_outer_step_nobody_computes_is_taken_up_by_the_next_claim(tmp_path, tokenizer_dir):
    """Every path is in and waiting, and the worker that held the outer step's lock died: the
    paths become claimable, and the claimer's round end computes the step."""
    import json

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=2, every=2)
    torch.manual_seed(0)
    for p in ("p00", "p01", "p02", "p03"):
        folder = str(tmp_path / p)
        materialize(run, p, folder)
        diloco.publish(run, 1, p, st_load(open(os.path.join(folder, "model.safetensors"), "rb").read()), lambda: None, step=2)
        lease = claim(run, [p], ttl=60)
        lease.finish("waiting", round=1, step=2)
    held = {"round": 1, "worker": "dead", "state": "computing", "generation": 1, "expires_at": time.time() + 60}
    run.store.write("diloco/r1/outer.json", json.dumps(held).encode())
    with pytest.raises(NothingToClaim, match="4 paths wait for a DiLoCo round's outer step") as nothing:
        claim(run, claimable(run), ttl=60)
    assert nothing.value.waiting == 4
    out = CliRunner().invoke(main, ["claim", run.url, "--ttl", "60"], env={"PATHS_HOME": str(tmp_path / "home")})
    assert out.exit_code == 75 and "4 paths wait for a DiLoCo round's outer step" in out.output, out.output  # not 3: the run is not done
    run.store.write("diloco/r1/outer.json", json.dumps({**held, "expires_at": time.time() - 1}).encode())
    lease = claim(run, claimable(run), ttl=60)
    assert lease.record["generation"] == 2
    assert outer_step(run, 1, worker="next")["computed"] is True  # the lock expired: taken over


def test_a_path_marked_failed_is_dropped_from_the_rounds_and_the_others_go_on(tmp_path, tokenizer_dir):
    """An admin marks p03 failed before anyone trains it: the outer steps average the three paths
    in (its expert keeps the base's values), no round waits for it, and `paths diloco` says so;
    released again after the last round, it skips the rounds made without it: its final weights are
    its slice of the last outer step, and the run ends as usual."""
    from paths.work.claims import release

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=2, every=2, outer_lr=1.0, momentum=0.0)
    release(run, "p03", "failed")
    summaries = work(run, 4)
    assert sum("final" in s for s in summaries) == 3
    state = diloco.status(run)
    assert state["rounds_done"] == 2 and state["dropped"] == ["p03"] and state["progress"][0]["paths_in"] == 3
    base, start = tensors(run, "base"), tensors(run, "base")
    for r in (1, 2):
        got = tensors(run, run.composed(f"round-{r}"))
        paths = {p: tensors(run, run.diloco(r, p)) for p in ("p00", "p01", "p02")}
        name = "model.layers.0.self_attn.q_proj.weight"  # shared: the mean of the three paths in (outer lr 1, no momentum)
        assert torch.allclose(got[name], torch.stack([paths[p][name] for p in paths]).mean(0), atol=1e-6), r
        expert = "model.layers.1.block_sparse_moe.experts.3.w1.weight"  # p03's: nobody trained it
        assert got[expert].equal(base[expert]) and not got[name].equal(start[name])
        start = got
    out = CliRunner().invoke(main, ["diloco", run.url])
    assert out.exit_code == 0 and "dropped (marked failed): p03" in out.output and "round 2: 3/4 paths in, outer step composed/round-2" in out.output, out.output

    release(run, "p03", "open")  # taken back: every round was made without it
    (summary,) = [s for s in work(run, 4) if "final" in s]
    assert summary["path"] == "p03" and summary["rejoined"] == {"rounds_skipped": [1, 2], "from": "composed/round-2", "at_step": 4} and summary["tokens"] == 0
    folder = str(tmp_path / "p03-slice")
    materialize(run, "p03", folder, source=run.composed("round-2"))
    final, expected = tensors(run, run.final("p03")), st_load(open(os.path.join(folder, "model.safetensors"), "rb").read())
    assert final.keys() == expected.keys() and all(final[k].equal(expected[k]) for k in final)  # trained no step
    assert read_claim(run, "p03")[0]["state"] == "done" and "dropped" not in diloco.status(run)
    out = CliRunner().invoke(main, ["diloco", run.url])
    assert "round 2: 4/4 paths in, outer step composed/round-2 (3 averaged, 1 in after it)" in out.output, out.output


def test_a_dropped_path_released_mid_run_goes_on_from_the_newest_outer_step(tmp_path, tokenizer_dir):
    """p03 is marked failed before anyone trains it and released once round 2's outer step is
    made: it trains round 3 only, from composed/round-2, at round 3's point of the schedule, and
    round 3's outer step averages all four paths."""
    from paths.trainer import lr_factor, read_metrics
    from paths.work.claims import outer_done, release

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=3, every=2, outer_lr=1.0, momentum=0.0)
    release(run, "p03", "failed")

    def admin() -> None:
        if outer_done(run, 2) and read_claim(run, "p03")[0]["state"] == "failed":
            release(run, "p03", "open")

    summaries = work(run, 6, checkpoint_every=1, between=admin)
    (back,) = [s for s in summaries if s["path"] == "p03"]
    assert back["rejoined"] == {"rounds_skipped": [1, 2], "from": "composed/round-2", "at_step": 4} and "final" in back
    steps = [m for m in read_metrics(run, "p03") if "loss" in m]
    assert [m["step"] for m in steps] == [5, 6]  # round 3's inner steps, no others
    cfg = load_config(None, SETS, steps=6)
    assert [m["lr"] for m in steps] == pytest.approx([cfg.lr * lr_factor(s, cfg) for s in (5, 6)])  # the schedule where the others are
    assert not run.store.exists(f"{run.diloco(1, 'p03')}/manifest.json") and not run.store.exists(f"{run.diloco(2, 'p03')}/manifest.json")
    state = diloco.status(run)
    assert state["rounds_done"] == 3 and [len(p["averaged"]) for p in state["progress"]] == [3, 3, 4] and "dropped" not in state


def test_a_takeover_after_the_last_rounds_publish_retrains_that_round_not_skips_it(tmp_path, tokenizer_dir):
    """A worker publishes its path's last round (and the run's outer step) and dies before it hands
    the path back: the next worker resumes from the round's start and retrains it exactly, keeping
    the path's own final weights; it does not take the outer step's slice as a rejoining path does."""
    from paths.work.claims import release

    run = rounds_run(str(tmp_path / "run"), tokenizer_dir, rounds=2, every=2)
    work(run, 4)
    assert diloco.status(run)["rounds_done"] == 2
    before = tensors(run, run.final("p01"))
    release(run, "p01", "open")  # as if its lease had expired before the hand-back
    (again,) = [s for s in work(run, 4) if s["path"] == "p01"]
    assert "rejoined" not in again and again["resumed_from"] == 2
    after = tensors(run, run.final("p01"))
    assert all(after[k].equal(before[k]) for k in before)


@pytest.mark.parametrize("preset, expert", [("tiny-mixtral", "model.layers.1.block_sparse_moe.experts.3.w1.weight"),  # a tensor per expert
                                             ("tiny-gptoss", "model.layers.1.mlp.experts.gate_up_proj")])  # the experts fused: slice 3
def test_a_dropped_paths_expert_keeps_its_value_and_momentum(tmp_path, tokenizer_dir, preset, expert):
    """p03 is in round 1, then marked failed: round 2's outer step (momentum 0.9) leaves its expert
    as round 1 made it and carries that expert's momentum on untouched, while the shared modules
    take the three others' step."""
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from paths.work.claims import release
    from storage.layout import open_run

    init_run(str(tmp_path / "run"), preset=preset, tokenizer_dir=tokenizer_dir, seed=1)
    run = open_run(str(tmp_path / "run"))
    decompose(run, 1)
    diloco.configure(run, 3, 2, outer_lr=0.7, momentum=0.9)
    torch.manual_seed(0)

    def publish_round(r: int, paths: list[str]) -> None:
        for p in paths:
            folder = str(tmp_path / f"{p}-{r}")
            materialize(run, p, folder, source=run.base if r == 1 else run.composed(f"round-{r - 1}"))
            weights = {k: v + 0.01 * torch.randn_like(v) for k, v in st_load(open(os.path.join(folder, "model.safetensors"), "rb").read()).items()}
            assert diloco.publish(run, r, p, weights, lambda: None, step=2 * r)

    publish_round(1, ["p00", "p01", "p02", "p03"])
    assert outer_step(run, 1)["paths"] == 4
    release(run, "p03", "failed")
    publish_round(2, ["p00", "p01", "p02"])
    assert outer_step(run, 2)["paths"] == 3
    one, two = tensors(run, run.composed("round-1")), tensors(run, run.composed("round-2"))
    m1 = st_load(read_verified(run.store, run.composed("round-1"), "momentum.safetensors"))
    m2 = st_load(read_verified(run.store, run.composed("round-2"), "momentum.safetensors"))
    mine = (lambda t: t[3]) if "experts.3" not in expert else (lambda t: t)  # p03's expert, or its slice of the fused tensor
    assert mine(two[expert]).equal(mine(one[expert])) and mine(m2[expert]).equal(mine(m1[expert]))
    if "experts.3" not in expert:  # the other slices of the same tensor took the others' step
        assert not two[expert][0].equal(one[expert][0])
    shared = "model.layers.0.self_attn.q_proj.weight"
    assert not two[shared].equal(one[shared]) and not m2[shared].equal(m1[shared])
