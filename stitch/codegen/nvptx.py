"""NVPTX target: Kernel IR -> PTX text through llvmlite (LLVM's NVPTX back end) and libdevice.

`emit_ptx` is a pure function of (kernel, arch). An LLVM abort kills the process, so callers
that cannot afford that run it in a child process. Every transcendental goes through libdevice
(`__nv_*`), which is linked in, internalised and optimised away where unused: the back end has
no libcalls for e.g. `fexp`, and ptxas cannot resolve external `__nv_` functions.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError, ToolchainError
from stitch.codegen.llvm_emit import I32, STORAGE_BYTES, Ctx, KernelEmitter, Target, storage_type
from stitch.codegen.pipelines import DEFAULT_PIPELINE, PIPELINE_ENV, PIPELINES, LlvmPipeline
from stitch.codegen.toolchain import find_libdevice

LOG = logging.getLogger(__name__)

TRIPLE = "nvptx64-nvidia-cuda"
ARCHS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
DEFAULT_PTX_VERSION = 78  # PTX ISA 7.8: the first with sm_90; CUDA >= 11.8 drivers load it
STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static __shared__ per block
# Register cap (.maxnreg) of a kernel with grid barriers: the global scope sizes its grid for
# this many (stitch.schedule.global_scope.GLOBAL_REGISTERS; a test keeps the two equal).
GRID_BARRIER_MAX_REGISTERS = 64
GLOBAL, SHARED = 1, 3  # NVPTX address spaces
PARAM_ALIGN = 16  # bytes every buffer param is aligned to (the widest vector access)

_UNARY_LIBDEVICE = {"exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sin", "cos",
                    "tan", "erf", "cbrt", "floor", "ceil", "rint", "round", "pow", "atan2", "fmod"}
_SHFL_KIND = {"xor": "bfly", "down": "down", "idx": "idx"}


def default_libdevice_path() -> Path | None:
    """libdevice.10.bc as ``toolchain.find_libdevice`` finds it (STITCH_LIBDEVICE, CUDA_HOME,
    the toolkit, the nvidia-cuda-nvcc-cu12 wheel); None when there is none."""
    try:
        return find_libdevice()
    except ToolchainError:
        return None


@functools.lru_cache(maxsize=4)
def _libdevice_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


@functools.lru_cache(maxsize=None)
def _target_machine(arch: str, ptx_version: int) -> llvm.TargetMachine:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    target = llvm.Target.from_triple(TRIPLE)
    return target.create_target_machine(cpu=arch, features=f"+ptx{ptx_version}", opt=3)


class NvptxTarget(Target):
    """SIMT-native hooks: special registers, bar.sync, shfl.sync, addrspace(3) shared, libdevice."""

    name = "nvptx"
    param_align = PARAM_ALIGN

    def __init__(self, noalias_inputs: bool = False) -> None:
        self.buffers: dict[str, ir.Value] = {}
        self.noalias_inputs = noalias_inputs    # LlvmPipeline.noalias_inputs

    def begin(self, em: KernelEmitter) -> None:
        k = em.kernel
        fnty = ir.FunctionType(ir.VoidType(), [ir.PointerType(addrspace=GLOBAL)] * len(k.params))
        fn = ir.Function(em.module, fnty, k.name)
        fn.calling_convention = "ptx_kernel"  # LLVM >= 20 marks entries by this CC (-> .entry)
        inputs_private = self.noalias_inputs and not kir.has_atomics(k)
        for arg, p in zip(fn.args, k.params):
            arg.name = p.name
            # XLA aligns every buffer it hands a kernel to at least 16 bytes (entry
            # parameters 16, its own allocations more): saying so lets LLVM prove a
            # thread's consecutive elements aligned and merge them into vector accesses.
            arg.attributes.align = PARAM_ALIGN
            if inputs_private and not p.is_output:
                # Nothing writes an input while the kernel runs: the kernel stores only to
                # outputs (Kernel.validate), and XLA never gives a custom call's result an
                # operand's buffer unless output_to_operand_aliasing says so, which stitch
                # says only for an atomic scatter's in-place output (kir.has_atomics). Two
                # inputs may share a buffer; neither is written.
                arg.add_attribute("noalias")
            self.buffers[p.name] = arg
        for s in k.shared:
            arr = ir.ArrayType(storage_type(s.dtype), s.size)
            gv = ir.GlobalVariable(em.module, arr, f"{k.name}__{s.name}", addrspace=SHARED)
            gv.linkage = "internal"
            gv.initializer = ir.Constant(arr, ir.Undefined)
            gv.align = 16
            zero = ir.Constant(I32, 0)
            self.buffers[s.name] = gv.gep([zero, zero])  # element pointer into the array
        # Upgraded by LLVM to the "nvvm.maxntid" attribute -> .maxntid in PTX.
        ann = em.module.add_named_metadata("nvvm.annotations")
        ann.add(em.module.add_metadata([fn, ir.MetaDataString(em.module, "maxntidx"),
                                        ir.Constant(I32, k.block)]))
        if kir.has_grid_barrier(k) and k.grid_sync == "barrier":
            # -> .maxnreg: ptxas keeps to the registers the schedule sized the resident grid
            # for (spilling if it must), so every block fits at once and the barrier opens.
            ann.add(em.module.add_metadata([fn, ir.MetaDataString(em.module, "maxnreg"),
                                            ir.Constant(I32, GRID_BARRIER_MAX_REGISTERS)]))
        elif k.register_budget is not None:
            # ptxas's own register heuristic may spill a kernel the schedule sized for more
            # (bert_layer_train's 32-thread layer-norm-backward kernel: 80 registers and
            # 128 bytes spilled, 126 and none under .maxnreg 128).
            ann.add(em.module.add_metadata([fn, ir.MetaDataString(em.module, "maxnreg"),
                                            ir.Constant(I32, k.register_budget)]))
        em.start_function(fn)

    def emit_body(self, em: KernelEmitter) -> None:
        if em.kernel.grid_sync == "relaunch" and kir.has_grid_barrier(em.kernel):
            self.emit_relaunched_body(em)
        else:
            super().emit_body(em)

    def _sreg(self, em: KernelEmitter, reg: str) -> ir.Value:
        read = functools.partial(em.call, f"llvm.nvvm.read.ptx.sreg.{reg}.x", I32, [])
        return em.in_block(("sreg", reg), (), read)

    def thread_idx(self, em: KernelEmitter, ctx: Ctx) -> ir.Value:
        return self._sreg(em, "tid")

    def block_idx(self, em: KernelEmitter, ctx: Ctx) -> ir.Value:
        return self._sreg(em, "ctaid")

    def buffer_ptr(self, em: KernelEmitter, name: str) -> ir.Value:
        return self.buffers[name]

    def math(self, em: KernelEmitter, fname: str, dtype: str,
             args: list[ir.Value]) -> ir.Value:
        if fname not in _UNARY_LIBDEVICE:
            raise CodegenError(f"no libdevice function for {fname}")
        suffix = "f" if dtype == "f32" else ""
        return em.call(f"__nv_{fname}{suffix}", args[0].type, args)

    def barrier(self, em: KernelEmitter) -> None:
        # llvm.nvvm.barrier0 is gone in LLVM 22 (auto-upgraded from text only).
        em.call("llvm.nvvm.barrier.cta.sync.aligned.all", ir.VoidType(), [ir.Constant(I32, 0)])

    def shuffle32(self, em: KernelEmitter, value: ir.Value, lane: ir.Value,
                  mode: str) -> ir.Value:
        kind = "f32" if isinstance(value.type, ir.FloatType) else "i32"
        args = [ir.Constant(I32, -1), value, lane, ir.Constant(I32, 31)]  # full mask, clamp 31
        return em.call(f"llvm.nvvm.shfl.sync.{_SHFL_KIND[mode]}.{kind}", value.type, args)


def emit_llvm_ir(kernel: kir.Kernel, arch: str = "sm_80",
                 ptx_version: int = DEFAULT_PTX_VERSION, noalias_inputs: bool = False, *,
                 simplify: bool = True) -> str:
    """The kernel as NVPTX LLVM IR text, before libdevice linking and optimisation
    (``noalias_inputs``: LlvmPipeline.noalias_inputs; ``simplify``: KernelEmitter's)."""
    kernel.validate()
    shared_bytes = sum(s.size * STORAGE_BYTES[s.dtype] for s in kernel.shared)
    if shared_bytes > STATIC_SHARED_LIMIT:
        raise CodegenError(f"kernel {kernel.name!r}: {shared_bytes} bytes of shared memory "
                           f"exceed the {STATIC_SHARED_LIMIT} static limit")
    tm = _target_machine(arch, ptx_version)
    with collector_paused():
        module = ir.Module(name=kernel.name)
        module.triple = TRIPLE
        module.data_layout = str(tm.target_data)
        KernelEmitter(kernel, NvptxTarget(noalias_inputs), module, simplify=simplify).emit()
        # libdevice asks through __nvvm_reflect whether to flush denormals: no (like numpy).
        flags = module.add_named_metadata("llvm.module.flags")
        flags.add(module.add_metadata([ir.Constant(I32, 4), "nvvm-reflect-ftz",
                                       ir.Constant(I32, 0)]))
        return str(module)


_pause_lock = threading.Lock()
_pauses = 0             # emissions running with the collector paused by collector_paused
_resume = False         # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block (back on after the last of concurrent
    blocks, where it was on before the first). Why: llvmlite.ir's module is ~10^5 objects
    in reference cycles (instructions and their blocks), all alive until the text is
    written, so every collection during emission walked them again only to promote them
    (GPT-2 small's 31 distinct kernels built in a process holding them all: 7% of their
    LLVM CPU, the mean of runs; less in a PTX child, whose heap is small). The module
    becomes garbage as one batch, freed by the next young collection."""
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()




def pipeline_setting() -> LlvmPipeline:
    """The pipeline ``$STITCH_LLVM_PIPELINE`` names (unset or empty: the default); an
    unknown name is a CodegenError naming the known ones."""
    name = os.environ.get(PIPELINE_ENV, "").strip()
    if not name:
        return DEFAULT_PIPELINE
    try:
        return PIPELINES[name]
    except KeyError:
        raise CodegenError(f"{PIPELINE_ENV}={name!r} names no LLVM pipeline; known: "
                           f"{', '.join(PIPELINES)}") from None


def pipeline_name(pipeline: LlvmPipeline) -> str:
    """``pipeline``'s name in PIPELINES, else its fields (a cache key's part)."""
    return next((n for n, p in PIPELINES.items() if p == pipeline), repr(pipeline))


def emit_ptx(kernel: kir.Kernel, arch: str = "sm_80", *, libdevice: str | Path | None = None,
             ptx_version: int = DEFAULT_PTX_VERSION,
             pipeline: LlvmPipeline | None = None, simplify: bool = True) -> str:
    """PTX text for `kernel` on `arch` (sm_70 / sm_80 / sm_90 ...), one `.entry` named
    kernel.name, params in kernel.params order as global pointers, `.maxntid` = block.
    ``pipeline``: None is ``pipeline_setting()``; ``simplify``: KernelEmitter's (False
    only to check that it leaves the machine code alone)."""
    if arch not in ARCHS:
        raise CodegenError(f"unsupported arch {arch!r}; known: {', '.join(ARCHS)}")
    if pipeline is None:
        pipeline = pipeline_setting()
    text = emit_llvm_ir(kernel, arch, ptx_version, pipeline.noalias_inputs,
                        simplify=simplify)
    tm = _target_machine(arch, ptx_version)
    try:
        module = llvm.parse_assembly(text)
        module.verify()
    except RuntimeError as exc:
        raise CodegenError(f"kernel {kernel.name!r}: LLVM rejected the IR: {exc}") from exc
    if any(f.is_declaration and f.name.startswith("__nv_") for f in module.functions):
        _link_libdevice(module, libdevice)
    for fn in module.functions:  # only the entry stays visible; GlobalDCE drops the rest
        if not fn.is_declaration and fn.name != kernel.name:
            fn.linkage = llvm.Linkage.internal
    for gv in module.global_variables:
        if not gv.is_declaration:
            gv.linkage = llvm.Linkage.internal
    _drop_unused(module)    # before O3: its CGSCC passes would visit every dead function
    with _gvn_memdep(pipeline.gvn_memdep):
        _optimize(module, tm, pipeline)
        ptx = tm.emit_assembly(module)    # NVPTX codegen runs GVN too
    _check_ptx(kernel, ptx)
    LOG.debug("kernel %s: %d lines of PTX for %s", kernel.name, ptx.count("\n"), arch)
    return ptx


def _link_libdevice(module: llvm.ModuleRef, path: str | Path | None) -> None:
    path = Path(path) if path is not None else default_libdevice_path()
    if path is None or not path.is_file():
        raise ToolchainError("libdevice.10.bc not found (set CUDA_HOME or install "
                             "nvidia-cuda-nvcc-cu12)")
    wanted = frozenset(f.name for f in module.functions
                       if f.is_declaration and f.name.startswith("__nv_"))
    subset = _libdevice_subset(str(path), wanted, module.triple, module.data_layout)
    module.link_in(llvm.parse_bitcode(subset))


# Every libdevice function NvptxTarget.math may call, in both its f32 and f64 forms.
LIBDEVICE_FUNCTIONS = frozenset(f"__nv_{name}{suffix}" for name in _UNARY_LIBDEVICE
                                for suffix in ("f", ""))


@functools.lru_cache(maxsize=64)
def _libdevice_subset(path: str, wanted: frozenset[str], triple: str, data_layout: str) -> bytes:
    """libdevice cut down to ``wanted`` and what they call, as bitcode. Parsing and linking
    all of libdevice (~600 functions) per kernel, then optimising it away, cost ~0.1 s a
    kernel; the few distinct sets a module's kernels need are cut once per process, each
    from the process's cut to LIBDEVICE_FUNCTIONS (3 ms, not the 40 ms of a whole parse)."""
    source = _libdevice_stitch_cut(path, triple, data_layout) \
        if wanted <= LIBDEVICE_FUNCTIONS else _libdevice_bytes(path)
    return _libdevice_cut(source, wanted, triple, data_layout)


