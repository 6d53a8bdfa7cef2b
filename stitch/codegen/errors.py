"""Errors raised by code generation (part of the one StitchError hierarchy)."""
from __future__ import annotations

from stitch.hlo.errors import StitchError


class CodegenError(StitchError):
    """A kernel cannot be lowered, emitted, assembled or run."""


class ToolchainError(CodegenError):
    """A CUDA tool (ptxas, libdevice) is missing or rejected its input."""


class IsolatedCrash(CodegenError):
    """Work run in a child process died (e.g. LLVM aborted); the caller's process survives."""


class ImageRefused(CodegenError):
    """The CUDA driver would not load a module image (cuModuleLoadData failed): a cubin
    from a ptxas newer than the driver, or for another arch."""
