"""scripts/compare_plans.py pins every probe of llmc (issue 44, F8): a record made under another load must not move a
probed row, and a probe added later must not go unpinned silently."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from llmc.planning import probes
from llmc.quant.spec import TensorSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare_plans():
    spec = importlib.util.spec_from_file_location("compare_plans", REPO / "scripts" / "compare_plans.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_plans"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("compare_plans", None)


def test_every_probe_and_every_timer_of_llmc_is_pinned(compare_plans) -> None:
    sites = compare_plans.probe_sites()
    assert compare_plans.unpinned(sites) == []
    timers = {s.timer for s in sites}
    # the probes this test was written against are found (the scan is not vacuous)
    assert {"llmc.quant.numerics:_fake_quantize_timer", "llmc.formats.gguf:_convert_timer",
            "llmc.engines.agreement:_scoring_timer", "llmc.quant.mxfp4_source:_kept_codes_probe",
            "llmc.planning.disk:_timer"} <= timers
    # every `_*timer` function defined in llmc is a pinned probe's timer
    root = Path(compare_plans.__file__).resolve().parents[1] / "llmc"
    defined = set()
    for path in root.rglob("*.py"):
        module = ".".join(["llmc", *path.relative_to(root).with_suffix("").parts])
        text = path.read_text()
        for node in ast.parse(text).body if "timer" in text else ():
            if isinstance(node, ast.FunctionDef) and re.fullmatch(r"_\w*timer", node.name):
                defined.add(f"{module}:{node.name}")
    assert defined and defined <= set(compare_plans.TIMERS)


def test_a_probe_added_without_a_pin_is_named(compare_plans, tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "newprobes"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fresh.py").write_text(
        "from llmc.planning import probes\n\n"
        "def _fresh_timer(n):\n    return lambda: float(n)\n\n"
        "def fresh_rate(n):\n    return probes.rate(f'fresh {n}', _fresh_timer(n))\n\n"
        "def hidden_rate():\n    run = _fresh_timer(1)\n    return probes.rate('hidden', run)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = compare_plans.unpinned(compare_plans.probe_sites(package, "newprobes"))
    assert len(problems) == 2
    assert "fresh.py:7" in problems[0] and "newprobes.fresh:_fresh_timer is not pinned" in problems[0]
    assert "fresh.py:11" in problems[1] and "cannot be named" in problems[1]
    monkeypatch.setitem(compare_plans.TIMERS, "newprobes.fresh:_fresh_timer", lambda n: 2.0 * n)
    assert compare_plans.unpinned(compare_plans.probe_sites(package, "newprobes")) == [problems[1]]


def test_a_probe_reached_under_another_name_is_found_and_named(compare_plans, tmp_path: Path, monkeypatch) -> None:
    """The rate book reached without writing `probes.rate` (an alias of the module, `rate` or `measured` imported by
    name, the book's own probe) is a probe site too: the pinned book would run its timer, measuring this machine."""
    package = tmp_path / "aliased"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "calls.py").write_text(
        "from llmc.planning import probes as p\n"
        "from llmc.planning.probes import measured, rate as r\n\n"
        "def _a_timer():\n    return lambda: 1.0\n\n"
        "def aliased():\n    return p.rate('a', _a_timer())\n\n"
        "def by_name():\n    return r('b', _a_timer()) + measured('c', _a_timer()).rate\n\n"
        "def book_itself():\n    return p.book().probe('d', _a_timer())\n\n"
        "def unrelated(q):\n    return q.rate('e', 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sites = compare_plans.probe_sites(package, "aliased")
    assert sorted(int(s.where.rsplit(":", 1)[1]) for s in sites) == [8, 11, 11, 14]
    assert {s.timer for s in sites} == {"aliased.calls:_a_timer"}
    assert all("aliased.calls:_a_timer is not pinned" in p for p in compare_plans.unpinned(sites))


def test_pinned_probes_time_nothing_and_answer_a_fixed_function_of_their_arguments(compare_plans,
                                                                                  monkeypatch) -> None:
    from llmc.engines.agreement import scoring_rate
    from llmc.formats import gguf, onnx_genai
    from llmc.formats.onnx_qdq import insert_qdq_rate
    from llmc.planning import disk
    from llmc.quant.numerics import fake_quantize_rate

    for module, attr, value in compare_plans.pins(compare_plans.probe_sites()):
        monkeypatch.setattr(module, attr, value)
    monkeypatch.setattr(probes, "_book", compare_plans.pinned_book())
    monkeypatch.setattr(probes, "sustained_rate", lambda *a, **k: pytest.fail("a pinned probe timed something"))

    fp8 = TensorSpec("fp8_e4m3", "tensor")
    int8 = TensorSpec("int8", "tensor")
    first = fake_quantize_rate(fp8, "float32", 576, 512)
    assert fake_quantize_rate(fp8, "float32", 576, 512) == first
    assert fake_quantize_rate(int8, "float32", 576, 512) != first  # another call, another rate: a diff shows it
    assert fake_quantize_rate(fp8, "float32", 1024, 512) != first

    # TensorSpec as it would be with a field added later, left at its default
    later = dataclasses.make_dataclass("TensorSpec", [("later", int | None, None)], bases=(TensorSpec,), frozen=True)
    assert fake_quantize_rate(later("fp8_e4m3", "tensor"), "float32", 576, 512) == first
    assert scoring_rate(49152, 256, True) != scoring_rate(49152, 256, False)
    assert insert_qdq_rate(fp8, True) == insert_qdq_rate(fp8, True) > 0
    kind = gguf.ConvertWork("Q4_0", "repacked", TensorSpec("int4", "group", 32))
    assert gguf.convert_rate(kind) == gguf.convert_rate(kind) > 0 and gguf.vocabulary_rate() > 0
    assert disk.write_rate() > 0 and disk.read_rate() > 0
    assert onnx_genai.builder_rate({"model_type": "llama"}, 1) > onnx_genai.builder_rate({"model_type": "llama"}, 3)
    assert "pinned by scripts/compare_plans.py" in probes.book().describe()


def test_a_record_keeps_twelve_significant_digits_so_a_sums_order_does_not_show(compare_plans) -> None:
    a, b = 0.1 + 0.2 + 0.3, 0.3 + 0.2 + 0.1  # the same terms: 0.6000000000000001 and 0.6
    assert a != b and compare_plans._significant({"s": [a, 3], "n": "x"}) == {"s": [b, 3], "n": "x"}
    assert compare_plans._significant(123456.7890123456) == 123456.789012  # a real change in the 12th digit shows
