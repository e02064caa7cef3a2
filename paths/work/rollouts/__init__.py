"""Asynchronous RL through the bucket, with rollouts nobody has to trust.

    trainer (paths train --mode grpo --rollouts store)            rollout workers (paths rollout), any machines
      publishes policy/<path>/v<N>/ (+ a nonce) after each step  ---->  read latest.json, load v<N> (checked)
      reads admitted workers' batches within a budget,          <----  sample from seeds bound to the nonce and
      takes each worker's chain in order, checks signature,             their chain position, sign, create-only put
      seeds, rewards, rows never seen                                   rollouts/<path>/batches/<worker>/<n>

One concern per module:
    policy.py   policy versions: publish, load, prune, the publisher callback
    batch.py    the batch object: encode, sign, decode
    keys.py     worker keys and the run's allowlist (workers/allowlist.json)
    seeds.py    nonces, batch seeds, prompts and per-row numbers a batch is drawn with
    worker.py   the rollout worker
    verify.py   the trainer's checks of one batch (the seed check, how many rows, tolerances)
    source.py   the trainer's side of the store: budgets, strikes, chains, its saved position
    sapo.py     SAPO's shared experience from other paths' batches
    step.py     the asynchronous GRPO step
"""

from paths.work.rollouts.batch import Batch, Rejected, batch_key, decode, encode
from paths.work.rollouts.keys import admit, load_key, new_key, read_allowlist, revoke, set_open
from paths.work.rollouts.policy import PolicyPublisher, latest, load_version, publish, sampler, version_record
from paths.work.rollouts.source import StoreRollouts
from paths.work.rollouts.step import AsyncGRPOStep
from paths.work.rollouts.verify import TOLERANCES, detection_probability, rows_to_verify
from paths.work.rollouts.worker import rollout_worker

__all__ = [
    "AsyncGRPOStep", "Batch", "PolicyPublisher", "Rejected", "StoreRollouts", "TOLERANCES", "admit", "batch_key", "decode", "detection_probability", "encode",
    "latest", "load_key", "load_version", "new_key", "publish", "read_allowlist", "revoke", "rollout_worker", "rows_to_verify", "sampler", "set_open", "version_record",
]
