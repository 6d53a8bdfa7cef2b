"""Put stitched kernels into XLA's own module: what each kernel covers becomes one typed-FFI
custom call; everything else stays exactly as XLA made it.

The planner works on op graphs (``stitch.hlo.graph``), where XLA's fusions are flattened
into their ops. A stitched kernel can go back into the module when its ops are a union of
whole *top-level* instructions of one computation (XLA fusions or unfused ops): those
instructions are removed, one ``custom-call(...), custom_call_target=T,
api_version=API_VERSION_TYPED_FFI`` takes the kernel's inputs (the values XLA already
computes: parameters, other instructions' results, tuple elements of multi-output fusions)
and returns the kernel's outputs as a tuple, and each removed instruction that is read
outside the kernel is replaced by an instruction *of the same name* reading the custom
call (a ``get-tuple-element``, or a ``tuple`` of them for a multi-output fusion), so no
other instruction changes. A kernel that splits an XLA fusion, reads ops inlined from a
called computation, or would read or write a buffer in another layout than XLA assigned it
(``xla_layouts``: the kernel is lowered with XLA's layouts) is left to XLA, with the reason.

Kernels that only re-do one XLA kernel are not placed (``same as XLA``): the point of the
pass is to launch fewer, larger kernels than XLA.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import re
from typing import Sequence
from dataclasses import dataclass, field

from stitch.hlo import HloModule
from stitch.hlo.graph import FREE_OPCODES, OpGraph
from stitch.hlo.ir import Computation, Instruction, Shape
from stitch.hlo.loop_state import carried_bytes
from stitch.hlo.op_classes import OpClass

log = logging.getLogger("stitch.hlo_rewrite")


@dataclass
class KernelSite:
    """Where one planned kernel sits in the module, once it is known to fit."""
    name: str                      # the plan's kernel name
    graph_index: int
    members: frozenset[int]
    tops: tuple[str, ...]          # the top-level instructions it replaces, module order


@dataclass
class PlacedKernel:
    """A built kernel to put at its site: ``inputs``/``outputs`` are graph node ids in the
    kernel's parameter order, ``target`` the registered FFI target name."""
    site: KernelSite
    inputs: list[int]
    outputs: list[int]
    target: str
    # Outputs whose buffer must start as a copy of an input (output node -> input node,
    # codegen's ``LoweredKernel.initial``: a scatter adding colliding updates atomically in
    # place). The call's output aliases that operand (``_in_place_operands``).
    initial: dict[int, int] = field(default_factory=dict)
    # Params the kernel reads or writes in a layout other than row-major (node -> logical
    # dims, major to minor: codegen's ``LoweredKernel.layouts``). A buffer XLA laid out
    # otherwise is placed only where the kernel uses exactly XLA's layout for it.
    layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class RewriteReport:
    placed: list[str] = field(default_factory=list)              # kernel names
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (kernel name, reason)
    # Copies the placed kernels added: (kernel name, graph index, bytes).
    copies: list[tuple[str, int, int]] = field(default_factory=list)
    # XLA kernels nothing reads once the placed ones are in (the ids and fills a segment
    # reduction no longer needs): dropped here, as XLA's dead-code pass would.
    dead_kernels: list[str] = field(default_factory=list)


class NotPlaceable(Exception):
    """Internal: why a kernel cannot go into the module (becomes a skip reason)."""


class _Cycle(NotPlaceable):
    """The instructions have a cycle: ``stuck`` are those on one or after one."""

    def __init__(self, message: str, stuck: list[str]):
        super().__init__(message)
        self.stuck = stuck


