"""Error classes: each carries a distinct exit code and an optional hint for the fix.

The CLI prints ``error: <message>`` and ``hint: <hint>`` on one line each and exits with
``exit_code``; tracebacks only appear with ``--debug``.
"""
from __future__ import annotations


class EdgepackError(Exception):
    exit_code = 1
    kind = "error"

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(EdgepackError):
    exit_code = 2


class TargetError(EdgepackError):
    """Unknown target name, invalid target file or target string."""
    exit_code = 3


class ModelError(EdgepackError):
    """The ONNX file is unreadable, not ONNX, or structurally broken."""
    exit_code = 4


class UnsupportedOpError(EdgepackError):
    """The model uses an operator the chosen backend cannot build."""
    exit_code = 5


class ToolMissingError(EdgepackError):
    """A required external tool (zig, pnnx, qemu, ...) is not installed."""
    exit_code = 6


class BuildError(EdgepackError):
    """Compiling, converting or linking failed."""
    exit_code = 7


class VerificationError(EdgepackError):
    """The artifact's outputs disagree with onnxruntime."""
    exit_code = 8


class DeployError(EdgepackError):
    exit_code = 9


class ArtifactError(EdgepackError):
    """A file passed as an artifact is not an edgepack artifact, or it failed to run."""
    exit_code = 11


class InputError(EdgepackError):
    """An input the model cannot take (wrong shape or dtype, undecodable file, ...). `edgepack run`
    reports it with the artifact's own code for bad input (3)."""
    exit_code = 12


# OCI registries (edgepack push / pull / deploy REGISTRY/REPO:TAG): codes 20+ so other groups keep theirs.
class RegistryError(EdgepackError):
    """A registry could not be reached, refused plain HTTP, or answered outside the OCI protocol."""
    exit_code = 20


class RegistryAuthError(RegistryError):
    """The registry wants credentials, or refused the ones given."""
    exit_code = 21


class RegistryNotFound(RegistryError):
    """The repository, tag or digest does not exist in the registry."""
    exit_code = 22


class PlatformNotFound(RegistryError):
    """The image index has no entry for the asked platform / target."""
    exit_code = 23


class IntegrityError(RegistryError):
    """A pulled blob or file does not match its digest or sha256: nothing is written."""
    exit_code = 24
