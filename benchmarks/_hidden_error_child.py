"""Quality of quantized checkpoints for benchmarks/gpu_calibration.py, by one function for every tool: the relative
error of the final hidden state (after the final norm) on held-out tokens, against the unquantized model.

    python benchmarks/_hidden_error_child.py MODEL_DIR HELDOUT.safetensors NAME=FOLDER [NAME=FOLDER ...]

Each FOLDER is a compressed-tensors checkpoint (llmc's export or llm-compressor's save), loaded by llmc's torch
reference engine (weights dequantized, the artifact's activation quantization applied to every Linear's input) in
float32 on the host. Error = ||h_q - h||_F / ||h||_F over all held-out tokens. Prints one JSON line per folder as it
is scored (a time limit then keeps those already printed).
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

    @torch.no_grad()
    def final_hidden(folder: Path) -> torch.Tensor:
        model = TorchEngine(folder, streamed=False).model
        return torch.cat([model.model(input_ids=b).last_hidden_state.float() for b in heldout.split(2)])

    reference = final_hidden(model_dir)
    for item in sys.argv[3:]:
        name, folder = item.split("=", 1)
        t = time.monotonic()
        error = float((final_hidden(Path(folder)) - reference).norm() / reference.norm())
        print(json.dumps({"name": name, "hidden_rel_error": error, "score_s": time.monotonic() - t}), flush=True)


if __name__ == "__main__":
    main()
