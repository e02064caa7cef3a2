"""calc_tools, saying it is not deterministic (as an environment that calls a live service would):
its answers are recorded in rollout batches and played back by the trainer. Loaded as
verifiers:tests.paths.envs.recorded_env:n=...,eval_n=..."""

from __future__ import annotations

import calc_tools


def load_environment(**kwargs):
    env = calc_tools.load_environment(**kwargs)
    env.deterministic = False
    return env
