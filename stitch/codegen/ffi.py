"""Kernel IR kernels as XLA FFI custom calls on the CPU.

`host_ffi_target(kernel)` compiles the kernel's host SIMT program (stitch.codegen.host) together with
an XLA FFI handler `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)` in one MCJIT module. The
handler answers XLA's metadata probe, checks the call frame's operands and results against the
kernel's params (count, dtype, element count) and returns an XLA error naming the kernel on a
mismatch, then runs blocks [0, grid) with a scratch buffer of its own per call (so XLA may run
the same custom call on two threads at once). An out-of-bounds access caught by the kernel's
bounds checks comes back as an XLA error too, never as a crash.

`FfiTarget.call(*args)` is `jax.ffi.ffi_call(name, out_types)(*args)`; `register()` hands the
handler to XLA once per name. Built targets are cached by name (a hash of their content) for
the life of the process, so the MCJIT engine holding the code outlives XLA's use of it.

The struct layouts below are written from jaxlib 0.10.2's
`jaxlib/include/xla/ffi/api/c_api.h` (XLA_FFI_API_MAJOR 0, XLA_FFI_API_MINOR 3), LP64 (x86-64
and aarch64 Linux): size_t / int64_t / pointers are 8 bytes, enums 4, natural alignment.
stitch/codegen/ffi_cuda.py reuses them and the frame decoding for the CUDA handler.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir

from stitch.codegen import kir
from stitch.codegen.cache import CompileCache, cache_key
from stitch.codegen.errors import CodegenError
from stitch.codegen.host import (BUFFER_ALIGNMENT, NUMPY_DTYPES, ObjectBuilder, host_machine, emit_host_ir,
                         jit_module)
from stitch.codegen.llvm_emit import I8, I32, I64

LOG = logging.getLogger(__name__)

PTR = ir.PointerType()
I1 = ir.IntType(1)

# ---------------------------------------------------------------- the C ABI (c_api.h)

# XLA_FFI_API_MAJOR / the minor version the handler reports to the metadata probe. Every
# struct and function used here exists since 0.1; XLA accepts handlers of older minors.
API_MAJOR = 0
API_MINOR = 1

EXTENSION_METADATA = 1      # XLA_FFI_Extension_Metadata
ARG_BUFFER = 1              # XLA_FFI_ArgType_BUFFER
RET_BUFFER = 1              # XLA_FFI_RetType_BUFFER
ERR_INVALID_ARGUMENT = 3    # XLA_FFI_Error_Code_*
ERR_RESOURCE_EXHAUSTED = 8
ERR_OUT_OF_RANGE = 11
ERR_INTERNAL = 13
TRAIT_COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE

# XLA_FFI_DataType codes of the Kernel IR storage dtypes.
FFI_DTYPES: dict[str, int] = {"i1": 1, "i8": 2, "i32": 4, "i64": 5, "u8": 6, "u32": 8,
                              "f16": 10, "f32": 11, "f64": 12, "bf16": 16}


def _c_layout(ty: ir.Type) -> tuple[int, int]:
    """(size, alignment) of `ty` as a C compiler lays it out (natural alignment, LP64)."""
    if isinstance(ty, ir.IntType):
        n = max(1, ty.width // 8)
        return n, n
    if isinstance(ty, ir.PointerType):
        return 8, 8
    if isinstance(ty, ir.LiteralStructType):
        offset, align = 0, 1
        for elem in ty.elements:
            size, a = _c_layout(elem)
            offset = (offset + a - 1) // a * a + size
            align = max(align, a)
        return (offset + align - 1) // align * align, align
    if isinstance(ty, ir.ArrayType):
        size, a = _c_layout(ty.element)
        return size * ty.count, a
    raise CodegenError(f"no C layout for {ty}")


@dataclass(frozen=True)
class CStruct:
    """A C struct of c_api.h as an llvmlite literal struct with named fields; a field's type
    is an llvmlite type or a nested CStruct."""
    name: str
    fields: tuple[tuple[str, "ir.Type | CStruct"], ...]

    @functools.cached_property
    def type(self) -> ir.LiteralStructType:
        return ir.LiteralStructType([_ir_type(t) for _, t in self.fields])

    def index(self, name: str) -> int:
        for i, (n, _) in enumerate(self.fields):
            if n == name:
                return i
        raise CodegenError(f"{self.name} has no field {name!r}")

    def field(self, name: str) -> "ir.Type | CStruct":
        return self.fields[self.index(name)][1]

    def resolve(self, path: Sequence[str]) -> tuple[list[int], ir.Type]:
        """GEP indices (after the leading 0) and the llvmlite type of a field path."""
        indices, cur = [], self
        for i, name in enumerate(path):
            if not isinstance(cur, CStruct):
                raise CodegenError(f"{self.name}.{'.'.join(path[:i])} is not a struct")
            indices.append(cur.index(name))
            cur = cur.field(name)
        return indices, _ir_type(cur)

    def offset(self, name: str) -> int:
        """offsetof(struct, name)."""
        off = 0
        for n, t in self.fields:
            size, align = _c_layout(_ir_type(t))
            off = (off + align - 1) // align * align
            if n == name:
                return off
            off += size
        raise CodegenError(f"{self.name} has no field {name!r}")

    @property
    def size(self) -> int:
        return _c_layout(self.type)[0]

    def struct_size(self, last: str | None = None) -> int:
        """XLA_FFI_STRUCT_SIZE(struct, last) = offsetof(last) + sizeof(last): what a caller
        writes into struct_size."""
        last = last or self.fields[-1][0]
        return self.offset(last) + _c_layout(_ir_type(self.field(last)))[0]


def _ir_type(t: "ir.Type | CStruct") -> ir.Type:
    return t.type if isinstance(t, CStruct) else t


EXTENSION_BASE = CStruct("XLA_FFI_Extension_Base", (
    ("struct_size", I64), ("type", I32), ("next", PTR)))
API_VERSION = CStruct("XLA_FFI_Api_Version", (
    ("struct_size", I64), ("extension_start", PTR), ("major_version", I32),
    ("minor_version", I32)))
ERROR_CREATE_ARGS = CStruct("XLA_FFI_Error_Create_Args", (
    ("struct_size", I64), ("extension_start", PTR), ("message", PTR), ("errc", I32)))
BUFFER = CStruct("XLA_FFI_Buffer", (
    ("struct_size", I64), ("extension_start", PTR), ("dtype", I32), ("data", PTR),
    ("rank", I64), ("dims", PTR)))
ARGS = CStruct("XLA_FFI_Args", (
    ("struct_size", I64), ("extension_start", PTR), ("size", I64), ("types", PTR),
    ("args", PTR)))
RETS = CStruct("XLA_FFI_Rets", (
    ("struct_size", I64), ("extension_start", PTR), ("size", I64), ("types", PTR),
    ("rets", PTR)))
ATTRS = CStruct("XLA_FFI_Attrs", (
    ("struct_size", I64), ("extension_start", PTR), ("size", I64), ("types", PTR),
    ("names", PTR), ("attrs", PTR)))
CALL_FRAME = CStruct("XLA_FFI_CallFrame", (
    ("struct_size", I64), ("extension_start", PTR), ("api", PTR), ("ctx", PTR),
    ("stage", I32), ("args", ARGS), ("rets", RETS), ("attrs", ATTRS),
    ("future", PTR)))
METADATA = CStruct("XLA_FFI_Metadata", (
    ("struct_size", I64), ("api_version", API_VERSION), ("traits", I32),
    ("state_type_id", I64)))
METADATA_EXTENSION = CStruct("XLA_FFI_Metadata_Extension", (
    ("extension_base", EXTENSION_BASE), ("metadata", PTR)))
STREAM_GET_ARGS = CStruct("XLA_FFI_Stream_Get_Args", (
    ("struct_size", I64), ("extension_start", PTR), ("ctx", PTR), ("stream", PTR)))
DEVICE_ORDINAL_GET_ARGS = CStruct("XLA_FFI_DeviceOrdinal_Get_Args", (
    ("struct_size", I64), ("extension_start", PTR), ("ctx", PTR), ("device_ordinal", I32)))
# XLA_FFI_Api: a header, then one function pointer per API call in this order.
API_FUNCTIONS = ("XLA_FFI_Error_Create", "XLA_FFI_Error_GetMessage", "XLA_FFI_Error_Destroy",
                 "XLA_FFI_Handler_Register", "XLA_FFI_Stream_Get", "XLA_FFI_Type_Register",
                 "XLA_FFI_ExecutionContext_Get", "XLA_FFI_State_Set", "XLA_FFI_State_Get",
                 "XLA_FFI_DeviceMemory_Allocate", "XLA_FFI_DeviceMemory_Free",
                 "XLA_FFI_ThreadPool_Schedule", "XLA_FFI_ThreadPool_NumThreads",
                 "XLA_FFI_Future_Create", "XLA_FFI_Future_SetAvailable",
                 "XLA_FFI_Future_SetError", "XLA_FFI_RunId_Get", "XLA_FFI_DeviceOrdinal_Get")
API = CStruct("XLA_FFI_Api", (
    ("struct_size", I64), ("extension_start", PTR), ("api_version", API_VERSION),
    ("internal_api", PTR), *((f, PTR) for f in API_FUNCTIONS)))

_MESSAGE_BYTES = 512
# One row of a handler's buffer table (HandlerEmitter.buffer_table), per kernel param in
# params order: where the frame passes it and what the kernel wants of it.
BUFFER_ROW = CStruct("stitch_buffer_row", (
    ("group", I32),              # 0: an operand (the frame's args), 1: a result (its rets)
    ("index", I32),              # its position among them
    ("dtype", I32),              # the XLA_FFI_DataType the kernel wants
    ("size", I64),               # the element count the kernel wants
    ("name", PTR),               # the param's name and dtype, for messages
    ("dtype_name", PTR)))


# ---------------------------------------------------------------- handler emission


def alloca(b: ir.IRBuilder, ty: ir.Type, name: str = "", align: int | None = None) -> ir.Value:
    """A stack slot typed as an opaque pointer (llvmlite types allocas as typed pointers,
    which its GEP / store checks then hold against the opaque-pointer code here)."""
    slot = b.alloca(ty, name=name)
    slot.type = PTR
    if align is not None:
        slot.align = align
    return slot


def element(b: ir.IRBuilder, base: ir.Value, ty: ir.Type, *index: int | ir.Value) -> ir.Value:
    """&((ty*)base)[index...] (ints become i32 constants)."""
    idx = [ir.Constant(I32, i) if isinstance(i, int) else i for i in index]
    return b.gep(base, idx, inbounds=True, source_etype=ty)


def global_constant(module: ir.Module, init: ir.Constant, name: str) -> ir.GlobalVariable:
    """A private constant global, referenced as an opaque pointer."""
    gv = ir.GlobalVariable(module, init.type, module.get_unique_name(name))
    gv.type = PTR
    gv.linkage = "private"
    gv.global_constant = True
    gv.initializer = init
    return gv


def _escape(text: str) -> str:
    """Literal text inside a printf format."""
    return text.replace("%", "%%")


class HandlerEmitter:
    """Emits `ptr @name(ptr frame)`: the frame decoding shared by the CPU and CUDA handlers.

    Use: `answer_metadata_probe()`, `check_frame()`, `buffer_table()` (the data pointers in
    params order, checked), then the platform's work, `fail(...)` for errors and
    `builder.ret(null)`."""

    def __init__(self, module: ir.Module, kernel: kir.Kernel | None, name: str, *,
                 subject: str | None = None) -> None:
        self.module = module
        self.kernel = kernel
        # What every error message starts with: the kernel, or `subject` for a handler
        # that no one kernel owns (kernel None: no frame decoding, errors only).
        if subject is None:
            if kernel is None:
                raise CodegenError(f"handler {name}: a kernel or a subject for its errors")
            subject = f"kernel '{kernel.name}'"
        self.subject = subject
        self.fn = ir.Function(module, ir.FunctionType(PTR, [PTR]), name)
        self.fn.args[0].name = "frame"
        self.frame = self.fn.args[0]
        self.entry = self.fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)
        self._strings: dict[str, ir.GlobalVariable] = {}
        self._api: ir.Value | None = None
        self.null = ir.Constant(PTR, None)
        # One message buffer for every error path (each returns).
        self.message = alloca(self.b, ir.ArrayType(I8, _MESSAGE_BYTES), "message")

    # ------------------------------------------------------------ memory helpers

    def gep(self, ptr: ir.Value, struct: CStruct, *path: str) -> ir.Value:
        """Address of ptr->path[0].path[1]..."""
        indices, _ = struct.resolve(path)
        return self.b.gep(ptr, [ir.Constant(I32, i) for i in (0, *indices)], inbounds=True,
                          source_etype=struct.type)

    def load(self, ptr: ir.Value, struct: CStruct, *path: str) -> ir.Value:
        _, ty = struct.resolve(path)
        return self.b.load(self.gep(ptr, struct, *path), typ=ty)

    def alloca(self, ty: ir.Type, name: str = "", align: int | None = None) -> ir.Value:
        """A stack slot in the entry block (static: no stack growth, promotable)."""
        with self.b.goto_block(self.entry):
            return alloca(self.b, ty, name, align)

    def store(self, value: ir.Value, ptr: ir.Value, struct: CStruct, *path: str) -> None:
        self.b.store(value, self.gep(ptr, struct, *path))

    def string(self, text: str) -> ir.Value:
        """A private NUL-terminated constant string."""
        gv = self._strings.get(text)
        if gv is None:
            data = bytearray(text.encode()) + b"\0"
            gv = global_constant(self.module, ir.Constant(ir.ArrayType(I8, len(data)), data),
                                 "str")
            gv.unnamed_addr = True
            self._strings[text] = gv
        return gv

    def declare(self, name: str, ret: ir.Type, args: list[ir.Type],
                var_arg: bool = False) -> ir.Function:
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, args, var_arg=var_arg), name)
        return fn

    def api_fn(self, name: str, fnty: ir.FunctionType) -> "FunctionPointer":
        """A function pointer of the XLA_FFI_Api the frame carries, callable."""
        return FunctionPointer(self.load(self.api, API, name), fnty)

    @property
    def api(self) -> ir.Value:
        if self._api is None:
            raise CodegenError("handler: the API pointer is read by answer_metadata_probe() "
                               "or check_frame() first")
        return self._api

    # ------------------------------------------------------------ errors

    def fail(self, code: int, fmt: str, *values: ir.Value) -> None:
        """Return an XLA_FFI_Error made with the API's Error_Create. `fmt` is a printf format
        (the subject, the kernel's name, is prepended); `values` are i64 / pointer arguments."""
        b = self.b
        text = f"{_escape(self.subject)}: {fmt}"
        snprintf = self.declare("snprintf", I32, [PTR, I64, PTR], var_arg=True)
        b.call(snprintf, [self.message, ir.Constant(I64, _MESSAGE_BYTES), self.string(text),
                          *values])
        self.error_from(code, self.message)

    def error_from(self, code: int | ir.Value, message: ir.Value) -> None:
        """ret Error_Create({message, code}) (XLA copies the message)."""
        if isinstance(code, int):
            code = ir.Constant(I32, code)
        self.b.ret(self.b.call(self._error_fn(), [self.api, code, message]))

    def _error_fn(self) -> ir.Function:
        """`ptr error(api, code, message)`, one per module: the error paths stay small."""
        name = "stitch_ffi_error"
        fn = self.module.globals.get(name)
        if fn is not None:
            return fn
        fn = ir.Function(self.module, ir.FunctionType(PTR, [PTR, I32, PTR]), name)
        fn.linkage = "internal"
        fn.attributes.add("cold")
        fn.attributes.add("noinline")
        api, code, message = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        args = alloca(b, ERROR_CREATE_ARGS.type, "args")
        for field_name, value in (
                ("struct_size", ir.Constant(I64, ERROR_CREATE_ARGS.struct_size())),
                ("extension_start", self.null), ("message", message), ("errc", code)):
            index = ERROR_CREATE_ARGS.index(field_name)
            b.store(value, element(b, args, ERROR_CREATE_ARGS.type, 0, index))
        slot = element(b, api, API.type, 0, API.index("XLA_FFI_Error_Create"))
        create = FunctionPointer(b.load(slot, typ=PTR), ir.FunctionType(PTR, [PTR]))
        b.ret(b.call(create, [args]))
        return fn

    # ------------------------------------------------------------ the frame

    def answer_metadata_probe(self, traits: int = 0) -> None:
        """XLA first calls a handler with a metadata extension on the frame; the handler
        writes the API version and traits it was built for and returns without running."""
        b = self.b
        self._api = self.load(self.frame, CALL_FRAME, "api")
        ext = self.load(self.frame, CALL_FRAME, "extension_start")
        with b.if_then(b.icmp_unsigned("!=", ext, self.null), likely=False):
            kind = self.load(ext, EXTENSION_BASE, "type")
            with b.if_then(b.icmp_signed("==", kind, ir.Constant(I32, EXTENSION_METADATA))):
                meta = self.load(ext, METADATA_EXTENSION, "metadata")
                with b.if_then(b.icmp_unsigned("==", meta, self.null), likely=False):
                    self.fail(ERR_INVALID_ARGUMENT, "metadata extension without metadata")
                size = self.load(meta, METADATA, "struct_size")
                need = METADATA.struct_size("traits")
                with b.if_then(b.icmp_unsigned("<", size, ir.Constant(I64, need)),
                               likely=False):
                    self.fail(ERR_INVALID_ARGUMENT,
                              f"XLA_FFI_Metadata of %lld bytes, need {need}", size)
                for name, value in (("struct_size", ir.Constant(I64, API_VERSION.struct_size())),
                                    ("extension_start", self.null),
                                    ("major_version", ir.Constant(I32, API_MAJOR)),
                                    ("minor_version", ir.Constant(I32, API_MINOR))):
                    self.store(value, meta, METADATA, "api_version", name)
                self.store(ir.Constant(I32, traits), meta, METADATA, "traits")
                b.ret(self.null)

    def check_frame(self) -> None:
        """Refuse a call frame older than the fields read here."""
        b = self.b
        if self._api is None:
            self._api = self.load(self.frame, CALL_FRAME, "api")
        size = self.load(self.frame, CALL_FRAME, "struct_size")
        need = CALL_FRAME.struct_size("attrs")
        with b.if_then(b.icmp_unsigned("<", size, ir.Constant(I64, need)), likely=False):
            self.fail(ERR_INVALID_ARGUMENT, f"call frame of %lld bytes, need {need}", size)

    def buffer_table(self) -> ir.Value:
        """A stack array of the data pointers of the frame's operands and results in
        kernel.params order, after checking counts, kinds, dtypes and element counts against
        the params. The checks walk a constant table (one row per param) in one loop, so
        the handler's code, and LLVM's time on it, does not grow with the params."""
        b = self.b
        k = self.kernel
        inputs = [i for i, p in enumerate(k.params) if not p.is_output]
        outputs = [i for i, p in enumerate(k.params) if p.is_output]
        nargs = self.load(self.frame, CALL_FRAME, "args", "size")
        nrets = self.load(self.frame, CALL_FRAME, "rets", "size")
        bad = b.or_(b.icmp_signed("!=", nargs, ir.Constant(I64, len(inputs))),
                    b.icmp_signed("!=", nrets, ir.Constant(I64, len(outputs))))
        with b.if_then(bad, likely=False):
            self.fail(ERR_INVALID_ARGUMENT,
                      f"custom call has %lld operands and %lld results; the kernel takes "
                      f"{len(inputs)} inputs and {len(outputs)} outputs", nargs, nrets)
        position = {pi: j for j, pi in enumerate(inputs)}
        position.update({pi: j for j, pi in enumerate(outputs)})
        rows = [ir.Constant(BUFFER_ROW.type, [
            ir.Constant(I32, int(p.is_output)), ir.Constant(I32, position[i]),
            ir.Constant(I32, FFI_DTYPES[p.dtype]), ir.Constant(I64, p.size),
            self.string(p.name), self.string(str(p.dtype))])
            for i, p in enumerate(k.params)]
        n = len(k.params)
        data = self.alloca(ir.ArrayType(PTR, max(1, n)), "buffers")
        if n:
            table = global_constant(self.module,
                                    ir.Constant(ir.ArrayType(BUFFER_ROW.type, n), rows),
                                    "buffer_table")
            code = b.call(self._check_buffers_fn(), [
                self.frame, table, ir.Constant(I64, n), data, self.message,
                self.string(self.subject)])
            with b.if_then(b.icmp_signed("!=", code, ir.Constant(I32, 0)), likely=False):
                self.error_from(code, self.message)
        return data

    def _check_buffers_fn(self) -> ir.Function:
        """`i32 check(frame, table, n, data, message, subject)`: for each of the n rows of
        `table` (BUFFER_ROW), the frame's buffer it names is a buffer of the dtype and
        element count the row wants, and its data pointer goes to data[row]; 0, or an error
        code with the message in `message` (naming `subject`, the operand and the param)."""
        name = "stitch_ffi_check_buffers"
        fn = self.module.globals.get(name)
        if fn is not None:
            return fn
        fn = ir.Function(self.module, ir.FunctionType(I32, [PTR, PTR, I64, PTR, PTR, PTR]),
                         name)
        fn.linkage = "internal"
        frame, table, n, data, message, subject = fn.args
        entry, loop, done = (fn.append_basic_block(x) for x in ("entry", "loop", "done"))
        b = ir.IRBuilder(entry)
        zero = ir.Constant(I64, 0)

        def field(base: ir.Value, struct: CStruct, *path: str) -> ir.Value:
            indices, ty = struct.resolve(path)
            return b.load(b.gep(base, [ir.Constant(I32, i) for i in (0, *indices)],
                                inbounds=True, source_etype=struct.type), typ=ty)
        b.cbranch(b.icmp_signed(">", n, zero), loop, done)
        b.position_at_end(loop)
        i = b.phi(I64, "row")
        i.add_incoming(zero, entry)
        row = b.gep(table, [i], inbounds=True, source_etype=BUFFER_ROW.type)
        is_result = b.icmp_signed("!=", field(row, BUFFER_ROW, "group"), ir.Constant(I32, 0))
        j = b.sext(field(row, BUFFER_ROW, "index"), I64)
        param = field(row, BUFFER_ROW, "name")
        types = b.select(is_result, field(frame, CALL_FRAME, "rets", "types"),
                         field(frame, CALL_FRAME, "args", "types"))
        ptrs = b.select(is_result, field(frame, CALL_FRAME, "rets", "rets"),
                        field(frame, CALL_FRAME, "args", "args"))
        word = b.select(is_result, self.string("result"), self.string("operand"))
        snprintf = self.declare("snprintf", I32, [PTR, I64, PTR], var_arg=True)

        def refuse(fmt: str, *values: ir.Value) -> None:
            b.call(snprintf, [message, ir.Constant(I64, _MESSAGE_BYTES),
                              self.string("%s: %s %lld (param '%s') " + fmt),
                              subject, word, j, param, *values])
            b.ret(ir.Constant(I32, ERR_INVALID_ARGUMENT))
        kind = b.load(b.gep(types, [j], source_etype=I32), typ=I32)
        want_kind = b.select(is_result, ir.Constant(I32, RET_BUFFER), ir.Constant(I32, ARG_BUFFER))
        with b.if_then(b.icmp_signed("!=", kind, want_kind), likely=False):
            refuse("is not a buffer (kind %lld)", b.sext(kind, I64))
        buf = b.load(b.gep(ptrs, [j], source_etype=PTR), typ=PTR)
        dtype = field(buf, BUFFER, "dtype")
        want = field(row, BUFFER_ROW, "dtype")
        with b.if_then(b.icmp_signed("!=", dtype, want), likely=False):
            refuse("has XLA dtype code %lld, the kernel wants %s (code %lld)",
                   b.sext(dtype, I64), field(row, BUFFER_ROW, "dtype_name"), b.sext(want, I64))
        count = b.call(self._elements_fn(), [field(buf, BUFFER, "dims"),
                                             field(buf, BUFFER, "rank")])
        size = field(row, BUFFER_ROW, "size")
        with b.if_then(b.icmp_signed("!=", count, size), likely=False):
            refuse("has %lld elements, the kernel wants %lld", count, size)
        b.store(field(buf, BUFFER, "data"), b.gep(data, [i], inbounds=True, source_etype=PTR))
        following = b.add(i, ir.Constant(I64, 1))
        i.add_incoming(following, b.block)
        b.cbranch(b.icmp_signed("<", following, n), loop, done)
        b.position_at_end(done)
        b.ret(ir.Constant(I32, 0))
        return fn

    def _elements_fn(self) -> ir.Function:
        """i64 elements(i64* dims, i64 rank): the product of the dims."""
        name = "stitch_ffi_elements"
        fn = self.module.globals.get(name)
        if fn is not None:
            return fn
        fn = ir.Function(self.module, ir.FunctionType(I64, [PTR, I64]), name)
        fn.linkage = "internal"
        dims, rank = fn.args
        entry, loop, done = (fn.append_basic_block(n) for n in ("entry", "loop", "done"))
        b = ir.IRBuilder(entry)
        b.cbranch(b.icmp_signed(">", rank, ir.Constant(I64, 0)), loop, done)
        b.position_at_end(loop)
        i = b.phi(I64, "i")
        acc = b.phi(I64, "acc")
        dim = b.load(b.gep(dims, [i], source_etype=I64), typ=I64)
        acc_next = b.mul(acc, dim)
        i_next = b.add(i, ir.Constant(I64, 1))
        i.add_incoming(ir.Constant(I64, 0), entry)
        i.add_incoming(i_next, loop)
        acc.add_incoming(ir.Constant(I64, 1), entry)
        acc.add_incoming(acc_next, loop)
        b.cbranch(b.icmp_signed("<", i_next, rank), loop, done)
        b.position_at_end(done)
        out = b.phi(I64, "elements")
        out.add_incoming(ir.Constant(I64, 1), entry)
        out.add_incoming(acc_next, loop)
        b.ret(out)
        return fn


class FunctionPointer(ir.Value):
    """A pointer value called through `fnty`: llvmlite's call wants a callee with a
    function_type, which opaque pointers no longer carry."""

    def __init__(self, value: ir.Value, fnty: ir.FunctionType) -> None:
        self.value = value
        self.type = value.type
        self.function_type = fnty

    def get_reference(self) -> str:
        return self.value.get_reference()


def constant_function(address: int, fnty: ir.FunctionType) -> FunctionPointer:
    """A function at a fixed process address (resolved when the handler is built)."""
    return FunctionPointer(ir.Constant(I64, address).inttoptr(PTR), fnty)


# ---------------------------------------------------------------- targets


@dataclass
class FfiTarget:
    """A compiled FFI handler for one kernel. `register()` (idempotent per name), then
    `call(*args)` inside or outside jax.jit; outputs come back flat unless `out_shapes`.
    `llvm_ir` is the handler module's IR; targets are cached per name for the life of the
    process while something holds them (``cached_target``): whatever holds an executable
    that calls the target must hold the target too, or its code is freed."""
    name: str
    kernel: kir.Kernel
    platform: str
    address: int
    llvm_ir: str = field(repr=False)
    _engine: object = field(repr=False)
    _keepalive: tuple = field(default=(), repr=False)

    @property
    def inputs(self) -> tuple[kir.Param, ...]:
        return tuple(p for p in self.kernel.params if not p.is_output)

    @property
    def outputs(self) -> tuple[kir.Param, ...]:
        return tuple(p for p in self.kernel.params if p.is_output)

    def capsule(self) -> Any:
        import jax
        return jax.ffi.pycapsule(self.address)

    def register(self) -> None:
        """Hand the handler to XLA (after the backend is up); once per name per process."""
        import jax
        with _LOCK:
            if self.name in _REGISTERED:
                return
            jax.devices(_JAX_BACKENDS[self.platform])
            jax.ffi.register_ffi_target(self.name, self.capsule(), platform=self.platform)
            _REGISTERED.add(self.name)
        LOG.debug("registered FFI target %s (%s)", self.name, self.platform)

    def out_types(self, out_shapes: Sequence[Sequence[int]] | None = None) -> list[Any]:
        import jax
        outs = self.outputs
        shapes = [(p.size,) for p in outs] if out_shapes is None else \
            [tuple(int(d) for d in s) for s in out_shapes]
        if len(shapes) != len(outs):
            raise CodegenError(f"kernel {self.kernel.name!r}: {len(shapes)} output shapes for "
                               f"{len(outs)} outputs")
        for p, s in zip(outs, shapes):
            if int(np.prod(s, dtype=np.int64)) != p.size:
                raise CodegenError(f"kernel {self.kernel.name!r}: output {p.name!r} has "
                                   f"{p.size} elements, not shape {s}")
        return [jax.ShapeDtypeStruct(s, NUMPY_DTYPES[p.dtype]) for p, s in zip(outs, shapes)]

    def call(self, *args: Any, out_shapes: Sequence[Sequence[int]] | None = None) -> tuple:
        """The outputs (a tuple, in output-param order) of the custom call on `args`, which
        are the input params in order (any shapes with the right element counts)."""
        import jax
        ins = self.inputs
        if len(args) != len(ins):
            raise CodegenError(f"kernel {self.kernel.name!r}: {len(args)} arguments for "
                               f"{len(ins)} inputs")
        for p, a in zip(ins, args):
            shape, dtype = np.shape(a), getattr(a, "dtype", None)
            if int(np.prod(shape, dtype=np.int64)) != p.size or \
                    np.dtype(dtype) != NUMPY_DTYPES[p.dtype]:
                raise CodegenError(f"kernel {self.kernel.name!r}: input {p.name!r} wants "
                                   f"{p.size} x {p.dtype}, got {shape} {dtype}")
        self.register()
        if any(isinstance(a, jax.core.Tracer) for a in args):
            # Traced: jax keeps the executable that calls this handler in its caches, out of
            # reach of any reference we hold, so the handler's code stays for the process.
            with _LOCK:
                _PINNED.setdefault(self.name, self)
        outs = jax.ffi.ffi_call(self.name, self.out_types(out_shapes))(*args)
        return tuple(outs)


_LOCK = threading.Lock()
# Names handed to XLA. Its FFI registry keeps a name's handler address for the life of the
# process and cannot forget it, so a name whose target was freed is never registered again.
_REGISTERED: set[str] = set()
# The live targets by content name. Weak: a target lives as long as what runs it holds it
# (the executable of a stitch.jit signature, a stitch.compile program), so a function that
# is deleted frees its kernels' code.
_BUILT: weakref.WeakValueDictionary[str, FfiTarget] = weakref.WeakValueDictionary()
# Targets called inside a traced function (``FfiTarget.call``): held for the process.
_PINNED: dict[str, FfiTarget] = {}
_JAX_BACKENDS = {"cpu": "cpu", "CUDA": "gpu"}


def cached_target(name: str, build: Callable[[str], FfiTarget]) -> FfiTarget:
    """The live target for content `name`, or ``build(registry_name)``: `name` itself, or
    `name` with a generation suffix when an earlier target of that name was registered with
    XLA and has since been freed (its registration points at freed code)."""
    with _LOCK:
        built = _BUILT.get(name)
        fresh = name
        generation = 1
        while fresh in _REGISTERED and built is None:
            generation += 1
            fresh = f"{name}_g{generation}"
    if built is None:
        target = build(fresh)  # outside the lock: LLVM work can take a while
        with _LOCK:
            built = _BUILT.setdefault(name, target)
    return built


def target_name(kind: str, kernel: kir.Kernel, *content: str | bytes) -> str:
    """A registry name unique to the handler's content (XLA's registry is process-wide)."""
    h = hashlib.sha256()
    for part in content:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return f"stitch_{kind}_{kernel.name}_{h.hexdigest()[:16]}"


# ---------------------------------------------------------------- CPU handler

_ALLOCA_LIMIT = 32 * 1024  # larger scratch comes from the heap (XLA's thread stacks)

# The host kernel's scratch starts with its first out-of-bounds access: 4 x i64 (buffer id + 1,
# index, block, thread), zero when there was none (stitch.codegen.host's _ERROR_BYTES header).
_RECORD_WORDS = 4
# Per worker: buffers, blocks [begin, end), status (1: no scratch), the error record.
_WORKER = CStruct("stitch_worker", (
    ("buffers", PTR), ("begin", I32), ("end", I32), ("status", I32),
    ("error", ir.ArrayType(I64, _RECORD_WORDS))))


def _emit_worker(module: ir.Module, kernel_fn: ir.Function, scratch_bytes: int) -> ir.Function:
    """`ptr worker(stitch_worker*)`: one worker's blocks with a zeroed scratch of its own (a
    pthread start routine, also called directly)."""
    fn = ir.Function(module, ir.FunctionType(PTR, [PTR]), "stitch_ffi_worker")
    fn.linkage = "internal"
    ctx = fn.args[0]
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def at(name: str) -> ir.Value:
        return element(b, ctx, _WORKER.type, 0, _WORKER.index(name))
    size = ir.Constant(I64, scratch_bytes)
    on_heap = scratch_bytes > _ALLOCA_LIMIT
    if on_heap:
        alloc = ir.Function(module, ir.FunctionType(PTR, [I64, I64]), "aligned_alloc")
        scratch = b.call(alloc, [ir.Constant(I64, BUFFER_ALIGNMENT), size])
        with b.if_then(b.icmp_unsigned("==", scratch, ir.Constant(PTR, None)), likely=False):
            b.store(ir.Constant(I32, 1), at("status"))
            b.ret(ir.Constant(PTR, None))
    else:
        scratch = alloca(b, ir.ArrayType(I8, scratch_bytes), "scratch", BUFFER_ALIGNMENT)
    # Zeroed like HostKernel's numpy scratch: the error record must start clear, and
    # uninitialised shared memory then reads the same as in HostKernel.
    memset = module.declare_intrinsic("llvm.memset", [PTR, I64])
    b.call(memset, [scratch, ir.Constant(I8, 0), size, ir.Constant(I1, 0)])
    b.call(kernel_fn, [b.load(at("buffers"), typ=PTR), b.load(at("begin"), typ=I32),
                       b.load(at("end"), typ=I32), scratch])
    memcpy = module.declare_intrinsic("llvm.memcpy", [PTR, PTR, I64])
    b.call(memcpy, [at("error"), scratch, ir.Constant(I64, 8 * _RECORD_WORDS),
                    ir.Constant(I1, 0)])
    if on_heap:
        free = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR]), "free")
        b.call(free, [scratch])
    b.ret(ir.Constant(PTR, None))
    return fn


