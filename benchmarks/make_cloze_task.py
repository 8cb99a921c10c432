"""A small local lm-evaluation-harness task from Jane Austen's held-out chapters: multiple-choice next word.

Each document is the start of a sentence (8-30 words) from an evaluation chapter (every tenth chapter file, as
`holdout: 10` splits it); the choices are the word that follows and three other words of the same length class
drawn from the same chapter (seeded). Accuracy is the share where the model's log-likelihood ranks the true
word first. Needs scripts/setup-corpora.sh.

    python benchmarks/make_cloze_task.py OUT_DIR [N]   -> OUT_DIR/austen_cloze.yaml + austen_cloze.jsonl
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

import yaml


def main(out: Path, n: int = 200) -> None:
    corpora = Path(os.environ.get("LLMC_CORPORA", Path.home() / ".cache" / "llmc" / "corpora"))
    files = sorted((corpora / "austen").glob("*.txt"))
    if not files:
        sys.exit("no Austen chapters: run scripts/setup-corpora.sh first")
    rng = random.Random(0)
    docs = []
    for f in files[9::10]:  # the evaluation chapters
        text = " ".join(f.read_text().split())
        words = [w for w in re.findall(r"[A-Za-z]+", text) if len(w) > 3]
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            tokens = sentence.split()
            if len(tokens) < 12:
                continue
            cut = rng.randint(8, min(30, len(tokens) - 2))
            plain = re.fullmatch(r"([A-Za-z]+)[,;:.!?]?", tokens[cut])
            if plain is None or len(plain.group(1)) <= 3:
                continue
            answer = plain.group(1)
            pool = sorted({w for w in words if w.lower() != answer.lower() and abs(len(w) - len(answer)) <= 2})
            if len(pool) < 3:
                continue
            choices = rng.sample(pool, 3) + [answer]
            rng.shuffle(choices)
            docs.append({"context": " ".join(tokens[:cut]), "choices": choices, "answer": choices.index(answer),
                         "id": f"{f.stem}:{len(docs)}"})
    rng.shuffle(docs)
    docs = docs[:n]
    out.mkdir(parents=True, exist_ok=True)
    data = out / "austen_cloze.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "austen_cloze.yaml").write_text(yaml.safe_dump({
        "task": "austen_cloze", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}, sort_keys=False))
    print(f"{data}: {len(docs)} documents")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 200)