class ComputationView:
    """One op graph seen against the computation it came from."""

    def __init__(self, module: HloModule, graph: OpGraph):
        self.module = module
        self.graph = graph
        self.comp: Computation = module.computation(graph.name)
        self.table = self.comp.by_name()
        self.position = {inst.name: i for i, inst in enumerate(self.comp.instructions)}
        # Made on first use, again when the lists they were made from are replaced:
        # ``fused_root``'s computations by name, ``readers``' index.
        self._computations: tuple[list[Computation], dict[str, Computation]] | None = None
        self._readers: tuple[list[Instruction], dict[str, list[str]]] | None = None
        self.group_ops: dict[str, set[int]] = {}
        for node in graph.nodes:
            top = self.top_of(node.id)
            if top is not None and node.op_class is not OpClass.SOURCE:
                self.group_ops.setdefault(top, set()).add(node.id)

    def top_of(self, nid: int) -> str | None:
        """The top-level instruction of the computation holding node ``nid`` (None for ops
        inlined from a called computation)."""
        node = self.graph.nodes[nid]
        if node.xla_group is not None and node.xla_group in self.table:
            return node.xla_group
        if node.computation == self.comp.name and node.instruction.name in self.table:
            return node.instruction.name
        return None

    def is_top(self, nid: int) -> bool:
        """Node ``nid`` is itself a top-level instruction (not inside a fusion). Compared by
        name: a cached plan's graph holds the instructions of an equal, earlier module."""
        node = self.graph.nodes[nid]
        return (node.computation == self.comp.name and node.instruction.name in self.table
                and self.top_of(nid) == node.instruction.name)

    def launches(self, top: str) -> bool:
        inst = self.table[top]
        return inst.opcode not in FREE_OPCODES and inst.opcode not in ("parameter", "constant")

    def readers(self) -> dict[str, list[str]]:
        """Instruction name -> the names of the computation's instructions reading it, once
        per reading operand, in module order (made once, not per kernel: ``find_site``)."""
        instructions = self.comp.instructions
        if self._readers is None or self._readers[0] is not instructions:
            readers: dict[str, list[str]] = {}
            for inst in instructions:
                for o in inst.operands:
                    readers.setdefault(o, []).append(inst.name)
            self._readers = (instructions, readers)
        return self._readers[1]

    def fused_root(self, top: str) -> Instruction | None:
        inst = self.table[top]
        if inst.opcode != "fusion" or not inst.called_computations:
            return None
        computations = self.module.computations
        if self._computations is None or self._computations[0] is not computations:
            self._computations = (computations, {c.name: c for c in computations})
        name = inst.called_computations[0].lstrip("%")
        comp = self._computations[1].get(name)
        return (comp if comp is not None else self.module.computation(name)).root


def find_site(view: ComputationView, graph_index: int, name: str,
              members: frozenset[int], alone: bool = False) -> KernelSite:
    """The instructions a kernel replaces, or NotPlaceable with the reason. ``alone``: one
    launching instruction is enough (its planned body differs from XLA's, e.g. segments as
    rows instead of atomics)."""
    ops = [m for m in members if view.graph.nodes[m].op_class is not OpClass.SOURCE]
    tops: set[str] = set()
    for m in ops:
        top = view.top_of(m)
        if top is None:
            raise NotPlaceable(f"op {view.graph.nodes[m].name} is inlined from a called "
                               "computation")
        tops.add(top)
    for top in tops:
        missing = view.group_ops.get(top, set()) - members
        if missing:
            raise NotPlaceable(f"covers part of XLA's {top} ({len(missing)} of its ops "
                               "are elsewhere)")
    tops |= _unread_by_plan(view, tops)
    launching = [t for t in tops if view.launches(t)]
    if len(launching) < (1 if alone else 2):
        raise NotPlaceable("same as XLA's kernel" + (f" {launching[0]}" if launching else ""))
    return KernelSite(name, graph_index, members,
                      tuple(sorted(tops, key=view.position.__getitem__)))


def _unread_by_plan(view: ComputationView, tops: set[str]) -> set[str]:
    """Top-level instructions that go with a kernel of ``tops`` although it holds none of
    their ops: every reader of theirs is replaced, and the planned graph reads none of their
    values (a module planned with segments as rows no longer reads XLA's id and mask
    fusions; left in, they would read instructions the kernel removes, and still run)."""
    readers = view.readers()
    chosen = set(tops)
    extra: set[str] = set()
    stack = [o for t in tops for o in view.table[t].operands]
    while stack:
        name = stack.pop()
        inst = view.table.get(name)
        if inst is None or name in chosen or inst.is_root or not _pure(inst):
            continue
        # Absent from the planned graph (dropped there as unread), or its ops read only
        # by each other.
        ops = view.group_ops.get(name, set())
        if any(u not in ops for n in ops for u in view.graph.nodes[n].users):
            continue
        if all(r in chosen for r in readers.get(name, [])):
            chosen.add(name)
            extra.add(name)
            stack.extend(inst.operands)
    return extra


def _pure(inst: Instruction) -> bool:
    """An instruction whose only effect is its value (XLA's loop and input fusions and data
    movement): dropping it where nothing reads its value changes nothing else."""
    if inst.opcode == "fusion":
        return inst.attrs.get("kind", "").strip() in ("kLoop", "kInput")
    return inst.opcode in ("bitcast", "copy", "broadcast", "reshape", "iota")


def buffer_layout(shape: Shape) -> tuple[int, ...] | None:
    """An array's layout as codegen's ``layouts`` take it (the logical dims, major to
    minor: XLA's minor_to_major reversed), None where it is row-major."""
    order = tuple(reversed(shape.minor_to_major()))
    return None if order == tuple(range(shape.rank)) else order


def xla_layouts(graph: OpGraph, members: frozenset[int]) -> dict[int, tuple[int, ...]]:
    """The layouts XLA assigned to the buffers a kernel of ``members`` may read or write
    (its members and their operands; the rest codegen ignores): node -> logical dims major
    to minor, row-major ones left out. The kernel loads and stores them in place (the
    rewrite checks each buffer it wires against them, ``_layout_problem``)."""
    out: dict[int, tuple[int, ...]] = {}
    for v in set(members) | {o for m in members for o in graph.nodes[m].operands}:
        shape = graph.nodes[v].shape
        if shape.is_tuple:
            continue
        layout = buffer_layout(shape)
        if layout is not None:
            out[v] = layout
    return out


