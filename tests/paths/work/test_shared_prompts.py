"""A GRPO step computes each distinct prompt once for its group (grpo.shared_prompt_logits): the
logits and gradients of one pass over every row, in every family."""

from __future__ import annotations

import pytest
import torch

from paths.base import build_model, load_spec, preset_path
from paths.work.grpo import completion_logits, shared_prompt_logits
from tests.conftest import PRESETS


def rows(vocab: int, completions: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, attention, P): prompts of 3 lengths (left-padded), each read by several rows, in an
    order that interleaves them (as a plan sorted by length does), and completions of the given
    lengths (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 9, 7)]
    which = [i % 3 for i in range(len(completions))]
    p, c = 9, max(completions)
    ids, att = torch.zeros((len(which), p + c), dtype=torch.long), torch.zeros((len(which), p + c), dtype=torch.long)
    for r, (k, n) in enumerate(zip(which, completions)):
        ids[r, p - len(prompts[k]) : p], att[r, p - len(prompts[k]) : p] = prompts[k], 1
        ids[r, p : p + n], att[r, p : p + n] = torch.randint(3, vocab, (n,), generator=g), 1
    return ids, att, p


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Equal up to float reassociation: each tensor within 1e-4 of its norm."""
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        gap, size = float((got[name] - want[name]).norm()), float(want[name].norm())
        assert gap <= 1e-4 * size + 1e-8, f"{what} {name}: gradients {gap:.3g} apart (norm {size:.3g})"


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, att: torch.Tensor, p: int, share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = shared_prompt_logits(model, ids, att, p) if share else completion_logits(model, ids, att, p)
    assert logits is not None, "no sharing"
    mask = att[:, p:].float()
    weight = torch.linspace(-1.0, 1.0, len(ids))[:, None] * mask  # advantages of both signs
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).squeeze(-1)
    (logp * weight).sum().backward()
    return (logits * mask[..., None]).detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


@pytest.mark.parametrize("preset", sorted(PRESETS.values()))
def test_sharing_prompts_gives_the_logits_and_gradients_of_every_row_computed(preset):
    model = build_model(load_spec(preset_path(preset), preset), seed=0).float().train()
    ids, att, p = rows(model.config.vocab_size, [4, 1, 6, 6, 2, 5, 3])
    shared, got = loss_and_grads(model, ids, att, p, share=True)
    plain, want = loss_and_grads(model, ids, att, p, share=False)
    torch.testing.assert_close(shared, plain, rtol=1e-4, atol=1e-4)
    assert_same_grads(got, want, preset)


def test_a_one_token_completion_width_and_rows_without_a_shared_prompt():
    model = build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), seed=0).float()
    ids, att, p = rows(model.config.vocab_size, [1, 1, 1, 1])
    with torch.no_grad():
        torch.testing.assert_close(shared_prompt_logits(model, ids, att, p), completion_logits(model, ids, att, p), rtol=1e-4, atol=1e-4)
        assert shared_prompt_logits(model, ids[:3], att[:3], p) is None  # three rows, three prompts: nothing to share


def test_where_sharing_cannot_hold_the_step_computes_every_row():
    model = build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), seed=0).float().train()
    ids, att, p = rows(model.config.vocab_size, [3, 2, 4, 4])
    plain = completion_logits(model, ids, att, p).detach()

    class Wrapped(torch.nn.Module):  # as DDP holds a model: one forward per backward
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    assert shared_prompt_logits(Wrapped(model), ids, att, p) is None
    model.activation_checkpointing_enable()  # turns the KV cache off in training
    assert shared_prompt_logits(model, ids, att, p) is None
    torch.testing.assert_close(completion_logits(model, ids, att, p, share_prompts=True).detach(), plain)


def test_a_lora_adapter_trains_the_same_through_shared_prompts():
    from paths.adapters import LoraSpec, attach

    base = build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), seed=0).float()
    model = attach(base, LoraSpec(rank=4, alpha=8.0, dropout=0.0), ["q_proj", "v_proj"])
    for name, q in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(q, std=0.02)  # a trained adapter: its gradients reach lora_A too
    ids, att, p = rows(base.config.vocab_size, [4, 2, 5, 5, 3, 1])
    _, got = loss_and_grads(model, ids, att, p, share=True)
    _, want = loss_and_grads(model, ids, att, p, share=False)
    assert all("lora_" in n for n in want)
    assert_same_grads(got, want, "lora")
