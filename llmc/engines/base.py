"""What every engine class shares: `measure` as score-then-throughput, and closing (also as a context manager).
The contract itself is llmc.engines.registry.Engine.

Also what every engine's cost model shares (`Scoring`, `protocol_seconds`): each engine module costs its own
scorings (`scoring_cost`, called through `EngineSpec.scoring_cost` by the evaluate stage's plan) from the machine's
probed matmul rates and its own measured start-up (docs/planner-constants.md#engine-start-up)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmc.engines.registry import Scoring
from llmc.planning.machine import forward_seconds
from llmc.planning.machine import read_seconds as disk_read_seconds

if TYPE_CHECKING:
    import torch

__all__ = ["DECODE_PREFIX", "EngineBase", "Scoring", "forward_s", "protocol_seconds", "read_seconds",
           "scores_bytes", "window_logits_bytes"]

# tokens of the short prompt every engine's throughput measurement decodes after (its `throughput`, the workers')
DECODE_PREFIX = 64


def forward_s(s: Scoring, dtype: str, tokens: float, rows: int, context: float) -> float:
    """Seconds of `tokens` through the whole model (every layer and the output head) in forwards of `rows` tokens,
    each token attending over `context` tokens, at the machine's probed `dtype` matmul rate (CPU)."""
    sh = s.shape
    gemm = 2 * tokens * (sh.layer_params * sh.active * sh.layers + sh.vocab * sh.hidden)
    attention = 2 * tokens * context * sh.attn_width * sh.layers
    return forward_seconds(gemm, attention, compute=dtype, device="cpu", width=sh.hidden, rows=rows)


def protocol_seconds(s: Scoring, dtype: str, rows: int | None = None) -> tuple[float, float]:
    """(scoring, throughput) seconds of the protocol every engine runs: each window one prefill; then `repeats` times
    a prefill of one window and, after a DECODE_PREFIX-token prefill, decode_tokens forwards of one token. `rows`: the
    probe's rows a prefill is timed at (None: the prefill's own tokens), for an engine whose time per token does not
    follow the torch probe's rows."""
    score = forward_s(s, dtype, s.tokens, rows or s.seq_len, s.seq_len / 2)  # causal: half the window on average
    per_repeat = (forward_s(s, dtype, s.seq_len, rows or s.seq_len, s.seq_len / 2)
                  + forward_s(s, dtype, DECODE_PREFIX, rows or DECODE_PREFIX, DECODE_PREFIX / 2)
                  + forward_s(s, dtype, s.decode_tokens, 1, DECODE_PREFIX + s.decode_tokens / 2))
    return score, s.repeats * per_repeat


def read_seconds(s: Scoring) -> float:
    """Reading the model's files at the disk's probed rate (llmc.planning.disk), as the torch reference's are."""
    return disk_read_seconds(s.model_bytes)


def scores_bytes(s: Scoring) -> float:
    """The per-token scores it keeps (NLL, top-k ids and log-probs) and, for an artifact, the baseline's reference
    (its top-k and output head inputs) in float32."""
    return s.tokens * (s.top_k * 8 + 16 + (s.top_k * 8 + s.shape.hidden * 4 if s.reference else 0))


def window_logits_bytes(s: Scoring, rows: int | None = None) -> float:
    """One forward's float32 logits over the vocabulary and their log-softmax / top-k temporaries."""
    return 3 * (rows or s.seq_len) * s.shape.vocab * 4


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
