"""The structural match of one GEMM pair (``stitch.hlo.gemm_chains``): operands, the
nodes between, the program, the second GEMM's lhs and rhs, the values read outside; a
``GemmChain`` or ``NotAChain`` with the reason.
"""
from __future__ import annotations

import bisect
import math

from .gemm_chain_operands import (Digits, GemmDot, allows_tf32, direct_view, operand_groups,
                                   row_major, row_major_digits, strided_source, strided_view,
                                   through_renames)
from .gemm_chain_program import (GEMM_DTYPES, ChainOp, ChainOutput, GemmChain, NotAChain,
                                 OperandView, program_ancestors, softmax_parts)
from .gemm_chain_values import ChainProgramBuilder
from .ir import Shape
from .op_classes import OpClass


class Recognizer(ChainProgramBuilder):
    """Whether GEMMs ``first`` and ``second`` of a graph form a chain: ``run``."""

    # --- the chain ----------------------------------------------------------------------
    def run(self) -> GemmChain:
        g = self.g
        d1 = self.reach.gemm(g, self.first)
        d2 = self.reach.gemm(g, self.second)
        if d1.alpha != 1.0 and d1.split:
            raise NotAChain("a scaled split-K first GEMM")
        dtype = d1.lhs_shape.element_type
        if dtype not in GEMM_DTYPES or {d1.rhs_shape.element_type, d2.rhs_shape.element_type,
                                       d2.lhs_shape.element_type} - {dtype, "f32"}:
            raise NotAChain(f"GEMM operand types {dtype}/{d1.rhs_shape.element_type}/"
                             f"{d2.rhs_shape.element_type}")

        # First GEMM: A [b, m, k], B [b, k, n] over the nodes its operands rename.
        lb, lf, lk = operand_groups(d1, "lhs")
        rb, rf, rk = operand_groups(d1, "rhs")
        a_node, a_digits, a_renames = self.gemm_operand(d1, 0)
        b_node, b_digits, b_renames = self.gemm_operand(d1, 1)
        a, (batch, m, k) = strided_view(a_node, d1.lhs_shape.dims, a_digits, lb, lf, lk)
        b, (batch_b, k_b, n) = strided_view(b_node, d1.rhs_shape.dims, b_digits, rb, rk, rf)
        if (batch, k) != (batch_b, k_b):
            raise NotAChain("first GEMM operands disagree on batch / contraction")
        self.dims = (batch, m, n)
        result = g.nodes[d1.result]
        if self.rank_of(result.shape) != "tile":
            raise NotAChain("first GEMM result is not [batch, m, n]")

        # Nodes strictly between the two GEMMs (on paths from the first one's result).
        between = self.nodes_between(d1.result, d2)
        self.members = {self.first, *d1.extra, *between, self.second, *d2.extra,
                        *a_renames, *b_renames}
        if d2.comp is None:
            self.members.update(self.rename_members(d2, 0))

        # The program: the first GEMM's sum, its fusion epilogue / cuBLAS alpha...
        dot_type = next(iter(d1.inst.shape.leaves())).element_type
        acc = self.add(ChainOp("acc", "tile", dot_type))
        if d1.comp is not None and not d1.split:
            vals = self.fusion_values(d1, [None] * len(g.nodes[self.first].operands), None,
                                      {d1.inst.name, *self.dot_operands(d1)})
            vals[d1.inst.name] = acc
            self.epilogue(d1, vals)
            s_value = vals[d1.comp.root.name]
        elif d1.comp is not None and d1.comp.root is not d1.inst:
            raise NotAChain("a split-K first GEMM with an epilogue")
        else:
            s_value = acc
            if d1.alpha != 1.0:
                scale = self.add(ChainOp("const", "scalar", "f32", value=d1.alpha))
                s_value = self.add(ChainOp("elementwise", "tile", "f32", "multiply",
                                           (acc, scale)))
        self.value_of[d1.result] = s_value
        # ... the graph ops between ...
        for v in sorted(between):
            node = g.nodes[v]
            args = [self.value_of[o] if o in self.value_of else self.outside(o)
                    for o in node.operands]
            self.value_of[v] = self.translate(node.instruction, node.shape, args,
                                              [g.nodes[o].shape for o in node.operands])
        # ... and the second GEMM's lhs (a prologue inside its fusion included).
        p_value, p_shape = self.second_lhs(d2)

        # Second GEMM: P [b, m, n] must be the tile itself, C [b, n, h].
        lb2, lf2, lk2 = operand_groups(d2, "lhs")
        rb2, rf2, rk2 = operand_groups(d2, "rhs")
        pview, (batch2, m2, n2) = direct_view(-1, p_shape, lb2, lf2, lk2)
        if (batch2, m2, n2) != (batch, m, n) or (pview.batch_stride, pview.row_stride,
                                                   pview.col_stride) not in (
                (m * n, n, 1), (0, n, 1)) or (batch > 1 and pview.batch_stride == 0):
            raise NotAChain("the second GEMM does not contract over the first one's n")
        c_node, c_digits, c_renames = self.gemm_operand(d2, 1)
        c, (batch_c, n_c, h) = strided_view(c_node, d2.rhs_shape.dims, c_digits, rb2, rk2,
                                             rf2)
        if (batch_c, n_c) != (batch, n):
            raise NotAChain("second GEMM rhs disagrees on batch / contraction")
        if c_node in self.members or self.depends_on_first(c_node):
            raise NotAChain("the second GEMM's rhs depends on the first GEMM")
        self.members.update(c_renames)
        out_dims = [x for i, x in enumerate(d2.out_dims()) if i not in (d2.split or [])]
        output = g.nodes[d2.result]
        if math.prod(out_dims) != batch * m * h or output.shape.num_elements != batch * m * h:
            raise NotAChain("the second GEMM's result is not [batch, m, h]")
        out = OperandView(d2.result, m * h, h, 1)
        if d2.comp is not None and d2.comp.root is not d2.inst:
            raise NotAChain("an epilogue after the second GEMM")
        if d2.alpha != 1.0 and d2.split:
            raise NotAChain("a scaled split-K second GEMM")

        # An intermediate value read outside (a training step's backward reads S, the row
        # sums, P) is written by the chain kernel too; constants only the chain reads join it.
        outputs = g.output_set()
        escaping = [v for v in sorted(self.members - {d2.result})
                    if v in outputs or any(u not in self.members for u in g.nodes[v].users)]
        inputs = list(dict.fromkeys([a_node, b_node, c_node, *self.inputs]))
        if set(inputs) & self.members:
            raise NotAChain("a chain input is computed inside the chain")
        if not g.is_convex(self.members):
            raise NotAChain("the chain is not convex")
        extra_values = [self.escaping_value(v) for v in escaping]
        program, where = self.reordered(p_value, [value for value, _ in extra_values])
        extra_outputs = tuple(
            ChainOutput(v, where[value], program[where[value]].rank,
                        g.nodes[v].shape.element_type, view)
            for v, (value, view) in zip(escaping, extra_values))
        if extra_outputs and softmax_parts(program, through_convert=True) is None:
            # (Written out only around a softmax, the form checked end to end.)
            raise NotAChain(f"{g.nodes[escaping[0]].name} is also read outside a chain "
                             f"without a softmax")
        return GemmChain(
            members=tuple(sorted(self.members)), first=self.first, second=self.second,
            batch=batch, m=m, n=n, k=k, h=h, operand_dtype=dtype,
            softmax=softmax_parts(program) is not None,
            between=tuple(sorted(v for v in between
                                 if g.nodes[v].op_class is not OpClass.SOURCE)),
            inputs=tuple(inputs), output=d2.result, a=a, b=b, c=c, out=out,
            program=program, output_dtype=output.shape.element_type, output_scale=d2.alpha,
            tf32=allows_tf32(d1.inst) and allows_tf32(d2.inst), extra_outputs=extra_outputs)

    def escaping_value(self, v: int) -> tuple[int, OperandView]:
        """(program value, view) of member ``v`` read outside the chain: a tile or row
        value the program computes, in its own row-major buffer (the kernel writes it)."""
        node = self.g.nodes[v]
        value = self.value_of.get(v)
        shape = node.shape
        if value is None or not shape.is_array:
            raise NotAChain(f"{node.name} is also read outside the chain")
        rank = self.rank_of(shape)
        op = self.ops[value]
        if rank == "scalar" or op.rank != rank or op.dtype != shape.element_type \
                or shape.element_type == "pred" or not row_major(shape):
            raise NotAChain(f"{node.name} is also read outside the chain, as a "
                             f"{rank} value the kernel cannot write")
        return value, self.value_view(v, shape.dims, row_major_digits(shape.dims), rank)

    def reordered(self, last: int, keep: list[int] | tuple[int, ...] = ()
                  ) -> tuple[tuple[ChainOp, ...], dict[int, int]]:
        """The program with ``last`` moved to the end, the values ``keep`` kept (ops
        neither needs dropped); and old -> new program indices."""
        need: set[int] = set()
        stack = [*keep, last]
        while stack:
            i = stack.pop()
            if i not in need:
                need.add(i)
                stack.extend(self.ops[i].args)
        need.discard(last)
        order = sorted(need, key=lambda i: (i > last, i))
        if any(last in program_ancestors(tuple(self.ops), i) for i in order if i > last):
            raise NotAChain("a value read outside the chain is computed from P")
        order.append(last)
        where = {old: new for new, old in enumerate(order)}
        return tuple(ChainOp(op.kind, op.rank, op.dtype, op.opcode,
                             tuple(where[a] for a in op.args), op.value, op.view, op.direction,
                             op.period)
                     for op in (self.ops[i] for i in order)), where

    def dot_operands(self, d: GemmDot) -> set[str]:
        return set(d.inst.operands)

    def epilogue(self, d: GemmDot, vals: dict[str, int]) -> None:
        """Translate the fusion ops after the dot (vals already maps the dot to acc)."""
        comp = d.comp
        shapes = {i.name: i.shape for i in comp.instructions}
        for inst in comp.post_order():
            if inst.name in vals or inst.opcode == "parameter":
                continue
            if all(o in vals for o in inst.operands):
                vals[inst.name] = self.translate(inst, inst.shape,
                                                 [vals[o] for o in inst.operands],
                                                 [shapes[o] for o in inst.operands])
        if comp.root.name not in vals:
            raise NotAChain(f"{comp.name}: the GEMM fusion's root does not follow the dot")

    def gemm_operand(self, d: GemmDot, which: int) -> tuple[int, list[Digits], list[int]]:
        """(root, digits, moved ops) of operand ``which`` of GEMM ``d`` (see strided_source)."""
        node = self.g.nodes[d.node]
        if d.comp is None:
            nid = node.operands[which]
        else:
            names = d.comp.by_name()
            inst = names[d.inst.operands[which]]
            if inst.opcode != "parameter":
                raise NotAChain(f"{node.name}: operand {which} is computed in the fusion")
            nid = node.operands[inst.parameter_number]
        root, digits, moved = strided_source(self.g, nid, {d.node})
        if not self.g.nodes[root].shape.is_array or not row_major(self.g.nodes[root].shape):
            raise NotAChain(f"{node.name}: operand {which} layout is not row-major")
        return root, digits, moved

    def rename_members(self, d: GemmDot, which: int) -> list[int]:
        node = self.g.nodes[d.node]
        _, renames = through_renames(self.g, node.operands[which])
        return renames

    def nodes_between(self, start: int, d2: GemmDot) -> set[int]:
        """Nodes strictly between ``start`` and the second GEMM: descendants of ``start``
        that reach it. A GEMM or an opaque op among them refuses the chain.

        The walk from ``start`` takes a GEMM or opaque op but does not go through it; which
        nodes reach the second GEMM comes from ``ChainSearch``. The same set and verdict
        as walking every path both ways: a path through such an op to the second GEMM has a
        first such op, which is taken and reaches it (refused); without one every path
        between avoids them. Walking every path cost the forward pass's GEMMs a walk over
        much of the backward pass for each far candidate (quadratic in layers)."""
        g = self.g
        second = self.second
        below, barriers = self.reach.walk(g, start)
        if any(x < second and self.reach.reaches(x, second) for x in barriers):
            raise NotAChain("a GEMM or an opaque op sits between")
        # (A node is smaller than every node it reaches: those past the second GEMM cannot.)
        between = {v for v in below[:bisect.bisect_left(below, second)]
                   if self.reach.reaches(v, second)}
        if not any(o in between or o == start for o in g.nodes[self.second].operands):
            raise NotAChain("the second GEMM does not read the first one's result")
        return between

    def depends_on_first(self, nid: int) -> bool:
        stack = [nid]
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v == self.first:
                return True
            if v in seen or v < self.first:
                continue
            seen.add(v)
            stack.extend(self.g.nodes[v].operands)
        return False

    def second_lhs(self, d2: GemmDot) -> tuple[int, Shape]:
        """The program value the second GEMM's lhs reads, and the shape the dot sees."""
        g = self.g
        node = g.nodes[self.second]
        if d2.comp is None:
            lhs = node.operands[0]
            if lhs not in self.value_of:
                raise NotAChain("the second GEMM's lhs is not computed from the first GEMM")
            return self.value_of[lhs], d2.lhs_shape
        names = d2.comp.by_name()
        rhs_param = names[d2.inst.operands[1]]
        if rhs_param.opcode != "parameter":
            raise NotAChain("the second GEMM's rhs is computed in its fusion")
        args: list[int | None] = []
        for k, o in enumerate(node.operands):
            if k == rhs_param.parameter_number:
                args.append(self.add(ChainOp("const", "scalar", "f32", value=0.0)))
            elif o in self.value_of:
                args.append(self.value_of[o])
            else:
                args.append(None)
        vals = self.fusion_values(d2, args, d2.inst.operands[0], {d2.inst.name})
        lhs = d2.inst.operands[0]
        if lhs not in vals:
            raise NotAChain("the second GEMM's lhs prologue could not be followed")
        return vals[lhs], names[lhs].shape


