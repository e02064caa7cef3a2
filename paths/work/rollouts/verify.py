"""The trainer's checks of a rollout batch: everything it can recompute, it recomputes.

On every row (cheap): the prompts are the ones the batch seed draws, each is the path's own
prompt, completions are well formed (EOS only at the end, cut only at max_new_tokens, ids in the
vocabulary, finite log-probs), rewards are recomputed from the text (stated ones that differ
reject the batch), and no row was learned before (its hash joins the trainer's data position).

On rows picked in secret (the trainer's own system randomness, nothing the worker controls):
the seed check. One teacher-forced pass of the stated policy version, in the stated dtype, gives
each position's sampling distribution; the worker drew token t of row r by inverse CDF with the
seeded number u[r, t], so u must fall inside the stated token's CDF interval. A position may miss
it only by `slack` of probability mass, and only a `near_share` of the checked positions may miss
at all (honest workers miss when the worker's and the trainer's kernels round differently; the
tolerances per dtype are measured in bench/verify_rollouts.py). The behaviour log-probs of the
checked tokens are compared token by token. A moved, edited, invented or cherry-picked completion
is not what its seeds draw: it misses at the first position where the model was not certain.

Episodes (a multi-turn environment): the model's tokens are checked as above, each against its
seeded number for its position in the episode; the environment's are not drawn from the policy.
The trainer replays every episode (episodes.py `EpisodeSampler.replay`): verifiers runs it again
with the batch's model turns, the environment answering anew (or, for an environment that says
it is not deterministic, from the answers the batch recorded); the transcript must come out token
for token as the batch's, and the rubric scores the replayed episode.

How many rows: the fewest k of N such that a batch with a `forged_share` of forged rows is
rejected with probability >= `goal` (hypergeometric: no forged row among k draws).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from paths.errors import DataError
from paths.work.grpo import Samples, completion_logits, pack, score_samples
from paths.work.rollouts.batch import DTYPES, Batch, Rejected, prompt_sha
from paths.work.rollouts.policy import PolicyReader, copy_as
from paths.work.rollouts.seeds import batch_seed, pick_prompts, row_hash, row_uniforms
from paths.work.sampling import device_of, sampling_cdf
from storage.layout import Run

POSITIONS_PER_CHUNK = 1 << 24  # (positions x vocabulary) floats a seed check holds at once
OWN_VERSIONS_BYTES = 1 << 30  # the trainer's own published versions the checks keep in memory, at most (beyond: read back from the store)


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How far an honest worker of a dtype may be from the trainer's own computation."""

    slack: float  # probability mass between a position's seeded point and the stated token's interval
    near_share: float  # share of checked positions that may miss their interval at all (by <= slack)
    prob: float  # |p_stated - p_trainer| of a checked token's behaviour probability


# Honest divergence measured on CPU (bench/verify_rollouts.py on an SFT-trained mini-mixtral path,
# 64-row batches, 24 tokens, temperature 1; README "Rollouts nobody has to trust"): the largest
# miss and share of positions outside their interval seen over three runs: fp32 0 and 0%; bf16
# 8.2e-3 and 3.6% (a less trained seed); behaviour-probability gaps below 2e-6. int8, whose
# activations are quantized per token (quantize.py), 0 and 0% over 39k positions, behaviour-
# probability gaps up to 2.5e-3 (a token whose activation sits on a rounding step rounds apart
# when the KV cache's fp32 attention differs in its last bit); with per-tensor scales it missed by
# up to 0.33 (12% of positions) and needed a slack of 0.3. Each bound sits well above the worst
# honest value (fp32's leaves room for another machine's kernels). A worker states its dtype, so
# the loosest accepted one bounds what a liar gets: `rollout_dtypes = "fp32"` takes fp32 only.
TOLERANCES = {
    "fp32": Tolerance(slack=1e-3, near_share=0.01, prob=1e-3),
    "bf16": Tolerance(slack=0.05, near_share=0.10, prob=0.01),
    "int8": Tolerance(slack=0.05, near_share=0.10, prob=0.02),
}


def detection_probability(n: int, k: int, forged_share: float) -> float:
    """P(at least one forged row among k of n rows drawn without replacement), with
    ceil(forged_share x n) forged rows."""
    forged = min(n, max(1, math.ceil(forged_share * n)))
    k = min(k, n)
    return 1.0 - math.comb(n - forged, k) / math.comb(n, k)


