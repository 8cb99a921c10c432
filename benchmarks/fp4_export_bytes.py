"""Artifact bytes of a model's NVFP4 / MXFP4 compressed-tensors exports (RTN: GPTQ and the scale search write the same
layout, so the same bytes) and of the unquantized source folder; one JSON line each. `fp4_calibration.py` deletes its
exports, so its table has no bytes column; this measures them.

    PYTHONPATH=$PWD nice -n 19 python benchmarks/fp4_export_bytes.py demo:qwen2.5-coder-0.5b nvfp4-rtn mxfp4-rtn
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp4_calibration import scheme_of  # noqa: E402

from llmc.formats.compressed_tensors import export_compressed_tensors  # noqa: E402
from llmc.model.source import resolve_source  # noqa: E402
from llmc.quant.canonical import QuantizedModel  # noqa: E402
from llmc.quant.stream import quantize_model  # noqa: E402
from llmc.storage.store import Store  # noqa: E402


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def main() -> None:
    torch.set_num_threads(1)  # beside a running measurement
    model, variants = sys.argv[1], sys.argv[2:]
    source = resolve_source(model, Store.default())
    print(json.dumps({"model": model, "variant": "unquantized source folder",
                      "safetensors_bytes": safetensors_bytes(source.folder)}), flush=True)
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="llmc-fp4bytes-") as tmp:
            t = time.monotonic()
            quantize_model(source, scheme_of(variant), Path(tmp) / "canonical", None)
            export = Path(tmp) / "export"
            export_compressed_tensors(QuantizedModel.open(Path(tmp) / "canonical"), export)
            print(json.dumps({"model": model, "variant": variant, "safetensors_bytes": safetensors_bytes(export),
                              "all_files_bytes": sum(f.stat().st_size for f in export.rglob("*") if f.is_file()),
                              "s": round(time.monotonic() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
