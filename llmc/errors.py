"""Every failure llmc reports on purpose, each with the exit code a CI system can branch on.

An LlmcError carries what went wrong and, where one exists, the fix. The CLI prints both and
exits with the class's code; anything else escaping is an internal error (exit 70).
"""

from __future__ import annotations


class LlmcError(Exception):
    """Base class: a message that names the problem and an optional fix."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class RecipeError(LlmcError):
    """The recipe is malformed: unknown key, wrong type, impossible value."""

    exit_code = 2
    kind = "invalid recipe"


class IncompatibleTargetError(LlmcError):
    """The recipe is well-formed but a target cannot run it (arch, runtime, model shape)."""

    exit_code = 3
    kind = "incompatible target"


class ResourceError(LlmcError):
    """Out of disk (full, over quota, or failing with I/O errors) or memory (host, GPU), or over a resource limit."""

    exit_code = 4
    kind = "resource exhausted"


class QualityGateError(LlmcError):
    """A quality gate (perplexity, KLD, agreement) failed."""

    exit_code = 5
    kind = "quality gate"


class PerformanceGateError(LlmcError):
    """A performance gate (tokens/s) failed."""

    exit_code = 6
    kind = "performance gate"


class InputError(LlmcError):
    """A model, checkpoint, corpus or artifact given to llmc is missing, corrupt or unsafe."""

    exit_code = 7
    kind = "bad input"


class EngineUnavailable(LlmcError):
    """A runtime needed for a target is not installed on this machine."""

    exit_code = 8
    kind = "runtime unavailable"


class EngineFailed(LlmcError):
    """A runtime was present but failed to load or run an artifact."""

    exit_code = 9
    kind = "runtime failed"


class RegistryError(LlmcError):
    """A model registry (MLflow, the Hugging Face Hub) is unreachable, refused a request, or its client is missing."""

    exit_code = 10
    kind = "registry unavailable"


INTERNAL_ERROR_EXIT_CODE = 70

EXIT_CODES: dict[str, int] = {
    cls.kind: cls.exit_code
    for cls in (
        RecipeError,
        IncompatibleTargetError,
        ResourceError,
        QualityGateError,
        PerformanceGateError,
        InputError,
        EngineUnavailable,
        EngineFailed,
        RegistryError,
    )
} | {"internal error": INTERNAL_ERROR_EXIT_CODE}
