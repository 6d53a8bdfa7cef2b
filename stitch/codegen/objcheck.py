"""Is a blob an object file MCJIT can load on this host? Checked before bytes from the compile
cache reach LLVM, which aborts the process ("LLVM ERROR: not a valid object file") on a
non-object and runs foreign-architecture code until SIGILL.

Only what a relocatable ELF object of this machine must satisfy is checked: magic, class,
byte order, ET_REL, e_machine, header sizes, and every section's bytes inside the file (a
truncated object fails). Hosts whose objects are not ELF (macOS, Windows) get no host-object
caching at all: ``host_objects_cacheable()`` is False there. ``cubin_code`` reads a kernel's
machine code out of a cubin (comparing builds without a GPU).
"""
from __future__ import annotations

import platform
import struct
import sys

ELF_MAGIC = b"\x7fELF"
ET_REL = 1
SHT_NULL, SHT_NOBITS = 0, 8
EM_CUDA = 190

# platform.machine() -> ELF e_machine.
_EM_BY_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21,
                  "ppc64": 21, "s390x": 22, "riscv64": 243, "i386": 3, "i686": 3, "x86": 3}
# e_type, e_machine, e_version, e_entry, e_phoff, e_shoff, e_flags, e_ehsize, e_phentsize,
# e_phnum, e_shentsize, e_shnum, e_shstrndx (after the 16-byte e_ident)
_EHDR = {64: "HHIQQQIHHHHHH", 32: "HHIIIIIHHHHHH"}
# sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size (the rest is not needed)
_SHDR = {64: "IIQQQQ", 32: "IIIIII"}
_SHENTSIZE = {64: 64, 32: 40}


def host_elf_machine() -> int | None:
    """This machine's ELF e_machine, None when it is not known here."""
    return _EM_BY_MACHINE.get(platform.machine().lower())


def host_objects_cacheable() -> bool:
    """Whether MCJIT objects of this host are ELF and can be checked by ``elf_problem``."""
    return sys.platform.startswith(("linux", "freebsd")) and host_elf_machine() is not None


def elf_problem(blob: bytes, *, machine: int, bits: int, little_endian: bool,
                relocatable: bool = True) -> str | None:
    """None when ``blob`` is a well-formed ELF file of that kind; else what is wrong."""
    if len(blob) < 16 or blob[:4] != ELF_MAGIC:
        return "not an ELF file"
    if blob[4] != (2 if bits == 64 else 1):
        return f"ELF class {blob[4]}, not {bits}-bit"
    if blob[5] != (1 if little_endian else 2):
        return "wrong byte order"
    order = "<" if little_endian else ">"
    ehdr = struct.Struct(order + _EHDR[bits])
    if len(blob) < 16 + ehdr.size:
        return "truncated ELF header"
    (e_type, e_machine, _version, _entry, _phoff, shoff, _flags, ehsize, _phentsize, _phnum,
     shentsize, shnum, shstrndx) = ehdr.unpack_from(blob, 16)
    if relocatable and e_type != ET_REL:
        return f"ELF type {e_type}, not a relocatable object"
    if e_machine != machine:
        return f"ELF machine {e_machine}, not this host's {machine}"
    if ehsize != 16 + ehdr.size or shentsize != _SHENTSIZE[bits]:
        return "inconsistent ELF header sizes"
    if shnum == 0 or shstrndx >= shnum:
        return "no usable section table"
    if shoff + shnum * shentsize > len(blob):
        return "section table outside the file (truncated?)"
    for i, (_name, sh_type, _flags, _addr, offset, size) in enumerate(
            _section_headers(blob, order, bits, shoff, shnum, shentsize)):
        if sh_type not in (SHT_NULL, SHT_NOBITS) and offset + size > len(blob):
            return f"section {i} outside the file (truncated?)"
    return None


def _section_headers(blob: bytes, order: str, bits: int, shoff: int, shnum: int,
                     shentsize: int) -> list[tuple[int, ...]]:
    """(sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size) of every section."""
    shdr = struct.Struct(order + _SHDR[bits])
    return [shdr.unpack_from(blob, shoff + i * shentsize) for i in range(shnum)]


def host_object_problem(blob: bytes) -> str | None:
    """None when ``blob`` is a relocatable ELF object for this host (safe to hand to MCJIT as
    far as its shape goes); else the reason it is not."""
    machine = host_elf_machine()
    if machine is None or not host_objects_cacheable():
        return f"host objects of {sys.platform}/{platform.machine()} are not checked"
    return elf_problem(blob, machine=machine, bits=struct.calcsize("P") * 8,
                       little_endian=sys.byteorder == "little")


def cubin_problem(blob: bytes) -> str | None:
    """None when ``blob`` looks like a CUDA cubin (64-bit little-endian ELF, EM_CUDA)."""
    return elf_problem(blob, machine=EM_CUDA, bits=64, little_endian=True, relocatable=False)


def cubin_code(blob: bytes, entry: str) -> bytes | None:
    """The machine code of kernel ``entry`` in cubin ``blob`` (its ``.text.<entry>``
    section), None when the cubin has no such section. Two builds whose code is equal run
    the same instructions: a build change that keeps every kernel's code needs no GPU to
    show it costs nothing at run time (bench/opt_levels.py)."""
    problem = cubin_problem(blob)
    if problem is not None:
        raise ValueError(f"not a cubin: {problem}")
    ehdr = struct.Struct("<" + _EHDR[64])
    (_type, _machine, _version, _entry, _phoff, shoff, _flags, _ehsize, _phentsize, _phnum,
     shentsize, shnum, shstrndx) = ehdr.unpack_from(blob, 16)
    sections = _section_headers(blob, "<", 64, shoff, shnum, shentsize)
    names_at = sections[shstrndx][4]
    wanted = f".text.{entry}".encode()
    for name, sh_type, _flags, _addr, offset, size in sections:
        start = names_at + name
        if blob[start:blob.index(b"\0", start)] == wanted and sh_type != SHT_NOBITS:
            return blob[offset:offset + size]
    return None
