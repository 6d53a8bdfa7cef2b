"""Keys of Kernel IR sites that do not depend on names or node ids, and the proofs kept by
them.

``site_key(graph, members, schedule, layouts, in_place)`` describes everything
``lower.lower_kernel`` reads of a kernel's site, with node ids replaced by their position
among the kernel's nodes (its members and the values they read, in graph order) and names
left out (``lowering_reuse`` binds one lowering to every site of a key). ``proof_key`` keys a
proof about a set of nodes the same way (``lower``'s row-layout proof of a part), and
``kept_proof``/``keep_proof`` keep such proofs per process, renumbered for each site that
asks (``renamed_texts``: a reason naming the first site's nodes, renamed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from stitch.hlo.graph import OpGraph
from stitch.hlo.ir import Computation

from .errors import CodegenError

log = logging.getLogger(__name__)

# Ops whose lowering looks past the kernel's own nodes (index values known from their
# producers, scatter forms): their kernels are lowered per site.
LOOKS_BEYOND = frozenset({"gather", "scatter", "dynamic-slice", "dynamic-update-slice"})

# Attributes that do not change what an instruction computes.
IGNORED_ATTRS = frozenset({"metadata"})

# Schedule fields that hold node ids (KernelSchedule, PartSchedule, GroupSchedule,
# SharedBuffer, GlobalReduction); ``rejected`` is the tuner's notes, not the schedule.
ID_FIELDS = frozenset({"members", "root", "node", "cached", "bound"})
SKIPPED_FIELDS = frozenset({"rejected"})

_IDENT = re.compile(r"%?[A-Za-z_][\w.\-]*")


class _NoKey(CodegenError):
    """The site cannot be described without its names or node ids."""


@dataclass(frozen=True)
class SiteKey:
    key: str                  # sha256 of the description
    nodes: tuple[int, ...]    # the kernel's nodes in graph order: position -> node id


def _computation_text(comp: Computation, computations: dict[str, Computation],
                      memo: dict[str, str]) -> str:
    """A called computation as text without its names: instructions by position."""
    done = memo.get(comp.name)
    if done is not None:
        return done
    memo[comp.name] = "<recursive>"
    at = {inst.name: i for i, inst in enumerate(comp.instructions)}
    lines = []
    for inst in comp.instructions:
        attrs = _attrs_text(inst.attrs, computations, memo)
        operands = ",".join(str(at.get(o, o)) for o in inst.operands)
        lines.append(f"{inst.opcode} {inst.shape} ({operands}) {attrs} {inst.literal!r} "
                     f"{inst.parameter_number} {inst.is_root}")
    text = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    memo[comp.name] = text
    return text


def _attrs_text(attrs: dict[str, str], computations: dict[str, Computation],
                memo: dict[str, str]) -> str:
    parts = []
    for key in sorted(attrs):
        if key in IGNORED_ATTRS:
            continue
        value = attrs[key]

        def named(m: re.Match) -> str:
            comp = computations.get(m.group(0).lstrip("%"))
            return m.group(0) if comp is None else \
                "{" + _computation_text(comp, computations, memo) + "}"
        parts.append(f"{key}={_IDENT.sub(named, value)}")
    return ",".join(parts)


@dataclass(frozen=True)
class LoweringChoices:
    """What a kernel lowered outside the tuner's schedules (a GEMM chain, an attention
    backward) reads besides its members, keyed like a schedule: the planned chain
    schedule or the kind, the codegen switches, and the nodes its lowering binds beyond
    what the members show (``bound``: inputs and outputs; mapped to positions, so
    identical layers share a key, and a node outside the site gives no key)."""
    kind: str
    schedule: Any = None
    switches: tuple = ()
    bound: tuple[int, ...] = ()


def _schedule_text(obj: Any, position: dict[int, int], ids: bool = False) -> str:
    if ids:
        if isinstance(obj, int) and not isinstance(obj, bool):
            if obj not in position:
                raise _NoKey(f"schedule names node {obj}, outside the kernel")
            return f"#{position[obj]}"
        if isinstance(obj, (tuple, list, set, frozenset)):
            items = sorted(obj) if isinstance(obj, (set, frozenset)) else obj
            return "(" + ",".join(_schedule_text(v, position, True) for v in items) + ")"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj).__name__ + "(" + ",".join(
            f"{f.name}={_schedule_text(getattr(obj, f.name), position, f.name in ID_FIELDS)}"
            for f in dataclasses.fields(obj) if f.name not in SKIPPED_FIELDS) + ")"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_schedule_text(v, position) for v in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{_schedule_text(k, position)}:{_schedule_text(v, position)}"
                              for k, v in obj.items()) + "}"
    if isinstance(obj, (str, int, float, bool, type(None))):
        return repr(obj)
    raise _NoKey(f"schedule holds a {type(obj).__name__}")


def site_key(graph: OpGraph, members: frozenset[int] | set[int], schedule: Any,
             layouts: dict[int, tuple[int, ...]] | None = None, in_place: bool = False,
             memo: dict[str, str] | None = None) -> SiteKey | None:
    """The key of the kernel of ``members`` lowered with ``schedule`` (module docstring), or
    None where its lowering may depend on more than the key says. ``memo``: called
    computations' texts, shared by the sites of one graph."""
    memo = {} if memo is None else memo
    nodes = graph.nodes
    mine = set(members)
    if any(nodes[v].opcode in LOOKS_BEYOND for v in mine):
        return None
    around = set(mine)
    for v in mine:
        around.update(nodes[v].operands)
    order = tuple(sorted(around))
    position = {v: i for i, v in enumerate(order)}
    outputs = set(graph.outputs)
    lines = [f"in_place={in_place}"]
    try:
        for v in order:
            node = nodes[v]
            inst = node.instruction
            if v in mine:
                lines.append(
                    f"m {node.opcode} {node.shape} {node.op_class.value} "
                    f"({','.join(str(position[o]) for o in node.operands)}) "
                    f"written={v in outputs or any(u not in mine for u in node.users)} "
                    f"{_attrs_text(inst.attrs, graph.computations, memo)} {inst.literal!r} "
                    f"{node.index}")
            else:
                # A value read: only its buffer's shape matters, and a scalar constant's
                # value (it is inlined).
                lines.append(f"r {node.opcode} {node.shape} {node.op_class.value} "
                             f"{inst.literal if node.opcode == 'constant' else ''!r} "
                             f"{node.index}")
        lines.append(_schedule_text(schedule, position))
        lines.append(",".join(f"#{position[v]}:{tuple(layout)}"
                              for v, layout in sorted((layouts or {}).items())
                              if v in position))
    except _NoKey as exc:
        log.debug("no reuse key: %s", exc)
        return None
    return SiteKey(hashlib.sha256("\n".join(lines).encode()).hexdigest(), order)


