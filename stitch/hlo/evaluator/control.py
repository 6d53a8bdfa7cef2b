"""Structure and control flow: tuple, get-tuple-element, call, fusion, while, conditional,
optimization-barrier, tokens, partition/replica ids, async wrappers, single-participant
collectives and the custom-call dispatcher."""
from __future__ import annotations

import re

import logging

import numpy as np

from ..errors import HloEvaluationError, UnsupportedOpcodeError
from ..ir import parse_computation_list
from .registry import TOKEN, handles

log = logging.getLogger("stitch.evaluator")


@handles("tuple")
def tuple_(ev, inst, ops):
    return tuple(ops)


@handles("get-tuple-element")
def get_tuple_element(ev, inst, ops):
    value = ops[0]
    if not isinstance(value, tuple):
        raise HloEvaluationError(f"{inst.name}: get-tuple-element of a non-tuple value")
    return value[inst.int("index")]


@handles("call")
def call(ev, inst, ops):
    return ev.run(inst.called_computations[0], ops)


@handles("fusion")
def fusion(ev, inst, ops):
    # kLoop / kInput / kOutput / kCustom (Triton GEMMs, cuDNN fusions...) all mean: evaluate
    # the fused computation on the operands.
    return ev.run(parse_computation_list(inst.attrs["calls"])[0], ops)


@handles("while")
def while_(ev, inst, ops):
    condition = parse_computation_list(inst.attrs["condition"])[0]
    body = parse_computation_list(inst.attrs["body"])[0]
    state = ops[0]
    trips = 0
    while bool(np.asarray(ev.run(condition, [state])).reshape(())):
        state = ev.run(body, [state])
        trips += 1
    log.debug("while %s ran %d iterations", inst.name, trips)
    return state


@handles("conditional")
def conditional(ev, inst, ops):
    selector = np.asarray(ops[0]).reshape(())
    if "branch_computations" in inst.attrs:
        branches = parse_computation_list(inst.attrs["branch_computations"])
        index = int(selector)
        if selector.dtype == np.bool_:  # a pred selector with branch_computations={true, false}
            index = 0 if bool(selector) else 1
        if index < 0 or index >= len(branches):
            index = len(branches) - 1
    else:
        branches = (parse_computation_list(inst.attrs["true_computation"])[0],
                    parse_computation_list(inst.attrs["false_computation"])[0])
        index = 0 if bool(selector) else 1
    if len(ops) - 1 != len(branches):
        raise HloEvaluationError(f"{inst.name}: {len(branches)} branches but {len(ops) - 1} "
                                 "branch operands")
    return ev.run(branches[index], [ops[1 + index]])


@handles("optimization-barrier", "domain")
def identity(ev, inst, ops):
    return ops[0]


@handles("after-all")
def after_all(ev, inst, ops):
    return TOKEN


@handles("add-dependency")
def add_dependency(ev, inst, ops):
    return ops[0]


@handles("partition-id", "replica-id")
def partition_id(ev, inst, ops):
    return np.zeros((), np.uint32)


@handles("async-start")
def async_start(ev, inst, ops):
    result = ev.run(inst.called_computations[0], ops)
    return (tuple(ops), result, np.zeros((), np.uint32))


@handles("async-update")
def async_update(ev, inst, ops):
    return ops[0]


@handles("async-done")
def async_done(ev, inst, ops):
    return ops[0][1]


@handles("copy-start")
def copy_start(ev, inst, ops):
    if not inst.shape.is_tuple:      # XLA's parser also takes the copied array's shape alone
        return ops[0]
    return (ops[0], ops[0], np.zeros((), np.uint32))


@handles("copy-done")
def copy_done(ev, inst, ops):
    return ops[0][0] if isinstance(ops[0], tuple) else ops[0]


def _single_participant(ev, inst) -> bool:
    attrs = ev.module.attrs
    for key in ("replica_count", "num_partitions"):
        if int(attrs.get(key, "1") or 1) > 1:
            return False
    groups = inst.attrs.get("replica_groups", "{}").replace(" ", "")
    return groups in ("{}", "{{0}}", "[1,1]<=[1]")


@handles("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
def collective(ev, inst, ops):
    """With one participant these collectives return their operand(s)."""
    if not _single_participant(ev, inst):
        raise UnsupportedOpcodeError(f"{inst.opcode} (more than one participant)", inst.name)
    if inst.opcode == "collective-permute":
        return _permute_to_self(inst, ops)
    return tuple(ops) if len(ops) > 1 else ops[0]


def _permute_to_self(inst, ops):
    """Participant 0 receives its own operand when the pairs hold (0, 0); with no pair
    sending to it, XLA gives zeros."""
    if "slice_sizes" in inst.attrs:  # the in-place form (input, output, offsets)
        raise UnsupportedOpcodeError("collective-permute (in-place form with slice_sizes)",
                                     inst.name)
    text = inst.attrs.get("source_target_pairs", "{}")
    pairs = {(int(a), int(b)) for a, b in re.findall(r"\{\s*(-?\d+)\s*,\s*(-?\d+)\s*\}", text)}
    receives = (0, 0) in pairs
    values = [np.asarray(v) if receives else np.zeros_like(np.asarray(v)) for v in ops]
    return tuple(values) if len(values) > 1 else values[0]


@handles("custom-call")
def custom_call(ev, inst, ops):
    from .custom_calls import dispatch
    return dispatch(ev, inst, ops)
