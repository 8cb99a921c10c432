"""llmc.registry: the one mechanism every plugin kind (runtimes, formats, algorithms, flows, engines, loaders) uses."""

from __future__ import annotations

import pytest

from llmc.errors import InputError
from llmc.registry import Registry, UnknownName


def _shapes() -> Registry[object]:
    shapes: Registry[object] = Registry("shape")
    shapes.add("square", 4)

    @shapes.register("triangle")
    def triangle() -> int:
        return 3

    shapes.add("hexagon", 6)
    return shapes


def test_registration_order_is_kept_and_the_decorator_returns_the_plugin() -> None:
    shapes = _shapes()
    assert shapes.names() == ("square", "triangle", "hexagon") == tuple(shapes)
    assert shapes["triangle"]() == 3 and shapes["hexagon"] == 6
    assert len(shapes) == 3 and "square" in shapes and "circle" not in shapes
    assert shapes.get("circle") is None


def test_a_name_registered_twice_is_refused_and_the_first_stays() -> None:
    shapes = _shapes()
    with pytest.raises(ValueError, match="shape 'square' is registered twice"):
        shapes.add("square", 5)
    assert shapes["square"] == 4 and shapes.names() == ("square", "triangle", "hexagon")


def test_an_unknown_name_names_the_kind_and_every_registered_name() -> None:
    with pytest.raises(UnknownName) as caught:
        _shapes()["circle"]
    e = caught.value
    assert e.message == "unknown shape 'circle'" and e.fix == "use one of square, triangle, hexagon"
    # bad input (exit 7, like the loader lookup it replaced), and what the dict and engine lookups raised
    assert isinstance(e, InputError) and e.exit_code == 7
    assert isinstance(e, KeyError) and isinstance(e, ValueError)
    with pytest.raises(UnknownName, match="no shape is registered"):
        Registry("shape")["circle"]


def test_remove_takes_a_registration_back() -> None:
    shapes = _shapes()
    assert shapes.remove("triangle")() == 3
    assert shapes.names() == ("square", "hexagon")
    shapes.add("triangle", 3)  # free again
    assert shapes.names() == ("square", "hexagon", "triangle")


def test_every_plugin_kind_is_a_registry() -> None:
    from llmc.data.registry import LOADERS
    from llmc.engines.registry import ENGINES
    from llmc.quant.algorithms.catalog import ALGORITHMS
    from llmc.quant.flows import FLOWS
    from llmc.runtimes.catalog import FORMATS, RUNTIMES

    kinds = {r.kind for r in (LOADERS, ENGINES, ALGORITHMS, FLOWS, FORMATS, RUNTIMES)}
    assert kinds == {"data source kind", "engine", "algorithm", "data flow", "artifact format", "runtime"}
    assert all(isinstance(r, Registry) for r in (LOADERS, ENGINES, ALGORITHMS, FLOWS, FORMATS, RUNTIMES))
