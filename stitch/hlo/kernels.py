"""Count the kernels an XLA-optimized module launches (what XLA GPU decided to fuse).

Each fusion, custom call and unfused array op in a *launching* computation (ENTRY, while
bodies/conditions, conditional branches, called computations) is one kernel; fused
computations, reducers and comparators launch nothing themselves. Kernels are classed as
``gemm`` (dot/conv, cuBLAS/cuDNN calls, Triton GEMM fusions), ``opaque`` (other custom calls,
sort, rng...) or ``memory`` (everything else: the memory-intensive kernels stitch targets,
scatter fusions included: stitch generates scatters, ``stitch.hlo.scatter_forms``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .ir import Computation, HloModule, Instruction

# Ops that never launch a kernel: they only name, alias or sequence buffers.
FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "add-dependency", "optimization-barrier", "partition-id",
                      "replica-id", "domain"})
CONTROL_OPS = frozenset({"while", "conditional", "call"})
_GEMM_OPS = frozenset({"dot", "convolution", "ragged-dot"})
_OPAQUE_OPS = frozenset({"sort", "rng", "rng-bit-generator", "rng-get-and-update-state",
                         "fft", "triangular-solve", "cholesky", "infeed", "outfeed",
                         "send", "recv", "topk"})
_GEMM_CALL_PREFIXES = ("__cublas", "__cudnn$conv", "__triton_gemm")
_GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas",
                      "__cudnn")


@dataclass(frozen=True)
class Kernel:
    computation: str
    instruction: str
    opcode: str
    category: str          # "memory" | "gemm" | "opaque"
    detail: str            # fusion kind / custom-call target / opcode
    launches: int = 1      # times launched per module execution (while trip counts)


@dataclass
class KernelSummary:
    kernels: list[Kernel] = field(default_factory=list)

    def count(self, category: str | None = None, dynamic: bool = False) -> int:
        return sum(k.launches if dynamic else 1 for k in self.kernels
                   if category is None or k.category == category)

    def by_detail(self) -> Counter:
        return Counter(f"{k.category}:{k.detail}" for k in self.kernels)


def _fusion_detail(module: HloModule, inst: Instruction) -> tuple[str, str]:
    kind = inst.attrs.get("kind", "")
    backend = inst.backend_config.get("fusion_backend_config", {}).get("kind", "")
    detail = f"{kind}:{backend}" if backend else kind
    if backend.startswith(_GEMM_FUSION_KINDS):
        return "gemm", detail
    fused = module.computation(inst.called_computations[0])
    ops = {i.opcode for i in fused.instructions}
    if ops & _GEMM_OPS or any(i.opcode == "custom-call" for i in fused.instructions):
        return "gemm", detail
    if ops & _OPAQUE_OPS:
        return "opaque", detail
    return "memory", detail


def _classify(module: HloModule, inst: Instruction) -> tuple[str, str] | None:
    if inst.opcode in FREE_OPS or inst.opcode in CONTROL_OPS:
        return None
    if inst.opcode == "fusion":
        return _fusion_detail(module, inst)
    if inst.opcode == "custom-call":
        target = inst.string("custom_call_target", "")
        return ("gemm" if target.startswith(_GEMM_CALL_PREFIXES) else "opaque"), target
    if inst.opcode in _GEMM_OPS:
        return "gemm", inst.opcode
    if inst.opcode in _OPAQUE_OPS or not inst.known_opcode:
        return "opaque", inst.opcode
    return "memory", inst.opcode


def _trip_count(inst: Instruction) -> int:
    known = inst.backend_config.get("known_trip_count", {})
    try:
        return int(known.get("n", 1))
    except (TypeError, ValueError):
        return 1


def count_kernels(module: HloModule) -> KernelSummary:
    """The kernels of every launching computation, reached from ENTRY."""
    summary = KernelSummary()
    seen: set[str] = set()

    def visit(comp: Computation, launches: int) -> None:
        if comp.name in seen:
            return
        seen.add(comp.name)
        for inst in comp.instructions:
            if inst.opcode in CONTROL_OPS:
                times = launches * (_trip_count(inst) if inst.opcode == "while" else 1)
                for callee in inst.called_computations:
                    visit(module.computation(callee), times)
                continue
            cls = _classify(module, inst)
            if cls is not None:
                summary.kernels.append(Kernel(comp.name, inst.name, inst.opcode, cls[0], cls[1],
                                              launches))

    visit(module.entry, 1)
    return summary
