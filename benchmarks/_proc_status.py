"""A child process's memory lines from /proc/<pid>/status, in bytes: what the memory benchmarks sample
(full_width.py, bf16_memory.py). Imported as a sibling module (each benchmark runs as a script from this folder)."""

from __future__ import annotations

import re
from pathlib import Path


def memory_bytes(pid: int, fields: tuple[str, ...]) -> dict[str, int] | None:
    """{field: bytes} for those of `fields` (VmRSS, RssAnon, RssFile, VmHWM, ...) the status file lists now — none
    once the process is a zombie; None when the file cannot be read (the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {k: int(m.group(1)) * 1024 for k in fields if (m := re.search(rf"{k}:\s+(\d+)", text))}