def new_module(name: str) -> ir.Module:
    """An empty module for the host (process triple, host data layout)."""
    module = ir.Module(name=name)
    module.triple = llvm.get_process_triple()
    module.data_layout = _host_data_layout()
    return module


@functools.cache
def _host_data_layout() -> str:
    """The host's data layout, read once (a target machine per handler cost ~1.5 ms)."""
    return str(host_machine().target_data)


def emit_host_handler_ir(kernel: kir.Kernel, name: str, *, threads: int = 1,
                         bounds_check: bool = True, scratch_bytes: int | None = None) -> str:
    """The handler module's LLVM IR: `ptr @name(ptr frame)` plus its worker, calling the host
    kernel function `kernel.name` (declared here, defined by the host module, which needs
    `scratch_bytes` of scratch: emit_host_ir's second result)."""
    module = new_module(f"{name}_handler")
    kernel_fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, PTR]),
                            kernel.name)
    if scratch_bytes is None:
        _, scratch_bytes = emit_host_ir(kernel, bounds_check)
    worker = _emit_worker(module, kernel_fn, scratch_bytes)
    h = HandlerEmitter(module, kernel, name)
    b = h.b
    h.answer_metadata_probe()
    h.check_frame()
    table = h.buffer_table()

    workers = max(1, min(threads, kernel.grid))
    bounds = [w * kernel.grid // workers for w in range(workers + 1)]
    ctxs = h.alloca(ir.ArrayType(_WORKER.type, workers), "workers")

    def ctx(w: int) -> ir.Value:
        return element(b, ctxs, _WORKER.type, w)

    def ctx_field(w: int, fname: str) -> ir.Value:
        return element(b, ctxs, _WORKER.type, w, _WORKER.index(fname))
    for w in range(workers):
        for fname, value in (("buffers", table), ("begin", ir.Constant(I32, bounds[w])),
                             ("end", ir.Constant(I32, bounds[w + 1])),
                             ("status", ir.Constant(I32, 0))):
            b.store(value, ctx_field(w, fname))
    if workers > 1:
        # Workers 1.. on fresh threads (where pthread_create fails, inline), 0 right here.
        create = h.declare("pthread_create", I32, [PTR, PTR, PTR, PTR])
        join = h.declare("pthread_join", I32, [I64, PTR])
        tids = h.alloca(ir.ArrayType(I64, workers), "tids")
        started = h.alloca(ir.ArrayType(I8, workers), "started")
        for w in range(1, workers):
            rc = b.call(create, [element(b, tids, I64, w), h.null, worker, ctx(w)])
            ok = b.icmp_signed("==", rc, ir.Constant(I32, 0))
            b.store(b.zext(ok, I8), element(b, started, I8, w))
            with b.if_then(b.not_(ok), likely=False):
                b.call(worker, [ctx(w)])
        b.call(worker, [ctx(0)])
        for w in range(1, workers):
            flag = b.load(element(b, started, I8, w), typ=I8)
            with b.if_then(b.icmp_unsigned("!=", flag, ir.Constant(I8, 0))):
                b.call(join, [b.load(element(b, tids, I64, w), typ=I64), h.null])
    else:
        b.call(worker, [ctx(0)])

    for w in range(workers):
        status = b.load(ctx_field(w, "status"), typ=I32)
        with b.if_then(b.icmp_signed("!=", status, ir.Constant(I32, 0)), likely=False):
            h.fail(ERR_RESOURCE_EXHAUSTED, f"cannot allocate {scratch_bytes} bytes of scratch")
        if bounds_check:
            _check_out_of_bounds(h, kernel, ctx_field(w, "error"))
    b.ret(h.null)
    return str(module)


def _check_out_of_bounds(h: HandlerEmitter, kernel: kir.Kernel, record: ir.Value) -> None:
    """The host kernel's first out-of-bounds access (buffer id + 1, index, block, thread)."""
    b = h.b
    words = [b.load(element(b, record, I64, i), typ=I64) for i in range(_RECORD_WORDS)]
    with b.if_then(b.icmp_signed("!=", words[0], ir.Constant(I64, 0)), likely=False):
        buffers = (*kernel.params, *kernel.shared, *kernel.scratch)
        names = global_constant(h.module, ir.Constant(ir.ArrayType(PTR, len(buffers)), [
            h.string(buf.name) for buf in buffers]), "buffer_names")
        sizes = global_constant(h.module, ir.Constant(ir.ArrayType(I64, len(buffers)), [
            buf.size for buf in buffers]), "buffer_sizes")
        idx = b.sub(words[0], ir.Constant(I64, 1))
        name = b.load(element(b, names, PTR, idx), typ=PTR)
        size = b.load(element(b, sizes, I64, idx), typ=I64)
        h.fail(ERR_OUT_OF_RANGE, "out-of-bounds access %s[%lld] (size %lld) in block %lld "
               "thread %lld", name, words[1], size, words[2], words[3])


@functools.lru_cache(maxsize=None)
def _load_libraries() -> None:
    # pthread_create/join, aligned_alloc, snprintf: resolved by MCJIT from the process.
    for lib in ("c", "pthread"):
        found = ctypes.util.find_library(lib)
        if found:
            llvm.load_library_permanently(found)


def compile_handler(name: str, kernel: kir.Kernel | None, modules: Sequence[str], *,
                    internalize: Sequence[str] = (), opt: int = 2,
                    cache: CompileCache | None = None,
                    build_fast: bool = False,
                    object_builder: ObjectBuilder | None = None) -> tuple[object, int]:
    """Link IR modules into one MCJIT engine on the calling thread; (engine, address of
    `name`). ``kernel``: whose handler it is, for errors (None: one that kernels share).
    Functions in `internalize` become internal once linked (so they inline). With `cache`,
    the object code is looked up / stored there (``host.jit_module``: built once under the
    key's lock, checked before loading): only for modules that name external functions by
    symbol, never ones with process addresses baked in (the CUDA handler). ``build_fast``:
    no IR passes and LLVM's fast instruction selection (`opt` unused), for a handler that
    only decodes the frame and calls the driver: ~4 ms to build instead of ~30 ms, and its
    few hundred instructions a call are nothing beside a kernel launch. ``object_builder``:
    the object code is built there (``host.jit_module``), only loaded here."""
    whose = f"kernel {kernel.name!r}" if kernel is not None else f"handler {name}"
    tm = host_machine(0 if build_fast else 2)
    _load_libraries()
    try:
        module = llvm.parse_assembly(modules[0])
        for text in modules[1:]:
            module.link_in(llvm.parse_assembly(text))
        module.verify()
    except RuntimeError as exc:
        raise CodegenError(f"{whose}: LLVM rejected the FFI handler IR: "
                           f"{exc}") from exc
    for fn in module.functions:
        if fn.name in internalize and not fn.is_declaration:
            fn.linkage = llvm.Linkage.internal
    level = None if build_fast else opt
    key = _object_key(modules, internalize, level) if cache is not None else ""
    engine, from_cache = jit_module(module, tm, opt=level, cache=cache, key=key,
                                    object_builder=object_builder,
                                    codegen_level=0 if build_fast else 2)
    address = engine.get_function_address(name)
    if not address:
        raise CodegenError(f"{whose}: MCJIT produced no FFI handler {name}")
    LOG.debug("FFI handler %s built%s", name, " (object from the cache)" if from_cache else "")
    return engine, address


def _object_key(modules: Sequence[str], internalize: Sequence[str], opt: int | None) -> str:
    """What the handler's object code depends on: IR, CPU, options, the LLVM building it."""
    import llvmlite
    return cache_key("ffi-handler-object", *modules, *internalize, llvm.get_process_triple(),
                     llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten(),
                     str(opt), llvmlite.__version__)


def host_ffi_target(kernel: kir.Kernel, *, threads: int = 1, bounds_check: bool = True,
                    opt: int = 2, cache: CompileCache | None = None,
                    object_builder: ObjectBuilder | None = None) -> FfiTarget:
    """The kernel's host program behind an XLA FFI handler for platform "cpu". `threads`
    workers (pthreads made per call) split the blocks; 1 runs them on XLA's thread. With
    `cache`, the handler's object code comes from / goes to that compile cache; with
    `object_builder`, it is built there (a child process) instead of in this process."""
    if threads < 1:
        raise CodegenError(f"kernel {kernel.name!r}: threads={threads} must be >= 1")
    kernel.validate()
    for p in kernel.params:
        if p.dtype not in FFI_DTYPES:
            raise CodegenError(f"kernel {kernel.name!r}: param {p.name!r} dtype {p.dtype} "
                               "has no XLA FFI dtype")
    kernel_ir, scratch = emit_host_ir(kernel, bounds_check)
    workers = max(1, min(threads, kernel.grid))
    name = target_name("cpu", kernel, kernel_ir, str(workers), str(opt))

    def build(name: str) -> FfiTarget:
        handler_ir = emit_host_handler_ir(kernel, name, threads=workers,
                                          bounds_check=bounds_check, scratch_bytes=scratch)
        engine, address = compile_handler(name, kernel, [kernel_ir, handler_ir],
                                          internalize=[kernel.name], opt=opt, cache=cache,
                                          object_builder=object_builder)
        LOG.debug("kernel %s: FFI target %s, %d scratch bytes, %d workers", kernel.name,
                  name, scratch, workers)
        return FfiTarget(name, kernel, "cpu", address, handler_ir, engine)
    return cached_target(name, build)