def _layout_problem(kind: str, name: str, shape: Shape, kernel: "PlacedKernel",
                    nid: int) -> str | None:
    """Why the kernel cannot take this buffer (a tuple, or a layout it does not use)."""
    if shape.is_tuple:
        return f"{kind} {name} is a tuple ({shape})"
    want = buffer_layout(shape)
    if kernel.layouts.get(nid) != want:
        return (f"{kind} {name} is laid out {shape.layout} but the kernel "
                f"{'reads' if kind == 'input' else 'writes'} it "
                f"{'row-major' if nid not in kernel.layouts else kernel.layouts[nid]}")
    return None


def carried_copy_bytes(view: ComputationView, site: KernelSite) -> int:
    """Bytes of the copies ``place`` will add for ``site`` in a loop body: each value the
    kernel writes for the loop state (the root's operands) goes through a copy (``place``'s
    ``carried``). 0 outside loop bodies. The prediction is ``stitch.hlo.loop_state``'s, the
    one the planner prices kernels with."""
    return carried_bytes(view.graph, site.members)


class _Builder:
    """Edits one computation: new instructions get fresh names. Keeps who reads what (the
    computation's instructions and the added ones, ``users_outside``) and an undo log of the
    instructions it changed (``retarget``), so that placing a kernel costs its own size, not
    the computation's."""

    def __init__(self, module: HloModule, view: ComputationView):
        self.view = view
        self.names = {inst.name for _, inst in module.instructions()}
        self.added: list[tuple[Instruction, float]] = []   # (instruction, sort position)
        # Bytes of each copy the kernels placed here add (a loop's carried values, an
        # in-place operand): (kernel name, bytes); the pass prices them (delivered.py).
        self.copies: list[tuple[str, int]] = []
        # (instruction, opcode, operands, attrs) before ``retarget`` changed it, oldest first.
        self.undo: list[tuple[Instruction, str, list[str], dict[str, str]]] = []
        self.root = view.comp.root
        self._carried: tuple[list[str] | None, frozenset[str]] = (None, frozenset())
        self.index_readers()

    @property
    def carried(self) -> frozenset[str]:
        """In a loop body the values the root returns (``place``'s ``carried``); made again
        only when the root's operands were changed."""
        if self.view.graph.kind == "entry":
            return frozenset()
        if self._carried[0] is not self.root.operands:
            self._carried = (self.root.operands, frozenset(self.root.operands))
        return self._carried[1]

    def index_readers(self) -> None:
        """Index the computation's instructions by the names they read (again after its
        instructions were replaced or restored). Readers are keyed by their place: the
        computation's own by position, the added ones after them in the order added."""
        self.base = len(self.view.comp.instructions)
        self.readers: dict[str, list[tuple[int, Instruction]]] = {}
        # id -> key of the added instructions (an id may be stale: its instruction undone).
        self.added_keys: dict[int, int] = {}
        for i, inst in enumerate(self.view.comp.instructions):
            self._index(i, inst)
        for i, (inst, _) in enumerate(self.added):
            self.added_keys[id(inst)] = self.base + i
            self._index(self.base + i, inst)

    def _index(self, key: int, inst: Instruction) -> None:
        for o in inst.operands:
            self.readers.setdefault(o, []).append((key, inst))

    def users_outside(self, top: str, tops: set[str]) -> list[Instruction]:
        """Readers of ``top`` outside ``tops``: the computation's instructions, then the
        added ones (the gtes an earlier placed kernel made to read an element of ``top``),
        each in order. The index may hold readers no longer there (undone, retargeted):
        each is checked against what it reads now."""
        found: dict[int, Instruction] = {}
        for key, inst in self.readers.get(top, ()):
            if key in found or inst.name in tops or top not in inst.operands:
                continue
            if key >= self.base:
                at = key - self.base
                if at >= len(self.added) or self.added[at][0] is not inst:
                    continue
            found[key] = inst
        return [found[key] for key in sorted(found)]

    def retarget(self, inst: Instruction, opcode: str, operands: list[str],
                 attrs: dict[str, str]) -> None:
        """Change an instruction in place, logged for ``rollback``."""
        self.undo.append((inst, inst.opcode, inst.operands, inst.attrs))
        inst.opcode, inst.operands, inst.attrs = opcode, operands, attrs
        key = self.view.position.get(inst.name)
        if key is None or key >= self.base or self.view.comp.instructions[key] is not inst:
            key = self.added_keys[id(inst)]
        self._index(key, inst)

    def rollback(self, added: int, copies: int, undo: int) -> None:
        """Back to when ``added``, ``copies`` and ``undo`` were the logs' lengths (the
        names taken since stay taken)."""
        del self.added[added:]
        del self.copies[copies:]
        for inst, opcode, operands, attrs in reversed(self.undo[undo:]):
            inst.opcode, inst.operands, inst.attrs = opcode, operands, attrs
        del self.undo[undo:]

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}.{i}"
        self.names.add(name)
        return name

    def add(self, inst: Instruction, position: float) -> str:
        self.added.append((inst, position))
        key = self.added_keys[id(inst)] = self.base + len(self.added) - 1
        self._index(key, inst)
        return inst.name

    def gte(self, source: str, shape: Shape, index: int, position: float) -> str:
        inst = Instruction(self.fresh(f"{source}.gte{index}"), shape, "get-tuple-element",
                           [source], {"index": str(index)})
        return self.add(inst, position)


