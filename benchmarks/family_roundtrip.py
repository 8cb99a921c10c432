"""The per-family table of docs/models.md: for each dense family (tiny random model from transformers' config
classes, tests/unit/families.py) and scheme, the max |logits| difference between the compressed-tensors export
reloaded in transformers and the fake-quantized reference, beside the quantization's own effect; the same
computation tests/unit/test_families.py asserts on.

    PYTHONPATH=. python benchmarks/family_roundtrip.py [family ...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.unit.families import FAMILIES, make_tiny
from tests.unit.test_families import SCHEMES, roundtrip


def main(families: list[str]) -> None:
    print("| family | scheme | quantized Linears | reload max-abs-diff | quantization effect (max-abs) |")
    print("|---|---|---|---|---|")
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_tiny(family, Path(tmp) / "model")
            for name, scheme in SCHEMES.items():
                work = Path(tmp) / name
                diff, effect, n = roundtrip(folder, scheme, work)
                print(f"| {family} | {name} | {n} | {diff:.1e} | {effect:.3f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FAMILIES))