def renamed_texts(texts: list[str], names: dict[str, str]) -> list[str]:
    """``texts`` (notes, reasons) with every node name of ``names`` replaced by its value."""
    if not texts or not names:
        return texts
    pattern = re.compile(r"(?<![\w.\-])(" + "|".join(
        re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")(?![\w.\-])")
    return [pattern.sub(lambda m: names[m.group(0)], t) for t in texts]


# Proofs kept per process (across modules): the oldest go first.
PROOFS_KEPT = 4096
_PROOFS_LOCK = threading.Lock()


def forget_proofs() -> None:
    """Drop the process's kept proofs (tests)."""
    with _PROOFS_LOCK:
        _PROOFS.clear()


# Row-layout proofs (``lower``'s index-array proof of a row part) by key, across kernels:
# a packed kernel repeats parts other kernels hold too (GPT-2's 12-layer step: 147 parts
# lowered, 23 distinct). Each entry: the proved site's nodes and names, and the proof.
_PROOFS: "OrderedDict[str, tuple[tuple[int, ...], tuple[str, ...], Any]]" = OrderedDict()


def proof_key(graph: OpGraph, members: frozenset[int], facts: tuple, written: set[int],
              what: str) -> SiteKey | None:
    """The key of a proof ``what`` about the nodes ``members`` (``site_key``'s description
    of them as a kernel), given the schedule ``facts`` it reads (ints, strings) and which
    members the kernel writes; None where ``site_key`` gives none."""
    key = site_key(graph, members, facts)
    if key is None:
        return None
    position = {v: i for i, v in enumerate(key.nodes)}
    mine = sorted(position[v] for v in written if v in members)
    text = f"{what} {key.key} written={mine}"
    return SiteKey(hashlib.sha256(text.encode()).hexdigest(), key.nodes)


def kept_proof(key: SiteKey, graph: OpGraph
               ) -> tuple[dict[int, int], dict[str, str], Any] | None:
    """The proof kept under ``key``: node ids of the site it was made for mapped to this
    site's (``key.nodes``), its names to this site's, and the proof; None if none is kept."""
    with _PROOFS_LOCK:
        kept = _PROOFS.get(key.key)
        if kept is None:
            return None
        _PROOFS.move_to_end(key.key)
    nodes, names, proof = kept
    ids = dict(zip(nodes, key.nodes))
    return ids, {a: graph.nodes[b].name for a, b in zip(names, key.nodes)}, proof


def keep_proof(key: SiteKey, graph: OpGraph, proof: Any) -> None:
    """Keep ``proof`` (made for the site ``key.nodes`` of ``graph``) under ``key``."""
    names = tuple(graph.nodes[v].name for v in key.nodes)
    with _PROOFS_LOCK:
        _PROOFS[key.key] = (key.nodes, names, proof)
        while len(_PROOFS) > PROOFS_KEPT:
            _PROOFS.popitem(last=False)