def _input_value(view: ComputationView, b: _Builder, nid: int) -> tuple[str, Shape]:
    """(instruction name, shape) carrying node ``nid``'s value in the computation."""
    node = view.graph.nodes[nid]
    inst = node.instruction
    if node.op_class is OpClass.SOURCE and inst.opcode == "parameter":
        if node.computation != view.comp.name:
            raise NotPlaceable(f"reads parameter {inst.name} of another computation")
        name, shape = inst.name, inst.shape
        for i in node.index:
            shape = shape.tuple_shapes[i]
            name = b.gte(name, shape, i, view.position[inst.name] + 0.5)
        return name, shape
    if node.op_class is OpClass.SOURCE and inst.opcode == "constant":
        if node.computation == view.comp.name and inst.name in view.table:
            return inst.name, inst.shape
        copy = Instruction(b.fresh(inst.name), inst.shape, "constant", [], dict(inst.attrs),
                           literal=inst.literal)
        return b.add(copy, -1.0), inst.shape
    top = view.top_of(nid)
    if top is None:
        raise NotPlaceable(f"reads {node.name}, inlined from a called computation")
    top_inst = view.table[top]
    if view.is_top(nid):
        return top, top_inst.shape
    root = view.fused_root(top)
    if root is not None and root.name == inst.name:
        return top, top_inst.shape
    if root is not None and root.opcode == "tuple" and inst.name in root.operands:
        index = root.operands.index(inst.name)
        return b.gte(top, top_inst.shape.tuple_shapes[index], index,
                     view.position[top] + 0.5), top_inst.shape.tuple_shapes[index]
    raise NotPlaceable(f"reads {node.name}, which XLA's {top} does not output")


def _output_keys(view: ComputationView, nid: int) -> list[tuple[str, int | None]]:
    """The (top-level instruction, tuple index or None) values node ``nid`` is."""
    node = view.graph.nodes[nid]
    top = view.top_of(nid)
    if top is None:
        return []
    if view.is_top(nid):
        return [(top, None)]
    root = view.fused_root(top)
    if root is not None and root.name == node.instruction.name:
        return [(top, None)]
    if root is not None and root.opcode == "tuple":
        return [(top, j) for j, op in enumerate(root.operands) if op == node.instruction.name]
    return []


@dataclass(frozen=True)
class _Export:
    """A value an earlier placed kernel's call returns: element ``index`` of ``call``."""
    call: str
    index: int
    shape: Shape
    position: float


def _exported_input(view: ComputationView, b: _Builder, nid: int,
                    exported: dict[tuple[str, int | None], _Export]) -> tuple[str, Shape]:
    """Node ``nid``'s value read from the earlier kernel that replaced its instruction (a
    multi-output fusion whose element readers were retargeted to that kernel's call leaves
    no instruction of its name behind)."""
    for key in _output_keys(view, nid):
        if key in exported:
            e = exported[key]
            return b.gte(e.call, e.shape, e.index, e.position + 0.5), e.shape
    raise NotPlaceable(f"reads {view.top_of(nid)}, which an earlier stitched kernel "
                       f"replaced without writing {view.graph.nodes[nid].name}")


