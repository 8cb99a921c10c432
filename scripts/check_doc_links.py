"""Check that the docs' relative links resolve: every `[text](path#anchor)` in README.md and docs/*.md names a file
that exists and, where it has an anchor into a Markdown file, a heading of that file (GitHub's slugs); and every
bare `docs/<name>.md` mentioned in any tracked text file (code comments, error messages, tests) exists.

    python scripts/check_doc_links.py        # prints each broken link; exit 1 if there is one
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BARE = re.compile(r"\bdocs/[\w.-]+\.md\b")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(md: Path) -> list[str]:
    out, fenced = [], False
    for number, line in enumerate(md.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md
            where = f"{md.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where} (no heading with that anchor)")
    return out


def broken_mentions() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            out += [f"{name}:{number}: {m} (no such file)" for m in BARE.findall(line) if not (ROOT / m).exists()]
    return out


def main() -> int:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for md in pages for p in broken_links(md)] + broken_mentions()
    print("\n".join(problems) or f"all links resolve ({len(pages)} pages and every docs/*.md mention)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