def rows_to_verify(n: int, forged_share: float, goal: float, rows: int = 0) -> int:
    """`rows` when given (at most n), else the fewest rows reaching `goal`."""
    if rows:
        return min(rows, n)
    return next(k for k in range(1, n + 1) if detection_probability(n, k, forged_share) >= goal or k == n)


@dataclass
class SeedCheck:
    """What the seed check of a batch's picked rows saw."""

    rows: int = 0
    positions: int = 0
    near: int = 0  # positions that missed their interval (within slack)
    worst_miss: float = 0.0  # the largest distance from a seeded point to its token's interval
    worst_gap: float = 0.0  # the largest |p_stated - p_trainer| of a checked token


@dataclass
class Verified:
    """A batch that passed every check: scored by the trainer's verifiers, as Samples."""

    key: str
    worker: str
    version: int
    samples: Samples
    behaviour_logp: list[list[float]]
    rows: list[str]  # row hashes
    check: "SeedCheck"


def check_structure(batch: Batch, max_new_tokens: int, eos: int, vocab: int) -> None:
    """Every completion: not empty, EOS only as its last token, cut without EOS only at
    max_new_tokens, ids in the vocabulary, finite behaviour log-probs <= 0."""
    for r, c in enumerate(batch.completion_ids):
        if not 0 < len(c) <= max_new_tokens:
            raise Rejected(f"row {r}: {len(c)} tokens, not 1 to max_new_tokens {max_new_tokens}")
        if eos in c[:-1]:
            raise Rejected(f"row {r} goes on after EOS: a sampler stops there")
        if c[-1] != eos and len(c) != max_new_tokens:
            raise Rejected(f"row {r} ends after {len(c)} tokens without EOS: a sampler stops only at EOS or max_new_tokens {max_new_tokens} (cut short)")
        if min(c) < 0 or max(c) >= vocab:
            raise Rejected(f"row {r}: token ids outside the vocabulary of {vocab}")
        logp = batch.behaviour_logp_NC[r, : len(c)]
        if not bool(torch.isfinite(logp).all()) or bool((logp > 1e-4).any()):
            raise Rejected(f"row {r}: behaviour log-probs are not finite, or above 0")


def check_episode_structure(batch: Batch, max_new_tokens: int, vocab: int) -> None:
    """Every episode: 1 to max_new_tokens tokens, ids in the vocabulary, finite behaviour log-probs
    <= 0 on the model's tokens and 0 on the environment's (the replay checks the rest)."""
    for r, (c, mask) in enumerate(zip(batch.completion_ids, batch.model_masks or [])):
        if not 0 < len(c) <= max_new_tokens or not any(mask):
            raise Rejected(f"row {r}: {len(c)} tokens ({sum(mask)} the model's), not 1 to max_new_tokens {max_new_tokens} with a model turn")
        if min(c) < 0 or max(c) >= vocab:
            raise Rejected(f"row {r}: token ids outside the vocabulary of {vocab}")
        logp, model = batch.behaviour_logp_NC[r, : len(c)], torch.tensor(mask, dtype=torch.bool)
        if not bool(torch.isfinite(logp).all()) or bool((logp > 1e-4).any()) or bool((logp[~model] != 0).any()):
            raise Rejected(f"row {r}: behaviour log-probs are not finite, above 0, or not 0 on the environment's tokens")