def place(view: ComputationView, b: _Builder, kernel: PlacedKernel,
          removed: set[str], replaced: dict[str, Instruction] | None = None,
          exported: dict[tuple[str, int | None], _Export] | None = None
          ) -> tuple[dict[str, Instruction], dict[tuple[str, int | None], _Export]]:
    """Add the kernel's custom call; return the replacement instruction per removed name
    (and mutate gte users in place) and the values the call returns. ``exported``: the
    values earlier placed kernels' calls return, keyed like ``_output_keys`` (a later kernel
    reads them there). Raises NotPlaceable without changing anything visible (the builder's
    additions are dropped by the caller on failure)."""
    site = kernel.site
    if set(site.tops) & removed:
        raise NotPlaceable("overlaps a kernel already placed (recomputed ops)")
    position = max(view.position[t] for t in site.tops)
    operands: list[str] = []
    for nid in kernel.inputs:
        source = view.top_of(nid)
        if source in removed and source not in (replaced or {}):
            name, shape = _exported_input(view, b, nid, exported or {})
        else:
            name, shape = _input_value(view, b, nid)
        problem = _layout_problem("input", name, shape, kernel, nid)
        if problem:
            raise NotPlaceable(problem)
        operands.append(name)
    # A member the kernel reads from memory (a gte of XLA's tuple all-reduce) stays in the
    # module: the call takes it as an operand.
    site.tops = tuple(t for t in site.tops if t not in operands)
    tops = set(site.tops)
    out_index: dict[tuple[str, int | None], int] = {}
    out_shapes: list[Shape] = []
    for j, nid in enumerate(kernel.outputs):
        keys = _output_keys(view, nid)
        if not keys:
            raise NotPlaceable(f"output {view.graph.nodes[nid].name} is not a value of "
                               "XLA's instructions")
        top, index = keys[0]
        shape = view.table[top].shape if index is None else view.table[top].shape.tuple_shapes[index]
        problem = _layout_problem("output", top, shape, kernel, nid)
        if problem:
            raise NotPlaceable(problem)
        out_shapes.append(shape)
        for key in keys:
            out_index.setdefault(key, j)
    call_name = b.fresh(f"stitch.{site.name}")
    attrs = {"custom_call_target": f'"{kernel.target}"', "api_version": "API_VERSION_TYPED_FFI"}
    aliasing = _in_place_operands(view, b, kernel, operands, position)
    if aliasing:
        attrs["output_to_operand_aliasing"] = aliasing
    call = Instruction(call_name, Shape("tuple", tuple_shapes=tuple(out_shapes)), "custom-call",
                       operands, attrs)
    b.add(call, position)
    exports = {key: _Export(call_name, j, out_shapes[j], position)
               for key, j in out_index.items()}

    replacements: dict[str, Instruction] = {}
    retargets: list[tuple[Instruction, int]] = []
    # In a loop body the root's operands live in the loop-state buffers, which the custom
    # call also reads: XLA's copy insertion has already run, so a value the kernel writes for
    # the root goes through a copy again (without it the kernel wrote into buffers it was
    # reading: dien_train's GRU loop drifted by 2e-4).
    carried = b.carried

    def value(name: str, shape: Shape, index: int, is_root: bool = False) -> Instruction:
        if name not in carried:
            return Instruction(name, shape, "get-tuple-element", [call_name],
                               {"index": str(index)}, is_root=is_root)
        part = b.gte(call_name, shape, index, position + 0.5)
        b.copies.append((site.name, shape.byte_size))
        return Instruction(name, shape, "copy", [part], is_root=is_root)

    dead_gtes: list[str] = []
    for top in site.tops:
        inst = view.table[top]
        # Readers an earlier placed kernel removed are gone (that kernel's call, if it
        # reads the value, is among the added readers).
        users = [u for u in b.users_outside(top, tops) if u.name not in removed]
        # A gte of a replaced multi-output fusion read only by replaced instructions goes
        # with them (the op graph has no gte nodes, so no kernel writes its element).
        dead = [u for u in users if u.opcode == "get-tuple-element" and not u.is_root
                and u.name in view.table and u.name not in carried
                and not b.users_outside(u.name, tops)]
        dead_gtes.extend(u.name for u in dead)
        users = [u for u in users if u not in dead]
        whole_needed = inst.is_root or any(u.opcode != "get-tuple-element" for u in users)
        if not users and not inst.is_root:
            continue
        if not inst.shape.is_tuple:
            if (top, None) not in out_index:
                raise NotPlaceable(f"{top} is read outside but the kernel does not write it")
            replacements[top] = value(top, inst.shape, out_index[(top, None)], inst.is_root)
            continue
        if whole_needed:
            parts = []
            for j, shape in enumerate(inst.shape.tuple_shapes):
                if (top, j) not in out_index:
                    raise NotPlaceable(f"element {j} of {top} is read but not written")
                part = b.gte(call_name, shape, out_index[(top, j)], position + 0.5)
                if top in carried:
                    part = b.add(Instruction(b.fresh(f"{part}.copy"), shape, "copy", [part]),
                                 position + 0.6)
                    b.copies.append((site.name, shape.byte_size))
                parts.append(part)
            replacements[top] = Instruction(top, inst.shape, "tuple", parts,
                                            is_root=inst.is_root)
            continue
        for user in users:
            index = user.int("index")
            if (top, index) not in out_index:
                raise NotPlaceable(f"element {index} of {top} is read but not written")
            retargets.append((user, out_index[(top, index)]))
    site.tops = site.tops + tuple(dead_gtes)
    # The only instructions changed in place (``_Builder.retarget`` logs them for undo).
    for user, j in retargets:
        if user.name in carried:
            part = b.gte(call_name, user.shape, j, position + 0.5)
            b.retarget(user, "copy", [part], {})
            b.copies.append((site.name, user.shape.byte_size))
        else:
            b.retarget(user, user.opcode, [call_name], {**user.attrs, "index": str(j)})
    return replacements, exports


