"""Peak memory per input byte of every data reader (issue 50, item 5): each case runs in a fresh child process that
turns a data source into 4 windows of 64 tokens (llmc.data.tokens.make_tokens, the test tokenizer) or renders a
chat template, and reports its peak RSS less that of a child that only imports the same modules. Results go to
benchmarks/results/input_memory.jsonl with the command, the CPU and the commit.

    python benchmarks/input_memory.py [--sizes-mib 1 8] [--repo <another llmc tree>]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, resource, sys, time
from pydantic import TypeAdapter
from llmc.data.sources import DataSource
from llmc.data.tokens import make_tokens
from llmc.data.chat import render
from llmc.data.registry import Row
from llmc.errors import LlmcError
from tests.conftest import make_tokenizer
tok = make_tokenizer()
spec = json.loads(sys.argv[1])
start = time.monotonic()
outcome = "ok"
try:
    if spec.get("template"):
        source = TypeAdapter(DataSource).validate_python({"kind": "jsonl", "path": "x.jsonl", "messages": "m",
                                                          "chat_template": spec["template"]})
        render(Row(source="x", row="0", messages=({"role": "user", "content": "hi"},)), source, tok)
    elif spec.get("source"):
        source = TypeAdapter(DataSource).validate_python(spec["source"])
        make_tokens(source, tok, "calibration", packing="windows", count=4, seq_len=64, seed=0)
except LlmcError as e:
    outcome = f"exit {e.exit_code}: {str(e).splitlines()[0][:160]}"
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "seconds": round(time.monotonic() - start, 2), "outcome": outcome}))
"""


def _child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        return {"outcome": f"child exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _english(size: int) -> str:
    words = "the jury said it did find that many of the voters had been registered in the county".split()
    rng = random.Random(0)
    out, n = [], 0
    while n < size:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


def _cases(folder: Path, size: int) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = _english(size)
    docs = [text[i:i + (64 << 10)] for i in range(0, size, 64 << 10)]  # 64 KiB documents
    (folder / "e.txt").write_text(text)
    (folder / "r.txt").write_bytes(random.Random(0).randbytes(size))
    (folder / "e.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (folder / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (folder / "e.json").write_text(json.dumps([{"text": d} for d in docs]))
    (folder / "e.csv").write_text("text\n" + "".join(f'"{d}"\n' for d in docs))
    pq.write_table(pa.table({"text": docs}), folder / "e.parquet")
    pq.write_table(pa.table({"text": ["short"] * 3 + [text]}), folder / "one.parquet")
    f = str(folder)
    return [
        ("text", {"kind": "text", "path": f"{f}/e.txt"}),
        ("text, random bytes", {"kind": "text", "path": f"{f}/r.txt"}),
        ("jsonl, 64 KiB rows", {"kind": "jsonl", "path": f"{f}/e.jsonl", "field": "text"}),
        ("jsonl, one row", {"kind": "jsonl", "path": f"{f}/one.jsonl", "field": "text"}),
        ("json, 64 KiB rows", {"kind": "json", "path": f"{f}/e.json", "field": "text"}),
        ("csv, 64 KiB rows", {"kind": "csv", "path": f"{f}/e.csv", "field": "text"}),
        ("parquet, 64 KiB cells", {"kind": "parquet", "path": f"{f}/e.parquet", "field": "text"}),
        ("parquet, one cell", {"kind": "parquet", "path": f"{f}/one.parquet", "field": "text"}),
    ]


TEMPLATES = {
    "template, nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{{ messages }}{% endfor %}"
                              "{% endfor %}",
    "template, 'x' * 10**9": "{{ 'x' * 1000000000 }}",
}


def main() -> None:
    global REPO
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "input_memory.jsonl")
    ap.add_argument("--repo", type=Path, default=REPO, help="the llmc tree to measure (e.g. an older checkout)")
    args = ap.parse_args()
    REPO = args.repo.resolve()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    header = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": cpu, "cores": os.cpu_count(),
              "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    base = _child({})["peak_rss_bytes"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size_mib in args.sizes_mib:
            folder = Path(tmp) / str(size_mib)
            folder.mkdir()
            for name, source in _cases(folder, size_mib << 20):
                rows.append({"case": name, "input_bytes": size_mib << 20} | _child({"source": source}))
        for name, template in TEMPLATES.items():
            path = Path(tmp) / "t.jinja"
            path.write_text(template)
            rows.append({"case": name, "input_bytes": len(template)} | _child({"template": str(path)}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            extra = row.get("peak_rss_bytes", base) - base
            row |= {"baseline_rss_bytes": base, "extra_rss_bytes": extra,
                    "extra_bytes_per_input_byte": round(extra / row["input_bytes"], 1)}
            f.write(json.dumps(header | row) + "\n")
            print(f"{row['case']:<26} {row['input_bytes'] / 2**20:>7.2f} MiB  +{extra / 2**20:>7.1f} MiB  "
                  f"{row.get('seconds', '?'):>6} s  {row['outcome']}")
    print(f"baseline (imports only) {base / 2**20:.0f} MiB; {header['cpu']}; written to {args.out}")


if __name__ == "__main__":
    main()
