"""A small chat-formatted set from Jane Austen's novels, for calibrating/evaluating an Instruct model on chat samples.

Each row is one exchange: the user asks to continue a passage (one paragraph), the assistant answers with the
paragraph that follows it in the novel. Chapters are split like the `holdout: 10` data option: every tenth
chapter file (sorted order) goes to the evaluation file, the rest to the calibration file, so no paragraph is in
both. Needs scripts/setup-corpora.sh (Austen as one .txt per chapter).

    python benchmarks/make_chat_set.py OUT_DIR     -> OUT_DIR/austen-chat-calibration.jsonl, austen-chat-eval.jsonl
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

PROMPTS = ("Continue this passage in the same style:", "What comes next in this story?",
           "Write the paragraph that follows:")


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 30]


def main(out: Path) -> None:
    corpora = Path(os.environ.get("LLMC_CORPORA", Path.home() / ".cache" / "llmc" / "corpora"))
    files = sorted((corpora / "austen").glob("*.txt"))
    if not files:
        sys.exit("no Austen chapters: run scripts/setup-corpora.sh first")
    out.mkdir(parents=True, exist_ok=True)
    rows = {"calibration": [], "eval": []}
    for i, f in enumerate(files):
        part = "eval" if i % 10 == 9 else "calibration"
        ps = paragraphs(f.read_text())
        for j in range(0, len(ps) - 1, 2):  # disjoint pairs: no paragraph is in two rows
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            rows[part].append({"id": f"{f.stem}:{j}", "messages": [
                {"role": "user", "content": f"{prompt}\n\n{ps[j]}"},
                {"role": "assistant", "content": ps[j + 1]}]})
    for part, rs in rows.items():
        path = out / f"austen-chat-{part}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rs))
        print(f"{path}: {len(rs)} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
