"""Training settings: a dataclass that validates itself, read from TOML and `--set key=value`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from paths.errors import ConfigurationError
from paths.tracking import check_tracker

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "train")
DEFAULT = os.path.join(CONFIGS, "default.toml")
PRESETS = {"grpo": os.path.join(CONFIGS, "grpo.toml")}  # what a mode starts from, over the defaults


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """What `paths train` does; configs/train/default.toml documents each key."""

    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    steps: int = 100
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    checkpoint_minutes: float = 30.0
    keep_checkpoints: int = 2
    num_workers: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    freeze: Literal["none", "shared"] = "none"
    # adapters (paths/adapters.py): lora_rank 0 trains every parameter
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: str = ""
    quantize_base: Literal["fp32", "int8", "nf4"] = "fp32"
    fsdp: bool = False  # shard the path over the processes (FSDP2): parameters, gradients and AdamW moments 1/N each
    round_wait: float = 300.0  # DiLoCo rounds (`paths diloco`): seconds a worker waits for a round's outer step while other workers hold its last paths
    # --mode grpo
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    loss: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    iterations: int = 1
    generation_batch_size: int = 0
    share_prompts: bool = True
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    overlong: Literal["none", "mask", "soft"] = "none"
    overlong_buffer: int = 0
    eval_every: int = 0
    eval_prompts: int = 64
    mixture: str = ""
    # --mode grpo --rollouts store: asynchronous RL through the bucket (paths/work/rollouts/)
    rollouts: str = "local"
    max_async: int = 2
    mismatch: str = "icepop"
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0
    mismatch_delta: float = 0.3
    rollout_wait: float = 60.0
    verify_rows: int = 0
    verify_goal: float = 0.99
    verify_forged_share: float = 0.25
    rollout_reads: int = 0
    rollout_dtypes: str = "fp32,bf16"
    max_rejections: int = 3
    policy_snapshot_every: int = 16
    external: int = 0
    # experiment tracking (paths/tracking.py): a copy of the metrics for TensorBoard, W&B or MLflow
    report_to: str = "none"
    logging_dir: str = "tracking"

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be > 0, got {getattr(self, name)} (--set {name}=N or --{name.replace('_', '-')} N)")
        for name in ("warmup_steps", "checkpoint_every", "num_workers", "weight_decay", "max_grad_norm", "min_lr_ratio", "round_wait"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise ConfigurationError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.group_size < 2:
            raise ConfigurationError(f"--group-size must be >= 2 (advantages compare completions of one prompt), got {self.group_size}")
        for name in ("max_new_tokens", "iterations"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigurationError(f"temperature must be > 0 and top_p in (0, 1], got {self.temperature} and {self.top_p}")
        if self.loss not in ("grpo", "bnpo", "dr_grpo", "dapo") or self.scale_rewards not in ("group", "batch", "none"):
            raise ConfigurationError(f"loss must be grpo, bnpo, dr_grpo or dapo and scale_rewards group, batch or none; got {self.loss!r}, {self.scale_rewards!r}")
        if self.overlong not in ("none", "mask", "soft"):
            raise ConfigurationError(f"overlong must be none, mask (cut completions leave the loss) or soft (DAPO's length penalty), got {self.overlong!r}")
        if self.overlong == "soft" and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ConfigurationError(f"overlong = soft needs 0 < overlong_buffer <= max_new_tokens ({self.max_new_tokens}), got {self.overlong_buffer}: e.g. --set overlong_buffer={max(1, self.max_new_tokens // 4)}")
        for name in ("generation_batch_size", "eval_every", "eval_prompts"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_sampling_rounds < 1:
            raise ConfigurationError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        rollout = self.grad_accum * self.batch_size * self.group_size
        if self.generation_batch_size and rollout % self.generation_batch_size:
            raise ConfigurationError(f"generation_batch_size {self.generation_batch_size} does not divide the rollout of {rollout} completions (grad_accum x batch_size x group_size): pick a divisor, e.g. {self.batch_size * self.group_size}")
        if self.freeze not in ("none", "shared"):
            raise ConfigurationError(f"freeze must be none or shared (--freeze shared trains only the path's experts), got {self.freeze!r}")
        check_tracker(self.report_to)
        if self.rollouts not in ("local", "store"):
            raise ConfigurationError(f"rollouts must be local (sample here) or store (rollout batches from `paths rollout` workers), got {self.rollouts!r}")
        if self.max_async < 0:
            raise ConfigurationError(f"--max-async must be >= 0 (how many policy versions a rollout batch may lag), got {self.max_async}")
        if self.mismatch not in ("icepop", "ipo", "none"):
            raise ConfigurationError(f"mismatch must be icepop, ipo or none, got {self.mismatch!r}")
        if not 0 < self.mismatch_low <= 1 <= self.mismatch_high or self.mismatch_delta <= 0:
            raise ConfigurationError(f"need 0 < mismatch_low <= 1 <= mismatch_high and mismatch_delta > 0, got {self.mismatch_low}, {self.mismatch_high}, {self.mismatch_delta}")
        for name in ("rollout_wait", "verify_rows", "rollout_reads"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.verify_goal < 1 or not 0 < self.verify_forged_share <= 1:
            raise ConfigurationError(f"need 0 < verify_goal < 1 and 0 < verify_forged_share <= 1, got {self.verify_goal} and {self.verify_forged_share}")
        if self.external < 0:
            raise ConfigurationError(f"--external must be >= 0 (prompt groups taken from other paths' rollouts per step), got {self.external}")
        if self.external and self.rollouts != "store":
            raise ConfigurationError("--external J takes other paths' rollout batches from the run: use it with --rollouts store")
        if not self.rollout_dtypes or any(d not in ("fp32", "bf16", "int8") for d in self.rollout_dtypes.split(",")):
            raise ConfigurationError(f"rollout_dtypes must be a comma-separated choice of fp32, bf16, int8, got {self.rollout_dtypes!r}")
        if self.policy_snapshot_every < 0:
            raise ConfigurationError(f"policy_snapshot_every must be >= 0 (0: every policy version is full), got {self.policy_snapshot_every}")
        if self.max_rejections < 1:
            raise ConfigurationError(f"max_rejections must be >= 1, got {self.max_rejections}")
        if self.rollouts == "store" and (self.dynamic_sampling or self.iterations > 1):
            raise ConfigurationError("--rollouts store takes each batch as the workers sampled it: turn dynamic_sampling off and keep iterations = 1")
        if self.lora_rank < 0 or self.lora_alpha < 0:
            raise ConfigurationError(f"lora_rank and lora_alpha must be >= 0 (rank 0: no adapter; alpha 0: twice the rank), got {self.lora_rank} and {self.lora_alpha}")
        if self.lora_rank:
            from paths.adapters import spec_of

            spec_of(self)  # its own checks: dropout, base
        elif self.quantize_base != "fp32":
            raise ConfigurationError(f"--quantize-base {self.quantize_base} freezes the base under an adapter: add --lora RANK (e.g. --lora 16)")
        if self.fsdp and self.lora_rank:
            raise ConfigurationError("--fsdp shards a full fine-tune; an adapter fits one device: drop --fsdp or --lora")
        if self.fsdp and self.rollouts == "store":
            raise ConfigurationError("--fsdp with --rollouts store: the asynchronous trainer runs one process per path; drop --fsdp")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigurationError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens (targets) per optimizer step, per process."""
        return self.seq_len * self.batch_size * self.grad_accum

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _boolean(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _coerce(name: str, raw: Any, kind: type) -> Any:
    if isinstance(raw, str) and kind is not str:
        try:
            return {int: int, float: float, bool: _boolean}.get(kind, str)(raw)
        except ValueError:
            raise ConfigurationError(f"--set {name}={raw}: expected a {kind.__name__}") from None
    if kind is float and isinstance(raw, int):
        return float(raw)
    return raw


def load_config(config_file: str | None = None, sets: list[str] | tuple[str, ...] = (), mode: str | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the mode's preset (grpo: configs/train/grpo.toml), then the TOML file, then
    `--set key=value`, then explicit options."""
    known = {f.name: f for f in fields(TrainConfig)}
    types = {name: {"int": int, "float": float, "bool": bool}.get(str(f.type), str) for name, f in known.items()}
    values: dict[str, Any] = {}
    for path in [DEFAULT, *([PRESETS[mode]] if mode in PRESETS else []), *([config_file] if config_file else [])]:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"cannot read training config {path} ({exc}): give a TOML file like configs/train/default.toml") from None
        values.update(data)
    for item in sets:
        if "=" not in item:
            raise ConfigurationError(f"--set {item}: use key=value")
        key, raw = item.split("=", 1)
        values[key.strip()] = raw.strip()
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigurationError(f"unknown training setting {unknown[0]!r}: valid keys are {', '.join(sorted(known))}")
    cfg = TrainConfig(**{k: _coerce(k, v, types.get(k, float)) for k, v in values.items()})
    if mode is not None and mode != "grpo" and cfg.rollouts == "store":
        raise ConfigurationError(f"--rollouts store feeds --mode grpo from rollout workers; --mode {mode} trains on the dataset itself")
    return cfg
