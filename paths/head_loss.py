"""The next-token loss through the output head a chunk of rows at a time (as Liger's and torchtune's
fused linear cross-entropy): logits are never held whole, and the head's gradients are made while
each chunk's logits are in cache.

The whole (B*L, V) logits tensor, its log-softmax and their gradients are 4 passes over
B*L*V floats (32 MiB each for 8 x 256 tokens of a 4,096-token vocabulary; 3 GiB for 8 x 2,048 of a
50k one). A chunk of `CHUNK` rows computes its logits, its share of the loss, and at once the
gradient of the hidden states and of the head's weight, then drops its logits: the same three
matmuls as autograd's route, about 4% of a CPU step less, and a peak memory without the logits.

`fusable(model)` says when the model may be split into its decoder and its head: a plain
transformers causal LM of a family whose logits are `lm_head(final hidden state)` and nothing
more, not wrapped (DDP, PEFT, FSDP, accelerate's autocast): a wrapper's forward does work of its own
(gradient sync, adapters, gathering shards, casting) that going around it would skip. Other models
take the whole-logits route in paths/steps.py.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 1024  # rows a chunk: 16 MiB of fp32 logits at V = 4,096; 1,024 and 512 timed alike on a CPU

# families whose causal LM's logits are the head applied to the decoder's last hidden state,
# with no softcapping (gemma2/3), logit scale (cohere) or logits scaling (granite)
PLAIN_HEADS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo", "olmo2", "olmoe", "flex_olmo",
    "deepseek_v3", "glm4_moe", "gpt_oss",
})


def fusable(model: torch.nn.Module) -> bool:
    """Whether `model` is a bare causal LM whose logits are `lm_head(decoder(x))` (see above)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or getattr(model.config, "model_type", None) not in PLAIN_HEADS:
        return False
    if hasattr(model, "_original_forward") or sharded(model):  # accelerate's autocast wrapper; FSDP2
        return False
    head = model.get_output_embeddings()
    return isinstance(head, torch.nn.Linear) and head.bias is None


def sharded(model: torch.nn.Module) -> bool:
    """FSDP2 shards the root with its layers (paths/fsdp.py), as fully_shard's users do."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def head_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * summed next-token loss of targets `y` (B, L; -100 ignored) after inputs `x` (B, L),
    through `model`'s decoder and then its head a chunk at a time. `model` must be `fusable`."""
    hidden = model.get_decoder()(input_ids=x)[0]  # (B, L, H)
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), model.get_output_embeddings().weight, y.reshape(-1).to(hidden.device), scale, torch.is_grad_enabled())


class LinearCrossEntropy(torch.autograd.Function):
    """scale * sum over rows of cross_entropy(h @ w.T, y), -100 ignored; gradients made in forward
    (none under no_grad / inference_mode)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: float, grad: bool) -> torch.Tensor:  # h (N, H), w (V, H), y (N,)
        want_h, want_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]  # `grad`: the caller's grad mode (needs_input_grad ignores it)
        ctx.w_dtype = w.dtype
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(w, dtype=torch.float32) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], CHUNK):
            h_c, y_c = h[s : s + CHUNK], y[s : s + CHUNK]
            logits = (h_c @ w.t()).float()  # (n, V)
            keep = y_c != -100
            picked = y_c.clamp(min=0).unsqueeze(1)  # (n, 1)
            target = logits.gather(1, picked).squeeze(1)
            top = logits.amax(dim=-1)  # (n,)
            p = logits.sub_(top.unsqueeze(1)).exp_()  # unnormalised softmax, in place of the logits: one pass (torch.logsumexp makes its own)
            norm = p.sum(dim=-1)
            total += ((norm.log() + top - target) * keep).sum()
            if not (want_h or want_w):
                continue
            weight = keep.float() * scale
            p.mul_((weight / norm).unsqueeze(1))  # scale * softmax
            p.scatter_add_(1, picked, -weight.unsqueeze(1))  # d(loss)/d(logits): scale * (softmax - onehot)
            p = p.to(h.dtype)
            if want_h:
                grad_h[s : s + CHUNK] = p @ w
            if want_w:
                grad_w.addmm_(p.t().float(), h_c.float())
        ctx.save_for_backward(grad_h, grad_w)
        return total * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * g.to(grad_h.dtype) if grad_h is not None else None,
            (grad_w * g).to(ctx.w_dtype) if grad_w is not None else None,
            None,
            None,
            None,
        )
