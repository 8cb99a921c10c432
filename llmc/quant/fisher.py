"""The loss gradient at each decoder layer's output, for quantization.search's `fisher` damage proxy, computed one
resident layer at a time.

The loss is the summed log-likelihood of tokens drawn from the unquantized model's own next-token distribution
(seeded), so E[g g^T] is the Fisher information of that distribution, whose quadratic form is the second-order KL
divergence a change of a layer's output makes: KL ~= 1/2 dy^T F dy, estimated with its diagonal,
1/2 sum g^2 dy^2 (`llmc.quant.search.layer_damages`). ModelOpt's AutoQuantize scores with the same product, with
the data's own next tokens as labels.

The gradient at the last layer's output comes from the final norm and the output head (`head_gradients`); each
earlier layer's from the next one's by a backward through that layer alone (`layer_backward`), on its kept inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from llmc.errors import RecipeError
from llmc.model.skeleton import layer_output
from llmc.planning.machine import forward_seconds

DRAW_SEED = 0  # the drawn tokens' seed: the same calibration windows give the same gradients
# float32 [positions, vocab] tensors the head's backward holds at once (logits, log-probs, their CDF, gradients): the
# positions of one batch go through the head in chunks that keep them under this (a 262k vocabulary's batch of
# 4 x 512 positions would need ~10 GB)
HEAD_CHUNK_BYTES = 1 << 30


def final_norm(model: nn.Module, layers_prefix: str) -> nn.Module:
    """The norm the model applies to the last decoder layer's output before its head (`<layers' parent>.norm`)."""
    parent = model.get_submodule(layers_prefix.rpartition(".")[0]) if "." in layers_prefix else model
    norm = getattr(parent, "norm", None)
    if not isinstance(norm, nn.Module):
        raise RecipeError(f"quantization.search's fisher proxy found no final norm beside {layers_prefix} in "
                          f"{type(model).__name__}", fix="use `proxy: output` for this model")
    return norm


def head_gradients(norm: nn.Module, head: nn.Module, hidden: Sequence[torch.Tensor], device: torch.device,
                   softcap: float | None = None) -> list[torch.Tensor]:
    """Per batch of the last decoder layer's outputs `hidden`: the gradient there of the summed log-likelihood of
    one token drawn per position from the model's next-token distribution (a masked calibration's batches are its
    unpadded samples: every position counts). Each gradient is stored where its batch is (host or device)."""
    draws = torch.Generator().manual_seed(DRAW_SEED)  # on the host: the same draws on every device
    vocab = _out_features(head)
    rows = head_chunk_rows(vocab) if vocab else None
    grads = []
    for h in hidden:
        # each position's gradient depends on that position alone (norm and head act per token), so chunks of
        # positions give the whole batch's gradient; the uniforms are drawn for the batch at once, in its order
        u = torch.rand(h.shape[:-1], generator=draws, dtype=torch.float64).reshape(-1)
        flat = h.reshape(-1, h.shape[-1])
        step = rows or flat.shape[0]
        parts = []
        for start in range(0, flat.shape[0], step):
            x = flat[start : start + step].to(device).detach().requires_grad_(True)
            with torch.enable_grad():
                logits = head(norm(x)).float()
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                logp = torch.log_softmax(logits, -1)
                drawn = _inverse_transform(logp.detach(), u[start : start + step])
                picked = logp.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
                (g,) = torch.autograd.grad(picked.sum(), x)
            parts.append(g.detach().to(h.device))
        grads.append(torch.cat(parts).reshape(h.shape))
    return grads


def _out_features(head: nn.Module) -> int | None:
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


# [positions, vocab] float32 tensors `head_gradients` holds at once for one chunk, counted from its code: the logits,
# their log-softmax, the draw's probabilities and their cumulative sum, and in the backward the log-likelihood's
# gradient and the log-softmax's (each gradient a tensor of the logits' size)
HEAD_LOGIT_COPIES = 4


def head_chunk_rows(vocab: int) -> int:
    """Positions one chunk of `head_gradients` takes through the head (HEAD_CHUNK_BYTES)."""
    return max(1, HEAD_CHUNK_BYTES // (HEAD_LOGIT_COPIES * 4 * vocab))


def head_cost(hidden: int, vocab: int, *, tokens: int, batch_tokens: int, compute: str,
              device: str = "cpu") -> tuple[float, float]:
    """(seconds, peak bytes) of `head_gradients` over `tokens` calibration tokens: the output head's GEMM forward and
    its backward to the input (the head's weight needs no gradient), at the compute dtype's probed matmul rate; the
    peak is one chunk's logits-sized float32 tensors (HEAD_LOGIT_COPIES)."""
    seconds = forward_seconds(2 * 2 * tokens * hidden * vocab, 0, compute=compute, device=device, width=hidden,
                              rows=batch_tokens)
    return seconds, HEAD_LOGIT_COPIES * min(batch_tokens, head_chunk_rows(vocab)) * vocab * 4


def draw_tokens(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per position from exp(logp), by inverse transform of host-drawn uniforms (no device generator)."""
    return _inverse_transform(logp, torch.rand(logp.shape[:-1], generator=generator, dtype=torch.float64))


def _inverse_transform(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at each position whose CDF first reaches its uniform `u` (float64, drawn on the host)."""
    cdf = logp.exp().cumsum(-1)
    u = (u.to(logp.device) * cdf[..., -1].double()).to(cdf.dtype).unsqueeze(-1)
    return torch.searchsorted(cdf, u).squeeze(-1).clamp_max(logp.shape[-1] - 1)


def layer_backward(layer: nn.Module, inputs: Sequence[torch.Tensor], extras: Sequence, grads: Sequence[torch.Tensor],
                   device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per batch: the layer's output on its `inputs` (with `extras`, its call arguments) and the gradient at those
    inputs, the loss gradient `grads` at its output carried back through the layer; each stored where its input
    batch is."""
    outputs, back = [], []
    for x, (args, kwargs), g in zip(inputs, extras, grads):
        xin = x.to(device).detach().requires_grad_(True)
        with torch.enable_grad():
            y = layer_output(layer(xin, *args, **kwargs))
            (gx,) = torch.autograd.grad(y, xin, g.to(device=y.device, dtype=y.dtype))
        outputs.append(y.detach().to(x.device))
        back.append(gx.detach().to(x.device))
    return outputs, back
