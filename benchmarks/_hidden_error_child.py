"""Quality of quantized checkpoints for benchmarks/gpu_calibration.py, by one function for every tool: the relative
error of the final hidden state (after the final norm) on held-out tokens, against the unquantized model.

    python benchmarks/_hidden_error_child.py MODEL_DIR HELDOUT.safetensors NAME=FOLDER [NAME=FOLDER ...]

Each FOLDER is a compressed-tensors checkpoint (llmc's export or llm-compressor's save), loaded by llmc's torch
reference engine (weights dequantized, the artifact's activation quantization applied to every Linear's input) in
float32 on the host (BENCH_SCORE_DEVICE: another device, e.g. the GPU the run was timed on). Error =
||h_q - h||_F / ||h||_F over all held-out tokens. Prints one JSON line per folder as it is scored (a time limit then
keeps those already printed), with the sums behind the error per block of BENCH_BLOCK_TOKENS (128) consecutive
held-out tokens (`block_err2`: sum of (h_q - h)^2, `block_ref2`: sum of h^2), from which the parent computes a paired
interval for the difference between two tools (the same blocks for both).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from llmc.engines.torch_ref import TorchEngine

    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    model_dir, heldout = Path(sys.argv[1]), load_file(sys.argv[2])["input_ids"]
    device = torch.device(os.environ.get("BENCH_SCORE_DEVICE", "cpu"))
    block = int(os.environ.get("BENCH_BLOCK_TOKENS", "128"))

    @torch.no_grad()
    def final_hidden(folder: Path) -> torch.Tensor:
        model = TorchEngine(folder, streamed=False, device=device).model
        try:
            return torch.cat([model.model(input_ids=b.to(device)).last_hidden_state.float().cpu()
                              for b in heldout.split(2)])
        finally:
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def block_sums(x: torch.Tensor) -> list[float]:
        """Sum of squares per block of `block` consecutive tokens of one held-out sequence, in order."""
        n, length = x.shape[:2]
        usable = length - length % block or length  # a sequence shorter than a block is one block
        return (x[:, :usable].double().pow(2).reshape(n, -1, min(block, usable), x.shape[-1])
                .sum(dim=(2, 3)).flatten().tolist())

    reference = final_hidden(model_dir)
    ref2 = block_sums(reference)
    for item in sys.argv[3:]:
        name, folder = item.split("=", 1)
        t = time.monotonic()
        diff = final_hidden(Path(folder)) - reference
        error = float(diff.norm() / reference.norm())
        print(json.dumps({"name": name, "hidden_rel_error": error, "score_s": time.monotonic() - t,
                          "block_tokens": block, "block_err2": block_sums(diff), "block_ref2": ref2}), flush=True)


if __name__ == "__main__":
    main()
