"""`llmc inspect`: say what a path is and which runtimes accept it.

Registry entries and llmc's canonical quantized form are described here; artifacts by the format in the target
registry (`llmc.targets`) that recognises them.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmc.errors import InputError
from llmc.quant.canonical import META_FILE, QuantizedModel
from llmc.targets import recognize
from llmc.targets.base import architectures


def _gates_line(rep: dict) -> str:
    """The gates' state as the report recorded it: "all passed" only when every gate was measured."""
    from llmc.eval.gates import gates_summary

    return gates_summary(rep.get("verdicts", []))[1]


def describe(path: Path) -> str:
    path = Path(path)
    if (path / "manifest.json").is_file():
        from llmc.registry.local import verify_entry

        m = json.loads((path / "manifest.json").read_text())
        bad = verify_entry(path)
        rep = m["report"]
        lines = [
            f"registry entry {path}",
            f"  build {m['build_id']} of recipe '{m['recipe']['name']}', scheme {rep['scheme']}, llmc {m['llmc_version']}",
            f"  model {m['model']['source']} (sha256 {m['model']['sha256']})",
            f"  gates: {_gates_line(rep)}; files: {len(m['files'])}, "
            + ("all sha256 match the manifest" if not bad else f"MODIFIED/MISSING: {', '.join(bad)}"),
        ]
        for label, t in rep["targets"].items():
            lines.append(f"  artifact {label}: {t['exporter']} at artifacts/{label}")
        return "\n".join(lines)
    if (path / META_FILE).is_file():
        qm = QuantizedModel.open(path)
        s = qm.scheme
        return "\n".join([
            f"llmc canonical quantized form at {path}",
            f"  scheme {s.name} ({s.algorithm}): weights {s.weights.describe()}"
            + (f", activations {s.activations.describe()}" if s.activations else "")
            + (f", KV cache {s.kv_cache.format}" if s.kv_cache else ""),
            f"  {len(qm.quantized_modules)} quantized Linear modules in {len(qm.files()) - 1} layers; "
            f"source {qm.meta['source']['origin']} ({qm.meta['source']['sha256']})",
            "  exporters read this; runtimes do not",
        ])
    fmt = recognize(path)
    if fmt is not None:
        return fmt.describe(path)
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        q = cfg.get("quantization_config")
        arch = architectures(cfg)
        if q is None:
            return f"unquantized Hugging Face checkpoint at {path} ({arch}, dtype {cfg.get('dtype') or cfg.get('torch_dtype')})"
        return f"Hugging Face checkpoint at {path} ({arch}) quantized with {q.get('quant_method')} (not produced by llmc)"
    raise InputError(f"{path} is not an llmc artifact, quantized form or registry entry",
                     fix="pass a folder with config.json, quantized.json or manifest.json")
