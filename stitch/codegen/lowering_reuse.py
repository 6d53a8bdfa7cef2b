"""Kernel IR lowered once per distinct kernel: a repeated layer's kernels (XLA modules repeat
their fusions per layer; a training step's forward and backward share many) differ only by
the names of what they compute and the node ids they read and write, so one lowering is
bound to every site.

``site_key(graph, members, schedule, layouts, in_place)`` describes everything
``lower.lower_kernel`` reads of a kernel's site, with node ids replaced by their position
among the kernel's nodes (its members and the values they read, in graph order) and names
left out: opcodes, shapes and layouts, attributes (``metadata`` left out; called
computations by their canonical text), constants' literals, which members the kernel
writes (the graph returns them or readers outside the kernel read them), the schedule with
its node ids mapped, the buffers' layouts and ``in_place``. Sites whose kernels read values
beyond their own nodes (gathers, scatters and dynamic slices look at where their indices
come from) get no key and are lowered as ever.

``LoweringReuse.lower`` lowers the first site of a key and binds that lowering to each
later one (``bind``): the kernel renamed, its inputs, outputs, in-place pairs, layouts and
split rows mapped to the site's node ids. The parameters keep the first site's names: PTX
and the FFI bind parameters by position (NVPTX names them ``<entry>_param_<i>``), and a
structure key (``gpu_cache.structure_key``) replaces them by position anyway. The binding
is checked against the site where that is cheap: each parameter's element count against
the node it is bound to. Global scratch buffers keep the first site's names too (module
globals of the kernel's own loaded image).

Lowerings are kept per process (``MAX_KEPT``, across modules) and, given a compile cache,
across processes: stored as data (``kir_data``: JSON of Kernel IR's own dataclasses, the
site's values by position), keyed by the site key, codegen's and the HLO layer's source
digest and stitch's version; an entry that does not read back is lowered afresh.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from stitch.hlo_passes.graph import OpGraph
from stitch.hlo_passes.ir import Computation

from . import kir
from .errors import CodegenError

log = logging.getLogger(__name__)

# Ops whose lowering looks past the kernel's own nodes (index values known from their
# producers, scatter forms): their kernels are lowered per site.
LOOKS_BEYOND = frozenset({"gather", "scatter", "dynamic-slice", "dynamic-update-slice"})

# Attributes that do not change what an instruction computes.
IGNORED_ATTRS = frozenset({"metadata"})

# Schedule fields that hold node ids (KernelSchedule, PartSchedule, GroupSchedule,
# SharedBuffer, GlobalReduction); ``rejected`` is the tuner's notes, not the schedule.
ID_FIELDS = frozenset({"members", "root", "node", "cached"})
SKIPPED_FIELDS = frozenset({"rejected"})

# Lowerings kept per process (across modules): the oldest go first.
MAX_KEPT = 4096

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


def bind(template: Any, template_nodes: tuple[int, ...], template_names: tuple[str, ...],
         nodes: tuple[int, ...], graph: OpGraph, name: str) -> Any:
    """``template`` (a ``LoweredKernel`` of the site ``template_nodes``, whose nodes are
    called ``template_names``) bound to the site ``nodes`` of ``graph`` with the same key,
    as the kernel called ``name`` (a Kernel IR identifier)."""
    to_site = dict(zip(template_nodes, nodes))
    names = {a: graph.nodes[b].name for a, b in zip(template_names, nodes)}
    inputs = [to_site[v] for v in template.inputs]
    outputs = [to_site[v] for v in template.outputs]
    kernel = template.kernel.renamed(name)
    check_params(kernel, inputs + outputs, graph)
    notes = renamed_texts(list(template.notes), names)
    return dataclasses.replace(
        template, kernel=kernel, inputs=inputs, outputs=outputs,
        schemes=list(template.schemes), notes=notes,
        initial={to_site[o]: to_site[i] for o, i in template.initial.items()},
        layouts={to_site[v]: layout for v, layout in template.layouts.items()},
        split_rows={names[n]: k for n, k in template.split_rows.items()})


def renamed_texts(texts: list[str], names: dict[str, str]) -> list[str]:
    """``texts`` (notes, reasons) with every node name of ``names`` replaced by its value."""
    if not texts or not names:
        return texts
    pattern = re.compile(r"(?<![\w.\-])(" + "|".join(
        re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")(?![\w.\-])")
    return [pattern.sub(lambda m: names[m.group(0)], t) for t in texts]


def check_params(kernel: kir.Kernel, bound: list[int], graph: OpGraph) -> None:
    """Each parameter's element count against the node it is bound to (the key makes them
    equal; a wrong binding would read or write out of bounds)."""
    from .values import leaf
    if len(bound) != len(kernel.params):
        raise CodegenError(f"kernel {kernel.name}: {len(kernel.params)} parameters bound to "
                           f"{len(bound)} values")
    for p, v in zip(kernel.params, bound):
        elements = max(leaf(graph.nodes[v].shape).num_elements, 1)
        if p.size != elements:
            raise CodegenError(f"kernel {kernel.name}: parameter {p.name} of {p.size} "
                               f"elements bound to {graph.nodes[v].name} of {elements}")


@dataclass(frozen=True)
class _Template:
    lowered: Any
    nodes: tuple[int, ...]
    names: tuple[str, ...]


# The process's lowerings by key (across modules and passes), oldest first out.
_TEMPLATES: "OrderedDict[str, _Template]" = OrderedDict()
_TEMPLATES_LOCK = threading.Lock()


def forget_lowerings() -> None:
    """Drop the process's kept lowerings and row-layout proofs (tests)."""
    with _TEMPLATES_LOCK:
        _TEMPLATES.clear()
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