def _in_place_operands(view: ComputationView, b: _Builder, kernel: PlacedKernel,
                       operands: list[str], position: float) -> str:
    """For each output that starts as a copy of an input (``PlacedKernel.initial``), return
    the call's ``output_to_operand_aliasing`` text (e.g. ``{{0}: (2, {})}``): XLA then hands
    the kernel that operand's buffer as the output's. The operand is the input itself where
    nothing else can see the buffer change (``_private_buffer``), else a fresh ``copy``."""
    pairs = []
    tops = set(kernel.site.tops)
    for out, source in sorted(kernel.initial.items()):
        if out not in kernel.outputs or source not in kernel.inputs:
            raise NotPlaceable(f"kernel {kernel.site.name}: an in-place output or its input "
                               "is not among the kernel's parameters")
        i, j = kernel.inputs.index(source), kernel.outputs.index(out)
        if not _private_buffer(view, b, operands[i], tops, operands):
            shape = _operand_shape(b, operands[i])
            copy = Instruction(b.fresh(f"{operands[i]}.inplace"), shape, "copy", [operands[i]])
            operands[i] = b.add(copy, position - 0.5)
            b.copies.append((kernel.site.name, shape.byte_size))
        pairs.append(f"{{{j}}}: ({i}, {{}})")
    return "{" + ", ".join(pairs) + "}" if pairs else ""


def _private_buffer(view: ComputationView, b: _Builder, name: str, tops: set[str],
                    operands: list[str]) -> bool:
    """``name`` is a buffer only the kernel being placed reads: the result (or a tuple
    element) of an XLA fusion or copy of this computation, not the root's or a loop
    state's, and read by no instruction the kernel leaves in the module. Writing it in
    place is then what XLA's own in-place scatter fusion did (its operand a fresh buffer)."""
    inst = view.table.get(name)
    root = b.root
    # Read by the root the kernel leaves (a tuple of outputs or loop state): it escapes.
    if inst is None or inst.is_root or (name in root.operands and root.name not in tops):
        return False
    source = view.table.get(inst.operands[0]) if inst.opcode == "get-tuple-element" else inst
    if source is None or source.opcode not in ("fusion", "copy") or operands.count(name) != 1:
        return False
    return not b.users_outside(name, tops)


def _operand_shape(b: _Builder, name: str) -> Shape:
    if name in b.view.table:         # added instructions have fresh names
        return b.view.table[name].shape
    for inst, _ in reversed(b.added):
        if inst.name == name:
            return inst.shape
    raise KeyError(name)


def replace_kernels(module: HloModule, graphs: list[OpGraph], kernels: list[PlacedKernel],
                    views: dict[int, ComputationView] | None = None) -> RewriteReport:
    """Put ``kernels`` into ``module`` in place (module docstring); kernels that do not fit
    are reported in ``skipped`` and left to XLA. ``views``: graph index -> the view the
    caller already built for that graph (else built here). The kernels of a computation go
    in one pass, in order, with one check for cycles (``_Placement``): linear in the
    computation and the kernels, where checking each kernel was their product."""
    report = RewriteReport()
    by_graph: dict[int, list[PlacedKernel]] = {}
    for k in kernels:
        by_graph.setdefault(k.site.graph_index, []).append(k)
    for gi, placed in by_graph.items():
        view = (views or {}).get(gi) or ComputationView(module, graphs[gi])
        # Edit copies: the plan's graphs (possibly cached and reused for a later, equal
        # module) hold the original Instruction objects.
        view.comp.instructions = [dataclasses.replace(i, operands=list(i.operands),
                                                      attrs=dict(i.attrs))
                                  for i in view.comp.instructions]
        view.table = view.comp.by_name()
        b = _Builder(module, view)
        placement = _Placement(view, b, placed)
        kept = placement.run()
        for k, why in zip(placed, placement.outcome):
            if why is None:
                report.placed.append(k.site.name)
            else:
                report.skipped.append((k.site.name, why))
        if kept is not None:
            dead = _unread_pure(kept)
            view.comp.instructions = [i for i in kept if i.name not in dead]
            report.dead_kernels.extend(i.name for i in kept if i.name in dead and
                                       i.opcode not in FREE_OPCODES)
        report.copies.extend((name, gi, nbytes) for name, nbytes in b.copies)
    if report.placed:
        _drop_unreachable(module)
    return report


