"""The registry of artifact formats (`llmc.registry`), and the lookups over it that need no runtime.

Each format module beside this file defines one `ArtifactFormat` class and registers it with `@register_format`;
`llmc.runtimes.catalog` imports every runtime module, and each runtime module imports the format module it reads, so
consumers of the catalog see every built-in format. docs/extending.md shows how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

from llmc.errors import EngineUnavailable
from llmc.formats.base import ArtifactFormat
from llmc.registry import Registry

FORMATS: Registry[ArtifactFormat] = Registry("artifact format")


def register_format(cls: type[ArtifactFormat]) -> type[ArtifactFormat]:
    """Class decorator: one instance of each format, looked up by its name."""
    FORMATS.add(cls.name, cls())
    return cls


def artifact_format(name: str) -> ArtifactFormat:
    return FORMATS[name]


def formats() -> list[ArtifactFormat]:
    return list(FORMATS.values())


def is_implemented(format_name: str) -> bool:
    return format_name in FORMATS


def recognize(path: Path) -> ArtifactFormat | None:
    """The format of the artifact at `path`, or None."""
    return next((f for f in FORMATS.values() if f.recognizes(path)), None)


def import_libraries(formats: Iterable[ArtifactFormat]) -> None:
    """Import the Python packages these formats' exporters need (`ArtifactFormat.libraries`); EngineUnavailable
    naming the package, the format and the error where one does not import."""
    for fmt in formats:
        for module in fmt.libraries:
            try:
                importlib.import_module(module)
            except Exception as e:  # not only ImportError: a package broken by another's version raises anything
                raise EngineUnavailable(
                    f"the {fmt.name} exporter needs the Python package {module}, which does not import here: "
                    f"{type(e).__name__}: {e}",
                    fix="reinstall llmc's pinned dependencies (pip install -c constraints.txt -e ., as "
                        "scripts/setup.sh does), or drop the targets written in this format") from None