def kept_proof(key: SiteKey, graph: OpGraph) -> tuple[dict[int, int], dict[str, str], Any] | None:
    """The proof kept under ``key``: node ids of the site it was made for mapped to this
    site's (``key.nodes``), its names to this site's, and the proof; None if none is kept."""
    with _TEMPLATES_LOCK:
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
    with _TEMPLATES_LOCK:
        _PROOFS[key.key] = (key.nodes, names, proof)
        while len(_PROOFS) > MAX_KEPT:
            _PROOFS.popitem(last=False)


def _disk_key(key: str) -> str:
    from .cache import CODEGEN_PACKAGES, cache_key, source_digest
    from .gpu_cache import stitch_version
    return cache_key("lowering", key, source_digest(CODEGEN_PACKAGES), stitch_version())


def template_to_bytes(template: _Template) -> bytes:
    """A kept lowering as data: its kernel (``kir_data``) and its values by position."""
    from .kir_data import kernel_to_data
    lowered = template.lowered
    at = {v: i for i, v in enumerate(template.nodes)}
    at_name = {n: i for i, n in enumerate(template.names)}
    return json.dumps({
        "kernel": kernel_to_data(lowered.kernel), "names": list(template.names),
        "inputs": [at[v] for v in lowered.inputs], "outputs": [at[v] for v in lowered.outputs],
        "schemes": list(lowered.schemes), "notes": list(lowered.notes),
        "initial": [[at[o], at[i]] for o, i in lowered.initial.items()],
        "layouts": [[at[v], list(layout)] for v, layout in lowered.layouts.items()],
        "split_rows": [[at_name[n], k] for n, k in lowered.split_rows.items()],
    }).encode()


def template_from_bytes(payload: bytes) -> _Template:
    """``template_to_bytes``'s lowering, its nodes numbered by position (KirDataError where
    the payload is not one)."""
    from .kir_data import KirDataError, kernel_from_data
    from .lower import LoweredKernel
    try:
        data = json.loads(payload)
        names = tuple(str(n) for n in data["names"])
        lowered = LoweredKernel(
            kernel_from_data(data["kernel"]), [int(v) for v in data["inputs"]],
            [int(v) for v in data["outputs"]], [str(x) for x in data["schemes"]],
            [str(x) for x in data["notes"]],
            {int(o): int(i) for o, i in data["initial"]},
            {int(v): tuple(int(d) for d in layout) for v, layout in data["layouts"]},
            {names[int(i)]: int(k) for i, k in data["split_rows"]})
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise KirDataError(f"not a stored lowering: {exc}") from exc
    return _Template(lowered, tuple(range(len(names))), names)


