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
    grads = []
    for h in hidden:
        x = h.to(device).detach().requires_grad_(True)
        with torch.enable_grad():
            logits = head(norm(x)).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logp = torch.log_softmax(logits, -1)
            drawn = draw_tokens(logp.detach(), draws)
            picked = logp.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
            (g,) = torch.autograd.grad(picked.sum(), x)
        grads.append(g.detach().to(h.device))
    return grads


# [batch tokens, vocab] float32 tensors `head_gradients` holds at once for one batch, counted from its code: the logits,
# their log-softmax, the draw's probabilities and their cumulative sum, and in the backward the log-likelihood's
# gradient and the log-softmax's (each gradient a tensor of the logits' size)
HEAD_LOGIT_COPIES = 4


def head_cost(hidden: int, vocab: int, *, tokens: int, batch_tokens: int, compute: str,
              device: str = "cpu") -> tuple[float, float]:
    """(seconds, peak bytes) of `head_gradients` over `tokens` calibration tokens: the output head's GEMM forward and
    its backward to the input (the head's weight needs no gradient), at the compute dtype's probed matmul rate; the
    peak is one batch's logits-sized float32 tensors (HEAD_LOGIT_COPIES)."""
    seconds = forward_seconds(2 * 2 * tokens * hidden * vocab, 0, compute=compute, device=device, width=hidden,
                              rows=batch_tokens)
    return seconds, HEAD_LOGIT_COPIES * batch_tokens * vocab * 4


def draw_tokens(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per position from exp(logp), by inverse transform of host-drawn uniforms (no device generator)."""
    cdf = logp.exp().cumsum(-1)
    u = torch.rand(logp.shape[:-1], generator=generator, dtype=torch.float64).to(logp.device)
    u = (u * cdf[..., -1].double()).to(cdf.dtype).unsqueeze(-1)
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
