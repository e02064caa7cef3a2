"""An environment's rows as prompt-dataset input, and its scorer as a reward, by spec."""

from __future__ import annotations

from typing import Any, Iterator

from paths.envs.spec import EnvSpec, parse


def env_rows(text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of the environment a spec names: its train split, then its held-out one."""
    spec = parse(text)
    spec.installed()
    if spec.kind == "reasoning-gym":
        from paths.envs import gym

        rows = gym.rows(spec)
    else:
        from paths.envs import vf_env

        rows = vf_env.rows(spec)
    for i, row in enumerate(rows):
        row["env"] = spec.label  # which environment scores it: in a mixture each scorer takes only its own rows
        yield f"{spec.text} row {i}", row


def check_env(text: str) -> None:
    """Load (or make one prompt of) the environment a spec names: a one-line error before anything is written."""
    spec = parse(text)
    spec.installed()
    if spec.kind == "reasoning-gym":
        from paths.envs import gym

        next(gym.rows(EnvSpec(spec.kind, spec.name, {**spec.args, "size": 1, "eval_size": 0})), None)
    else:
        from paths.envs.vf_env import load

        load(spec)


def env_reward(spec: EnvSpec) -> Any:
    """The function that scores completions the way the environment does: one value per completion
    of its own rows, None for rows of other sources (TRL's convention, so mixtures sum cleanly)."""
    spec.installed()
    if spec.kind == "reasoning-gym":
        from paths.envs import gym

        scorer = gym.score
    else:
        from paths.envs.vf_env import RubricReward

        scorer = RubricReward(spec)

    def reward(completions: list[str], env: list[str] | None = None, **fields: Any) -> list[float | None]:
        mine = [i for i in range(len(completions)) if env is None or env[i] == spec.label]
        out: list[float | None] = [None] * len(completions)
        if mine:
            values = scorer([completions[i] for i in mine], **{k: [v[i] for i in mine] for k, v in fields.items() if isinstance(v, list)})
            for i, v in zip(mine, values):
                out[i] = v
        return out

    reward.__name__ = spec.label
    reward.partial = True  # type: ignore[attr-defined]  # a batch without its rows gets only None: not an error
    return reward
