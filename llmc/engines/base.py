"""What every engine class shares: `measure` as score-then-throughput, and closing (also as a context manager).
The contract itself is llmc.engines.registry.Engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class EngineBase:
    name: str
    # after scoring a model as a reference: whether its output head reproduced its logits, so that artifacts get
    # the exact KL (llmc.engines.agreement); None where the engine records no head
    output_head: dict | None = None

    def measure(self, windows: torch.Tensor, prompt: torch.Tensor, *, decode_tokens: int, repeats: int,
                batch_size: int = 4, reference: dict[str, torch.Tensor] | None = None, top_k: int = 256,
                throughput_batch_sizes: Sequence[int] = (1,)) -> tuple[dict[str, torch.Tensor], dict]:
        """(scores, throughput), the call the build makes."""
        scores = self.score(windows, batch_size=batch_size, reference=reference, top_k=top_k)
        return scores, self.throughput(prompt, decode_tokens=decode_tokens, repeats=repeats,
                                       batch_sizes=throughput_batch_sizes)

    def close(self) -> None:
        """Release what the engine holds (nothing by default: the model goes with the object)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