class _Placement:
    """One computation's kernels placed in order, with the result of checking each for a
    cycle as it goes in (the module has what the op graph that made the kernels convex has
    not), from one check for all of them.

    A kernel ``place`` refuses is undone at once (``_Builder.rollback``: the instructions it
    added, the ones it retargeted, its site's tops). The cycle check runs once, on the module
    with every kernel in, plus, per kernel, an edge into its call from each value its
    replaced instructions read that the call does not (``lost``: what it drops unread, e.g.
    XLA's index fusions a segment kernel no longer reads). With those edges placing a kernel
    only contracts its instructions into its call, which keeps every cycle: none at the end
    means none after any kernel, and every kernel is in as the per-kernel check put it.
    Only where there is one are the kernels placed again from the start: halving (over the
    kernels whose calls the cycle holds up: the first to close one is among them) finds the
    first kernel after which there is a cycle, that kernel is checked without the added
    edges (refused where it closes one, with the per-kernel check's reason), and the later
    kernels go in again. Where cycles are many, the kernels left are checked one by one."""

    def __init__(self, view: ComputationView, b: _Builder, kernels: list[PlacedKernel]):
        self.view, self.b, self.kernels = view, b, kernels
        self.tops = [k.site.tops for k in kernels]
        self.names = set(b.names)
        self.refused: dict[int, str] = {}          # kernel index -> the cycle it closed
        self.each_from: int | None = None          # kernels from here on: checked one by one
        self.replays = 0                           # times placed again from the start
        self._clear()

    def _clear(self) -> None:
        self.removed: set[str] = set()
        self.replacements: dict[str, Instruction] = {}
        self.exported: dict[tuple[str, int | None], _Export] = {}
        self.removed_by: dict[str, str] = {}       # removed name -> the call it went into
        self.calls: dict[str, int] = {}            # call name -> kernel index
        self.outcome: list[str | None] = []        # per kernel tried: None (placed) or why not
        self.lost: list[list[tuple[str, str]]] = []   # per kernel tried: (value, call)

    def run(self) -> list[Instruction] | None:
        """Place every kernel: the computation's instructions in order (None where none was
        placed); ``outcome`` says which went in."""
        count = len(self.kernels)
        self._place(count)
        since = 0               # the kernels before it are known to close no cycle
        while self.removed:
            items = _items(self.view, self.b, self.removed, self.replacements)
            if self.each_from is not None:
                return _topological(items)      # the last kernel in was checked
            edges = self._lost_edges(items, since)
            try:
                order = _topological(items, edges)
            except _Cycle as cycle:
                stuck = cycle.stuck
            else:
                return _topological(items) if edges else order
            candidates = sorted(self.calls[n] for n in stuck if self.calls.get(n, -1) >= since)
            if not candidates or 4 * self.replays >= count - since:
                # Halving has cost more than checking the kernels left one by one would.
                self.each_from = since
                self._restart(count)
                continue
            first = self._first_cycle(since, candidates)
            why = self._cycle()
            if why is not None:
                log.debug("kernel %s: %s", self.kernels[first].site.name, why)
                self.refused[first] = why
            since = first + 1
            self._restart(count)
        return None

    def _place(self, count: int) -> None:
        """Try the kernels from the first not tried yet up to ``count``."""
        for i in range(len(self.outcome), count):
            k, b = self.kernels[i], self.b
            marks = len(b.added), len(b.copies), len(b.undo)
            try:
                new, exports = place(self.view, b, k, self.removed, self.replacements,
                                     self.exported)
            except NotPlaceable as exc:
                why: str | None = str(exc)
            else:
                why = self.refused.get(i)
                if why is None and self.each_from is not None and i >= self.each_from:
                    why = self._cycle(set(k.site.tops), new)
                    if why is not None:
                        log.debug("kernel %s: %s", k.site.name, why)
                        self.refused[i] = why
            if why is not None:
                b.rollback(*marks)
                k.site.tops = self.tops[i]
                self.outcome.append(why)
                self.lost.append([])
                continue
            call, lost = self._lost(k, marks[0])
            for t in k.site.tops:
                if t not in self.removed:
                    self.removed_by[t] = call
            self.removed |= set(k.site.tops)
            self.replacements.update(new)
            self.exported.update(exports)
            self.calls[call] = i
            self.outcome.append(None)
            self.lost.append(lost)

    def _cycle(self, tops: set[str] | None = None,
               new: dict[str, Instruction] | None = None) -> str | None:
        """Why the module as placed (with ``tops`` replaced by ``new``, a kernel just
        placed) cannot be: a cycle (None: it has none)."""
        try:
            _topological(_items(self.view, self.b, self.removed | (tops or set()),
                                {**self.replacements, **(new or {})}))
        except NotPlaceable as exc:
            return str(exc)
        return None

    def _lost(self, k: PlacedKernel, mark: int) -> tuple[str, list[tuple[str, str]]]:
        """The call ``k`` just got (its instructions added from ``mark`` on) and the values
        its replaced instructions read that the call does not, through what it added."""
        mine = {inst.name: inst for inst, _ in self.b.added[mark:]}
        call = next(name for name, inst in mine.items() if inst.opcode == "custom-call")
        reach: set[str] = set()
        stack = [call]
        while stack:
            for o in mine[stack.pop()].operands:
                if o not in reach:
                    reach.add(o)
                    if o in mine:
                        stack.append(o)
        gone = {t for t in k.site.tops if t not in self.removed}
        values = {o for t in gone if t in self.view.table
                  for o in self.view.table[t].operands if o not in gone and o not in reach}
        return call, [(v, call) for v in sorted(values)]

    def _lost_edges(self, items: list[tuple[Instruction, float]],
                    since: int) -> list[tuple[str, str]]:
        """The ``lost`` edges of the kernels from ``since`` on, from what now holds each
        value: its instruction, or the call of the kernel that removed it."""
        present = {inst.name for inst, _ in items}
        edges = []
        for lost in self.lost[since:]:
            for value, call in lost:
                source = value if value in present else self.removed_by.get(value)
                if source is not None and source != call:
                    edges.append((source, call))
        return edges

    def _first_cycle(self, since: int, candidates: list[int]) -> int:
        """The first kernel from ``since`` on after which the module with the ``lost``
        edges has a cycle (it has one after the last), left placed with those before it.
        It is among ``candidates``, the kernels whose calls that cycle holds up: a cycle,
        once closed, stays through the call that closed it."""
        low, high = 0, len(candidates) - 1
        while low < high:
            mid = (low + high) // 2
            self._restart(candidates[mid] + 1)
            items = _items(self.view, self.b, self.removed, self.replacements)
            try:
                _topological(items, self._lost_edges(items, since))
            except NotPlaceable:
                high = mid
            else:
                low = mid + 1
        self._restart(candidates[high] + 1)
        return candidates[high]

    def _restart(self, count: int) -> None:
        """Undo every kernel (the fresh names they took are free again), place the first
        ``count`` again."""
        b = self.b
        b.rollback(0, 0, 0)
        b.names = set(self.names)
        for k, tops in zip(self.kernels, self.tops):
            k.site.tops = tops
        b.index_readers()
        self._clear()
        self.replays += 1
        self._place(count)


