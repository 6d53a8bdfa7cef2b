"""Kernel IR lowered once per distinct kernel: a repeated layer's kernels (XLA modules repeat
their fusions per layer; a training step's forward and backward share many) differ only by
the names of what they compute and the node ids they read and write, so one lowering is
bound to every site.

``site_key(graph, members, schedule, layouts, in_place)`` (``site_keys``) describes everything
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
digest and stitch's version; an entry that does not read back is lowered afresh. What
codegen derives from a lowering once per key (``structure``: its structure key; ``busiest``:
its busiest thread's work; ``checked``: that it passed ``Kernel.validate``) is stored with
it, written when the pass ends (``flush``), so a warm process derives nothing again: the
same key covers the code that derives them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from stitch.hlo.graph import OpGraph

from . import kir
from .errors import CodegenError
from .site_keys import forget_proofs, renamed_texts, site_key

log = logging.getLogger(__name__)

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


# Lowerings kept per process (across modules): the oldest go first.
MAX_KEPT = 4096

# The process's lowerings by key (across modules and passes), oldest first out.
_TEMPLATES: "OrderedDict[str, _Template]" = OrderedDict()
_TEMPLATES_LOCK = threading.Lock()


def forget_lowerings() -> None:
    """Drop the process's kept lowerings and proofs (tests)."""
    with _TEMPLATES_LOCK:
        _TEMPLATES.clear()
    forget_proofs()


def _disk_key(key: str) -> str:
    from .cache import CODEGEN_PACKAGES, cache_key, source_digest
    from .gpu_cache import stitch_version
    return cache_key("lowering", key, source_digest(CODEGEN_PACKAGES), stitch_version())


# What ``LoweringReuse`` derives from a lowering and stores with it: the name -> how it is
# written as JSON data and read back (a value that does not read back fails the entry).
def _thread_work_from(data: Any) -> Any:
    from .thread_work import ThreadWork
    loads, ops, block, thread = data
    return ThreadWork(float(loads), float(ops), int(block), int(thread))


_STORED: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "structure": (str, str),
    "busiest": (lambda w: [w.loads, w.ops, w.block, w.thread], _thread_work_from),
    "checked": (bool, lambda v: v is True),
}


def derived_to_data(derived: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The stored kinds of ``derived`` (per key suffix: "" the lowering's own, else an
    alias's ``how``) as JSON data."""
    return {how: {what: _STORED[what][0](value) for what, value in values.items()
                  if what in _STORED}
            for how, values in derived.items()}


def derived_from_data(data: Any) -> dict[str, dict[str, Any]]:
    """``derived_to_data``'s values read back (KeyError, TypeError or ValueError where the
    data is not that)."""
    return {str(how): {str(what): _STORED[what][1](value) for what, value in values.items()}
            for how, values in data.items()}


def template_to_bytes(template: _Template,
                      derived: dict[str, dict[str, Any]] | None = None) -> bytes:
    """A kept lowering as data: its kernel (``kir_data``), its values by position and what
    was derived from it (``derived_to_data``)."""
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
        "derived": derived_to_data(derived or {}),
    }).encode()


def template_from_bytes(payload: bytes) -> tuple[_Template, dict[str, dict[str, Any]]]:
    """``template_to_bytes``'s lowering, its nodes numbered by position, and what was
    derived from it (KirDataError where the payload is not one)."""
    from .kir_data import KirDataError, kernel_from_data
    from .lower import LoweredKernel
    try:
        data = json.loads(payload)
        derived = derived_from_data(data.get("derived", {}))
        names = tuple(str(n) for n in data["names"])
        lowered = LoweredKernel(
            kernel_from_data(data["kernel"]), [int(v) for v in data["inputs"]],
            [int(v) for v in data["outputs"]], [str(x) for x in data["schemes"]],
            [str(x) for x in data["notes"]],
            {int(o): int(i) for o, i in data["initial"]},
            {int(v): tuple(int(d) for d in layout) for v, layout in data["layouts"]},
            {names[int(i)]: int(k) for i, k in data["split_rows"]})
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise KirDataError(f"not a stored lowering: {exc}") from exc
    return _Template(lowered, tuple(range(len(names))), names), derived


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
    # Lowerings to store when the pass ends (``flush``), with the stored kinds of what was
    # derived from them; and per key read from the cache, the kinds it held.
    _unsaved: dict[str, _Template] = field(default_factory=dict)
    _held: dict[str, _Template] = field(default_factory=dict)
    _held_kinds: dict[str, int] = field(default_factory=dict)

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
                self._unsaved[key.key] = template
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
            template, derived = template_from_bytes(payload)
        except KirDataError as exc:
            log.info("stored lowering %s not used: %s", key[:12], exc)
            return None
        self.from_disk += 1
        self._keep(key, template)
        for how, values in derived.items():
            self._derived.setdefault(f"{key}/{how}" if how else key, {}).update(values)
        self._held[key] = template
        self._held_kinds[key] = sum(len(v) for v in derived.values())
        return template

    def flush(self) -> None:
        """Store the lowerings this pass made, and those read back that gained derived
        values, each with the stored kinds of what was derived from it."""
        if self.cache is None:
            return
        for key, template in self._held.items():
            kinds = sum(len(v) for v in self._stored_derived(key).values())
            if kinds > self._held_kinds.get(key, 0):
                self._unsaved.setdefault(key, template)
        for key, template in self._unsaved.items():
            self._write(key, template, self._stored_derived(key))
        self._unsaved.clear()
        self._held.clear()

    def _stored_derived(self, key: str) -> dict[str, dict[str, Any]]:
        """What was derived from the lowering of ``key`` and its aliases (``alias``), the
        stored kinds only, per alias ``how`` ("" the lowering's own)."""
        out = {}
        for how, name in [("", key)] + [(k[len(key) + 1:], k) for k in self._derived
                                        if k.startswith(key + "/")]:
            values = {w: v for w, v in self._derived.get(name, {}).items() if w in _STORED}
            if values:
                out[how] = values
        return out

    def _write(self, key: str, template: _Template,
               derived: dict[str, dict[str, Any]]) -> None:
        from .kir_data import KirDataError
        try:
            payload = template_to_bytes(template, derived)
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

    def structure(self, kernel: kir.Kernel) -> str:
        """``gpu_cache.structure_key(kernel)``, once per lowering (stored with it)."""
        from .gpu_cache import structure_key
        return self.derived(kernel, "structure", lambda: structure_key(kernel))

    def busiest(self, kernel: kir.Kernel) -> Any:
        """``thread_work.busiest_thread(kernel)``, once per lowering (stored with it)."""
        from .thread_work import busiest_thread
        return self.derived(kernel, "busiest", lambda: busiest_thread(kernel))

    def checked(self, kernel: kir.Kernel) -> kir.Kernel:
        """``kernel.validate()``, walked once per lowering: a kernel of a lowering that
        passed (here or, stored with it, in the process that lowered it) is marked so
        (``Kernel.known_valid``). CodegenError as ``validate`` raises it."""
        got = self._key_of.get(id(kernel))
        if got is None or got[0] is not kernel:
            return kernel.validate()
        derived = self._derived.setdefault(got[1], {})
        if derived.get("checked") is True:
            return kernel.known_valid()
        kernel.validate()
        derived["checked"] = True
        return kernel

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
