"""Reading a file the user named, safely: a regular file only, size-capped, decoded strictly.

Every check is made from stat before the file is opened, so a FIFO, /dev/zero, a socket or a symlink
loop is an error at once rather than a hang or an endless read; the open itself is non-blocking in case
the path changed kind since the stat, and the read stops one byte past the cap.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from llmc.errors import InputError, LlmcError
from llmc.inputs.excerpt import shorten

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ("a directory", "a FIFO (named pipe)", ...)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def shown(path: str | Path) -> str:
    """A path as it may appear in a message: escaped, at most 200 characters."""
    return shorten(str(path), 200)


def stat_input(path: str | Path, what: str, fix: str, error: type[LlmcError] = InputError) -> os.stat_result:
    """os.stat(path) (symlinks followed), or `error` saying why the path cannot be used."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {shown(path)} does not exist", fix=fix) from None
    except (OSError, ValueError) as e:  # ELOOP, ENOTDIR, EACCES, ENAMETOOLONG; ValueError: an embedded NUL
        if getattr(e, "errno", None) == errno.ELOOP:
            raise error(f"{what} {shown(path)} is a symlink loop", fix=fix) from None
        raise error(f"{what} {shown(path)} cannot be read ({shorten(str(e), 100)})", fix=fix) from None


def read_input_bytes(path: str | Path, what: str, limit: int, fix: str,
                     error: type[LlmcError] = InputError) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; `error` for anything else."""
    st = stat_input(path, what, fix, error)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {shown(path)} is {file_kind(st.st_mode)}, not a regular file", fix=fix)
    if st.st_size > limit:
        raise error(f"{what} {shown(path)} is {st.st_size:,} bytes; at most {limit:,} are read",
                    fix=f"check that this is the file you meant; {fix}")
    try:
        # O_NONBLOCK: should the path have become a FIFO since the stat, open() does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(f"{what} {shown(path)} cannot be read ({shorten(str(e), 100)})", fix=fix) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{what} {shown(path)} is not a regular file", fix=fix)
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise error(f"{what} {shown(path)} cannot be read ({shorten(str(e), 100)})", fix=fix) from None
    finally:
        os.close(fd)
    if size > limit:
        raise error(f"{what} {shown(path)} is over {limit:,} bytes", fix=f"check that this is the file you meant; {fix}")
    return b"".join(chunks)


def decode_utf8(data: bytes, path: str | Path, what: str, fix: str, error: type[LlmcError] = InputError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        bad = data[e.start:min(e.end, e.start + 4)]
        bad = ("byte " if len(bad) == 1 else "bytes ") + " ".join(f"0x{b:02x}" for b in bad)
        raise error(f"{what} {shown(path)} is not UTF-8 text: {bad} at offset {e.start} (line {line}: {e.reason})",
                    fix=fix) from None


def read_input_text(path: str | Path, what: str, limit: int, fix: str, error: type[LlmcError] = InputError) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes."""
    return decode_utf8(read_input_bytes(path, what, limit, fix, error), path, what, fix, error)


def read_input_json(path: str | Path, what: str, limit: int, fix: str) -> Any:
    """The JSON value in a regular file of at most `limit` bytes; InputError naming the line otherwise."""
    text = read_input_text(path, what, limit, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {shown(path)} is not JSON: {shorten(e.msg, 80)} at line {e.lineno}, "
                         f"column {e.colno}", fix=fix) from None
    except (RecursionError, ValueError) as e:  # nesting too deep; an integer of thousands of digits
        raise InputError(f"{what} {shown(path)} cannot be read as JSON ({shorten(f'{type(e).__name__}: {e}', 100)})",
                         fix=fix) from None