def position_misses(model: torch.nn.Module, records: list[dict[str, Any]], completions: list[list[int]], uniforms_NC: torch.Tensor, behaviour_NC: torch.Tensor,
                    temperature: float, top_p: float, pad_id: int, model_masks: list[list[int]] | None = None,
                    share_prompts: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per completion, one teacher-forced pass: at each of the model's positions (all, or those
    `model_masks` marks), how far (in probability mass) the seeded point u x total lies from the
    stated token's CDF interval (0 inside), whether it lies inside, and |p_stated - p_model| of the
    token's behaviour probability. With `share_prompts`, rows of one group in a chunk run their
    prompt once (grpo.shared_prompt_logits: 15 rows of 16 groups hold about 11 prompts)."""
    ids, attention, p, _ = pack(records, completions, 1, pad_id, torch.device("cpu"))
    vocab = int(model.config.vocab_size)
    per = max(1, POSITIONS_PER_CHUNK // max(1, vocab * ids.shape[1]))
    with torch.inference_mode():
        for start in range(0, len(completions), per):
            logits_KCV = completion_logits(model, ids[start : start + per].to(device_of(model)), attention[start : start + per].to(device_of(model)), p, share_prompts).cpu()
            for j, r in enumerate(range(start, min(start + per, len(completions)))):
                length = len(completions[r])
                token_C = torch.tensor(completions[r])
                cdf_CV = sampling_cdf(logits_KCV[j, :length], temperature, top_p)
                total_C = cdf_CV[:, -1]
                x_C = uniforms_NC[r, :length] * total_C  # where the sampler's search landed
                hi_C = cdf_CV.gather(1, token_C[:, None]).squeeze(1)
                lo_C = torch.where(token_C > 0, cdf_CV.gather(1, (token_C - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(hi_C))
                inside_C = (x_C >= lo_C) & (x_C < hi_C)
                miss_C = ((lo_C - x_C).clamp(min=0) + (x_C - hi_C).clamp(min=0)) / total_C
                miss_C = torch.where(hi_C > lo_C, miss_C, torch.ones_like(miss_C))  # a token outside the nucleus (probability 0) is never drawn
                mine_C = torch.log_softmax(logits_KCV[j, :length] / temperature, -1).gather(1, token_C[:, None]).squeeze(1)
                gap_C = (mine_C.exp() - behaviour_NC[r, :length].exp()).abs()
                if model_masks is not None:  # the environment's tokens were not drawn from the policy
                    model_C = torch.tensor(model_masks[r], dtype=torch.bool)
                    miss_C, inside_C, gap_C = miss_C[model_C], inside_C[model_C], gap_C[model_C]
                yield miss_C, inside_C, gap_C


class BatchVerifier:
    """The checks of one path's trainer: its run, prompts, verifiers and settings, and one model
    per (policy version, dtype) to recompute what workers sampled."""

    def __init__(self, run: Run, path: str, dataset: str, run_id: str, cfg: Any, records: list[dict[str, Any]], rewards: list[Any], tokenizer: Any,
                 make_model: Callable[[], torch.nn.Module], device: torch.device | str = "cpu", episodes: Any = None,
                 mixture: Any = None):
        self.device = torch.device(device)
        self.mixture = mixture  # this trainer's ratio (mixture.Mixture); a batch's seed draws in its version's (mixture_of)
        self._mixtures: dict[str, Any] = {}
        self.episodes = episodes  # the dataset's multi-turn environment (an EpisodeSampler), to replay episodes with
        self.run, self.path, self.dataset, self.run_id, self.cfg = run, path, dataset, run_id, cfg
        self.records, self.rewards, self.tokenizer, self.make_model = records, rewards, tokenizer, make_model
        self.rows = rows_to_verify(cfg.batch_size * cfg.group_size, cfg.verify_forged_share, cfg.verify_goal, cfg.verify_rows)
        self.detect = detection_probability(cfg.batch_size * cfg.group_size, self.rows, cfg.verify_forged_share)
        self.secret = random.SystemRandom()  # which rows are checked: nothing in the bucket predicts it
        self._weights: torch.nn.Module | None = None
        self._reader: PolicyReader | None = None
        self._model: tuple[int, str, torch.nn.Module] | None = None
        self._own: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}  # version -> (sha256, tensors) this trainer published
        self.vocab = 0

    def describe(self) -> str:
        n = self.cfg.batch_size * self.cfg.group_size
        return (f"seed-checking {self.rows} of {n} rows per batch, picked in secret: a batch with {self.cfg.verify_forged_share:.0%} forged rows "
                f"is rejected with probability {self.detect:.4f}")

    def remember(self, record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """A copy of the tensors a version this trainer has just published stands for (its own
        memory, trusted as the trainer is): checking that version's batches then loads them from
        here instead of reading its file (and, for a delta, its snapshot's) back from the store and
        hashing it twice (at 150M parameters, 600 MB a step). The newest max_async + 1 versions,
        when they fit in OWN_VERSIONS_BYTES; none (and no copy made) when they do not."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size * (self.cfg.max_async + 1) > OWN_VERSIONS_BYTES:
            return
        self._own[int(record["version"])] = (str(record["sha256"]), {k: v.detach().clone() for k, v in tensors.items()})
        for v in sorted(self._own)[: -(self.cfg.max_async + 1)]:
            del self._own[v]

    def model(self, version: int, dtype: str, record: dict[str, Any] | None = None) -> torch.nn.Module:
        """Policy version `version` as a `dtype` sampler computes (one kept at a time): from this
        trainer's memory when it published that version (`record` names the same sha256), else
        read from the store and checked against its sha256."""
        if self._model is None or self._model[:2] != (version, dtype):
            if self._weights is None:
                with torch.random.fork_rng(devices=[]):  # checking a batch never moves the trainer's random state
                    self._weights = self.make_model().eval().to(self.device)
                self.vocab = int(self._weights.config.vocab_size)
                self._reader = PolicyReader(self.run, self.path, self._weights)
            own = self._own.get(version)
            if own is not None and record is not None and own[0] == record.get("sha256"):
                self._reader.hold(record, own[1])
            else:
                try:
                    self._reader.load(version)
                except Exception:
                    raise Rejected(f"policy version {version} cannot be loaded (pruned meanwhile): it cannot be checked", attributable=False) from None
            self._model = (version, dtype, copy_as(self._weights, dtype))
        return self._model[2]

    def verify(self, batch: Batch, version_record: dict[str, Any], seen_rows: Callable[[str], bool]) -> Verified:
        """Every check against the trainer's own data, verifiers and policy; Rejected on the first failure."""
        try:
            return self._verify(batch, version_record, seen_rows)
        except (TypeError, ValueError, IndexError, KeyError) as exc:  # signed fields well typed yet absurd: the signer's doing
            raise Rejected(f"metadata the checks cannot use ({type(exc).__name__}: {str(exc)[:80]})") from None

    def mixture_of(self, version_record: dict[str, Any]) -> Any:
        """The mixture the trainer published with a policy version (what its workers drew prompts in),
        so a trainer resumed with another --set mixture still checks older versions' batches rightly."""
        text = version_record.get("mixture", "")
        if self.mixture is not None and text == self.mixture.text:
            return self.mixture
        if not text:
            return None
        if text not in self._mixtures:
            from paths.work.mixture import Mixture

            self._mixtures[text] = Mixture(self.records, text, f"dataset {self.dataset!r} for path {self.path}")
        return self._mixtures[text]

    def _verify(self, batch: Batch, version_record: dict[str, Any], seen_rows: Callable[[str], bool]) -> Verified:
        cfg, meta, tok = self.cfg, batch.meta, self.tokenizer
        accepted = cfg.rollout_dtypes.split(",")
        if meta["dtype"] not in DTYPES or meta["dtype"] not in accepted:
            raise Rejected(f"sampled in {meta['dtype']!r}; this trainer takes {cfg.rollout_dtypes} (rollout_dtypes)")
        settings = (int(meta["group_size"]), float(meta["temperature"]), float(meta["top_p"]), int(meta["max_new_tokens"]))
        if settings != (cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens):
            raise Rejected(f"sampled with group_size, temperature, top_p, max_new_tokens {settings}; the trainer uses {(cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens)}")
        n = len(batch.completion_ids)
        if n != cfg.batch_size * cfg.group_size:
            raise Rejected(f"{n} completions; batch_size {cfg.batch_size} x group_size {cfg.group_size} should be {cfg.batch_size * cfg.group_size}")
        seed = batch_seed(version_record["nonce"], batch.worker, meta["key"], batch.position)
        picked = pick_prompts(seed, cfg.batch_size, len(self.records), self.mixture_of(version_record))
        if meta["prompt_index"] != picked:
            raise Rejected(f"prompts {str(meta['prompt_index'])[:60]} are not the ones its seed draws ({str(picked)[:60]}): chosen prompts")
        records = [self.records[i] for i in picked]
        if meta["prompt_sha256"] != [prompt_sha(r) for r in records]:
            raise Rejected("prompts differ from the path's own prompts (another shard?)")
        self.model(batch.version, meta["dtype"], version_record)  # loads the version: the vocabulary is known from here on
        if (batch.model_masks is not None) != (self.episodes is not None):
            raise Rejected("episodes (with a model_mask) in a batch of single completions, or the other way round: not this dataset's rollouts")
        if self.episodes is None:
            check_structure(batch, cfg.max_new_tokens, tok.eos_token_id, self.vocab)
        else:
            check_episode_structure(batch, cfg.max_new_tokens, self.vocab)
        group = cfg.group_size
        hashes = [row_hash(records[r // group]["ids"], c, seed, r) for r, c in enumerate(batch.completion_ids)]
        if any(seen_rows(h) for h in hashes) or len(set(hashes)) != n:
            raise Rejected("holds rows the trainer has already taken (replay)")
        if self.episodes is not None:
            samples = self._replay(batch, records)
        else:
            truncated = [c[-1] != tok.eos_token_id for c in batch.completion_ids]
            samples = score_samples(records, batch.completion_ids, truncated, self.rewards, cfg, tok)  # the stated rewards are never used
        stated = meta["rewards"]
        if not isinstance(stated, list) or len(stated) != n or any(not isinstance(s, (int, float)) or abs(float(s) - v) > 1e-6 for s, v in zip(stated, samples.rewards)):
            raise Rejected("stated rewards differ from what the trainer's verifiers give the completions (forged)")
        check = self.check_seeds(batch, records, seed, sorted(self.secret.sample(range(n), self.rows)))
        lengths = [len(c) for c in batch.completion_ids]
        return Verified(batch.key, batch.worker, batch.version, samples, [batch.behaviour_logp_NC[i, :l].tolist() for i, l in enumerate(lengths)], hashes, check)

    def _replay(self, batch: Batch, records: list[dict[str, Any]]) -> Samples:
        """The batch's episodes replayed and scored by the trainer (Rejected when they come out otherwise)."""
        from paths.work.episodes import Diverged

        meta, episodes = batch.meta, self.episodes
        want = "replayed" if episodes.deterministic else "recorded"
        if meta.get("environment") != want:
            raise Rejected(f"environment {meta.get('environment')!r}: this trainer's {episodes.spec.text} is {'' if episodes.deterministic else 'not '}deterministic, "
                           f"so its batches say {want!r}")
        played = meta.get("environment_messages") if want == "recorded" else None
        if want == "recorded" and not (isinstance(played, list) and len(played) == len(batch.completion_ids) and all(isinstance(p, list) for p in played)):
            raise Rejected("environment_messages: want one list of the environment's answers per row")
        try:
            return episodes.replay(records, self.rewards, self.tokenizer, self.cfg.group_size, self.cfg.max_new_tokens, batch.completion_ids, batch.model_masks, played)
        except Diverged as exc:
            raise Rejected(f"{exc}: not what its model turns and the environment give") from None
        except DataError as exc:  # the environment or its rubric failed on the batch's turns: they would have on the worker too
            raise Rejected(f"its episodes cannot be replayed ({exc})") from None

    def check_seeds(self, batch: Batch, records: list[dict[str, Any]], seed: bytes, rows: list[int], tol: Tolerance | None = None) -> SeedCheck:
        """The seed check of `rows` (Rejected beyond the dtype's tolerance, or `tol`)."""
        cfg, version, dtype = self.cfg, batch.version, batch.meta["dtype"]
        tol = tol or TOLERANCES[dtype]
        seen = SeedCheck(rows=len(rows))
        masks = None if batch.model_masks is None else [batch.model_masks[r] for r in rows]
        found = position_misses(self.model(version, dtype), [records[r // cfg.group_size] for r in rows], [batch.completion_ids[r] for r in rows], row_uniforms(seed, rows, cfg.max_new_tokens),
                                batch.behaviour_logp_NC[rows], cfg.temperature, cfg.top_p, self.tokenizer.pad_token_id, masks,
                                cfg.share_prompts and dtype != "bf16")  # a bf16 worker's log-probs are a pass of one row per prompt: its rounding is repeated
        for r, (miss_C, inside_C, gap_C) in zip(rows, found):
            if not bool(torch.isfinite(miss_C).all() and torch.isfinite(gap_C).all()):
                raise Rejected(f"policy version {version} gives non-finite probabilities on row {r}: it cannot be checked", attributable=False)
            t = int(miss_C.argmax())
            if float(miss_C[t]) > tol.slack:
                raise Rejected(f"row {r} token {t} is not what its seed draws from policy version {version} ({dtype}): {float(miss_C[t]):.3g} of probability "
                               f"away (tolerance {tol.slack}): a moved, edited, chosen or made-up completion")
            seen.near += int((~inside_C).sum())
            seen.positions += len(miss_C)
            seen.worst_miss = max(seen.worst_miss, float(miss_C[t]))
            t = int(gap_C.argmax())
            seen.worst_gap = max(seen.worst_gap, float(gap_C[t]))
            if float(gap_C[t]) > tol.prob:
                raise Rejected(f"behaviour probability of row {r} token {t} differs from policy version {version}'s ({dtype}) by {float(gap_C[t]):.4f} "
                               f"(tolerance {tol.prob}): made up")
        if seen.near > max(1, tol.near_share * seen.positions):
            raise Rejected(f"{seen.near} of {seen.positions} checked tokens miss their seeded draw (at most {tol.near_share:.0%} may, each by <= {tol.slack}): "
                           "sampled from another model, or chosen")
        return seen