@functools.lru_cache(maxsize=4)
def _libdevice_stitch_cut(path: str, triple: str, data_layout: str) -> bytes:
    return _libdevice_cut(_libdevice_bytes(path), LIBDEVICE_FUNCTIONS, triple, data_layout)


def _libdevice_cut(bitcode: bytes, wanted: frozenset[str], triple: str,
                   data_layout: str) -> bytes:
    lib = llvm.parse_bitcode(bitcode)
    lib.triple = triple  # libdevice says nvptx64-nvidia-gpulibs
    lib.data_layout = data_layout
    for fn in lib.functions:
        if not fn.is_declaration and fn.name not in wanted:
            fn.linkage = llvm.Linkage.internal
    _drop_unused(lib)
    for fn in lib.functions:      # linked in, they must stay visible to the kernel's calls
        if not fn.is_declaration and fn.name in wanted:
            fn.linkage = llvm.Linkage.external
    return lib.as_bitcode()


def warm_up() -> None:
    """Do the work every kernel build of this process shares before the first needs it:
    LLVM's NVPTX target, and libdevice cut to LIBDEVICE_FUNCTIONS (~0.05 s). PTX build
    children run this as they start, while the compile they serve is still planning."""
    tm = _any_target_machine()
    path = default_libdevice_path()
    if path is not None and path.is_file():
        _libdevice_stitch_cut(str(path), TRIPLE, str(tm.target_data))