@dataclass
class LoweringReuse:
    """One pass's lowerings through the process's kept ones (module docstring).
    ``enabled`` False lowers every site (what a test compares against); ``cache``: a
    ``CompileCache`` lowerings are stored in and read from across processes."""
    enabled: bool = True
    cache: Any = None
    lowered: int = 0          # sites lowered
    reused: int = 0           # sites bound to an earlier lowering
    from_disk: int = 0        # of those, lowerings read from the compile cache
    # Called computations' texts per module (the computations dict, held so its id stays
    # its own).
    _memo: dict[int, tuple[dict, dict[str, str]]] = field(default_factory=dict)
    # A lowered kernel -> its key, and per key what was derived from its lowering once.
    _key_of: dict[int, tuple[kir.Kernel, str]] = field(default_factory=dict)
    _derived: dict[str, dict[str, Any]] = field(default_factory=dict)

    def lower(self, graph: OpGraph, members: frozenset[int], schedule: Any, name: str,
              lower: Callable[[], Any], layouts: dict | None = None,
              in_place: bool = False) -> Any:
        """``lower()``'s result for this site (``name``: the kernel identifier), from an
        earlier site of the same key where there is one."""
        key = None
        if self.enabled:
            held = self._memo.get(id(graph.computations))
            if held is None or held[0] is not graph.computations:
                held = self._memo[id(graph.computations)] = (graph.computations, {})
            key = site_key(graph, members, schedule, layouts, in_place, held[1])
        if key is not None:
            with _TEMPLATES_LOCK:
                kept = _TEMPLATES.get(key.key)
                if kept is not None:
                    _TEMPLATES.move_to_end(key.key)
            if kept is None and self.cache is not None:
                kept = self._read(key.key)
            if kept is not None:
                bound = bind(kept.lowered, kept.nodes, kept.names, key.nodes, graph, name)
                self.reused += 1
                self._key_of[id(bound.kernel)] = (bound.kernel, key.key)
                return bound
        result = lower()
        self.lowered += 1
        if key is not None:
            template = _Template(result, key.nodes,
                                 tuple(graph.nodes[v].name for v in key.nodes))
            self._keep(key.key, template)
            if self.cache is not None:
                self._write(key.key, template)
            self._key_of[id(result.kernel)] = (result.kernel, key.key)
        return result

    @staticmethod
    def _keep(key: str, template: _Template) -> None:
        with _TEMPLATES_LOCK:
            _TEMPLATES[key] = template
            while len(_TEMPLATES) > MAX_KEPT:
                _TEMPLATES.popitem(last=False)

    def _read(self, key: str) -> _Template | None:
        from .kir_data import KirDataError
        payload = self.cache.get(_disk_key(key))
        if payload is None:
            return None
        try:
            template = template_from_bytes(payload)
        except KirDataError as exc:
            log.info("stored lowering %s not used: %s", key[:12], exc)
            return None
        self.from_disk += 1
        self._keep(key, template)
        return template

    def _write(self, key: str, template: _Template) -> None:
        from .kir_data import KirDataError
        try:
            payload = template_to_bytes(template)
        except (KirDataError, KeyError) as exc:
            log.debug("lowering %s not stored: %s", key[:12], exc)
            return
        self.cache.put(_disk_key(key), payload)

    def alias(self, kernel: kir.Kernel, lowered: kir.Kernel, how: str) -> None:
        """``kernel`` is ``lowered`` changed the same way (``how``) at every site: what is
        derived from it is shared per lowering too."""
        got = self._key_of.get(id(lowered))
        if got is not None and got[0] is lowered:
            self._key_of[id(kernel)] = (kernel, f"{got[1]}/{how}")

    def derived(self, kernel: kir.Kernel, what: str, make: Callable[[], Any]) -> Any:
        """``make()`` (something of the kernel its names do not change: its structure key,
        its busiest thread's work), once per key in this pass."""
        got = self._key_of.get(id(kernel))
        if got is None or got[0] is not kernel:
            return make()
        derived = self._derived.setdefault(got[1], {})
        if what not in derived:
            derived[what] = make()
        return derived[what]