def _items(view: ComputationView, b: _Builder, removed: set[str],
           replacements: dict[str, Instruction]) -> list[tuple[Instruction, float]]:
    """The computation's new instructions with their sort positions (XLA's order where it
    can: the text order is the schedule of a scheduled module)."""
    items: list[tuple[Instruction, float]] = []
    for i, inst in enumerate(view.comp.instructions):
        if inst.name in removed:
            if inst.name in replacements:
                items.append((replacements[inst.name], float(i)))
            continue
        items.append((inst, float(i)))
    items.extend(b.added)
    return items


def _unread_pure(instructions: list[Instruction]) -> set[str]:
    """Names of the pure instructions (``_pure``, and tuple elements) nothing reads,
    directly or through other such instructions."""
    users: dict[str, int] = {}
    for inst in instructions:
        for o in inst.operands:
            users[o] = users.get(o, 0) + 1
        # A control edge names its instruction too (kept: XLA would refuse the module).
        for name in re.findall(r"%?([\w.\-]+)", inst.attrs.get("control-predecessors", "")):
            users[name] = users.get(name, 0) + 1
    dead: set[str] = set()
    for inst in reversed(instructions):
        if users.get(inst.name, 0) or inst.is_root or not (
                _pure(inst) or inst.opcode == "get-tuple-element"):
            continue
        dead.add(inst.name)
        for o in inst.operands:
            users[o] -= 1
    return dead


def _topological(items: list[tuple[Instruction, float]],
                 extra: Sequence[tuple[str, str]] = ()) -> list[Instruction]:
    """The instructions with each after those it reads (and after ``a`` for each ``(a, b)``
    of ``extra``), in their sort positions' order where it can; NotPlaceable on a cycle."""
    by_name = {inst.name: inst for inst, _ in items}
    key = {inst.name: (pos, n) for n, (inst, pos) in enumerate(items)}
    reads = {inst.name: {o for o in inst.operands if o in by_name} for inst, _ in items}
    for source, target in extra:
        if source in by_name and target in by_name:
            reads[target].add(source)
    waiting = {name: len(names) for name, names in reads.items()}
    users: dict[str, list[str]] = {}
    for inst, _ in items:
        for o in reads[inst.name]:
            users.setdefault(o, []).append(inst.name)
    ready = [key[n] + (n,) for n, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order: list[Instruction] = []
    while ready:
        *_, name = heapq.heappop(ready)
        order.append(by_name[name])
        for u in users.get(name, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, key[u] + (u,))
    if len(order) != len(items):
        stuck = sorted(n for n, w in waiting.items() if w > 0)
        raise _Cycle(f"placing it would make a cycle through {', '.join(stuck[:4])}", stuck)
    return order


def _drop_unreachable(module: HloModule) -> None:
    """Remove computations nothing calls any more (the replaced fusions' bodies)."""
    by_name = {c.name: c for c in module.computations}
    live: set[str] = set()
    stack = [module.entry.name]
    while stack:
        name = stack.pop()
        if name in live or name not in by_name:
            continue
        live.add(name)
        for inst in by_name[name].instructions:
            stack.extend(c.lstrip("%") for c in inst.called_computations)
    module.computations = [c for c in module.computations if c.name in live]