def _drop_unused(module: llvm.ModuleRef) -> None:
    """GlobalDCE alone: drops internal functions and globals nothing uses."""
    pb = llvm.create_pass_builder(_any_target_machine(), llvm.create_pipeline_tuning_options(
        speed_level=0))
    mpm = llvm.create_new_module_pass_manager()
    mpm.add_global_dead_code_eliminate_pass()
    mpm.run(module, pb)


def _any_target_machine() -> llvm.TargetMachine:
    return _target_machine(ARCHS[0], DEFAULT_PTX_VERSION)


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine,
              pipeline: LlvmPipeline = DEFAULT_PIPELINE) -> None:
    if not 0 <= pipeline.speed_level <= 3:
        raise CodegenError(f"LLVM speed level {pipeline.speed_level} is not one of 0-3")
    pto = llvm.create_pipeline_tuning_options(speed_level=pipeline.speed_level)
    pto.loop_unrolling = pipeline.loop_unrolling
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)  # NVPTX callbacks include NVVMReflect


@contextlib.contextmanager
def _gvn_memdep(enabled: bool) -> Iterator[None]:
    """LLVM's process-wide ``-enable-gvn-memdep`` off for the block when ``enabled`` is
    False (then on again: LLVM's default)."""
    if enabled:
        yield
        return
    llvm.set_option("", "-enable-gvn-memdep=false")
    try:
        yield
    finally:
        llvm.set_option("", "-enable-gvn-memdep=true")


_UNRESOLVED = re.compile(r"\.extern\s+\.func|call[^;]*__nv_")


def _check_ptx(kernel: kir.Kernel, ptx: str) -> None:
    if f".entry {kernel.name}(" not in ptx:
        raise CodegenError(f"kernel {kernel.name!r}: PTX has no .entry for it")
    if _UNRESOLVED.search(ptx):
        raise CodegenError(f"kernel {kernel.name!r}: PTX calls unresolved functions")
