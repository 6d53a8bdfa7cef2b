"""Dump XLA's own per-fusion run-time estimates for the zoo's GPU fixtures.

For every model/config/target it compiles the model deviceless (as scripts/gen_fixtures.py
does) with two XLA debug options and writes hlo_fixtures/data/xla_costs/<model>.<config>.<target>.json:

* ``xla_gpu_collect_cost_model_stats``: just before scheduling, XLA evaluates its cost models
  on every fusion of the (final) module and stores the results as ``reification_cost`` records
  in the fusion's backend_config: one per model (``""`` = GpuPerformanceModel,
  ``indexing-cost-model``, ``experimental-gemm-cost-model``, ``sol``, ...), each with
  ``exec_time_us``. These are per-kernel estimates of exactly the fusions of the final HLO.
* ``xla_dump_to`` + ``xla_dump_hlo_pass_re=priority-fusion``: the priority-fusion pass writes
  its fusion-process record (``*.priority_fusion_dump.txt``, a FusionProcessDumpProto in text
  format) and the module before/after the pass. The record's ``update_priority`` steps carry
  ``us_fused``/``us_unfused``; where a fusion step can be tied to a single-consumer full
  priority update, ``us_fused - 1 us`` (one kernel launch overhead) is the estimate of that
  fused kernel, which the script reports next to the reification cost.

Usage (same environment as gen_fixtures.py)::

    PYTHONPATH=. /path/to/venv-cuda/bin/python scripts/dump_xla_fusion_costs.py \
        [--models a,b] [--targets h100,a100] [--config full]

docs/xla_costs.md describes the output and its caveats.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gen_fixtures import DATA, REPO, TARGETS, gpu_shardings  # sets the deviceless env vars

import jax  # noqa: E402
from jax.errors import JaxRuntimeError  # noqa: E402

from stitch.hlo.ir import HloModule, Instruction  # noqa: E402
from stitch.hlo.parser import parse_hlo  # noqa: E402
from stitch.hlo.printer import print_instruction  # noqa: E402

OUT = DATA / "xla_costs"
LAUNCH_OVERHEAD_US = 1.0  # GpuPerformanceModel::kKernelLaunchOverhead, added per kernel
# reification_cost names -> short keys in the JSON.
MODEL_KEYS = {"": "gpu_perf_model", "indexing-cost-model": "indexing",
              "experimental-gemm-cost-model": "gemm", "sol": "sol",
              "perf-table-model": "perf_table"}
# Models that read the measured perf tables (only valid with XLA's built-in tables).
TABLE_MODELS = {"sol", "perf_table"}
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "conditional", "call", "after-all", "partition-id", "replica-id",
               "opt-barrier", "add-dependency"}
_PROTO_DEFAULTS = ("0", 0, False, "", [], {}, "DEVICE_TYPE_INVALID")
TRIVIAL_OPS = {"parameter", "constant", "broadcast", "bitcast", "reshape", "iota"}


# --- compiling -------------------------------------------------------------------------------

def stub_perf_tables(key: str, folder: Path) -> dict[str, str]:
    """Minimal perf tables for a device XLA has no built-in tables for (e.g. sm_70, sm_80).

    Without them the cost-model stats pass fails ("Cannot find key: sm_80"). They only feed
    the table-based models ("sol", "perf_table"), whose values are then dropped.
    """
    matrix = ("{ element_type: F32 dimensions: 1024 dimensions: 1024 "
              "layout { minor_to_major: 1 minor_to_major: 0 } }")
    matmul = (f'entries {{ key: "{key}" value {{ entries {{ instruction {{ opcode: "dot" '
              f"shape {matrix} dot_dimension_numbers {{ lhs_contracting_dimensions: 1 "
              f"rhs_contracting_dimensions: 0 }} }} operands {{ shape {matrix} }} "
              f"operands {{ shape {matrix} }} clock_cycles: 1000000 }} }} }}\n")
    collective = f'entries {{ key: "{key}" value {{ }} }}\n'
    paths = {"xla_gpu_experimental_matmul_perf_table_path": folder / f"matmul_{key}.pbtxt",
             "xla_gpu_experimental_collective_perf_table_path": folder / f"coll_{key}.pbtxt"}
    for path, text in zip(paths.values(), (matmul, collective)):
        path.write_text(text)
    return {flag: str(path) for flag, path in paths.items()}


def compile_dumped(inst, sharding, dump_dir: Path) -> tuple[str, bool]:
    """Optimized HLO text with reification costs; True if stub perf tables were needed."""
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in inst.arg_specs]
    options: dict[str, object] = {"xla_dump_to": str(dump_dir),
                                  "xla_dump_hlo_pass_re": "priority-fusion",
                                  "xla_gpu_collect_cost_model_stats": True}
    lowered = jax.jit(inst.fn).lower(*specs)
    try:
        return lowered.compile(compiler_options=options).as_text(), False
    except JaxRuntimeError as err:  # NOT_FOUND: no built-in perf table for this device
        found = re.search(r"Cannot find key: (\S+)", str(err))
        if not found:
            raise
    for old in dump_dir.iterdir():
        old.unlink()
    tables = dump_dir.parent / "tables"
    tables.mkdir(exist_ok=True)
    options.update(stub_perf_tables(found.group(1), tables))
    lowered = jax.jit(inst.fn).lower(*specs)
    return lowered.compile(compiler_options=options).as_text(), True


# --- the fusion-process record ---------------------------------------------------------------

_TOKEN = re.compile(r'\s*(?:([A-Za-z_]\w*)\s*\{|(\})|([A-Za-z_]\w*)\s*:\s*'
                    r'("(?:[^"\\]|\\.)*"|[^\s{}]+))', re.S)


def _scalar(text: str) -> object:
    if text.startswith('"'):
        return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)),
                      text[1:-1])
    try:
        return float(text)
    except ValueError:
        return text


def parse_textproto(text: str) -> dict[str, list]:
    """Protobuf text format -> {field: [values]} (messages are nested dicts)."""
    stack: list[dict[str, list]] = [{}]
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip():
                raise ValueError(f"textproto: cannot parse at offset {pos}")
            break
        pos = m.end()
        if m.group(1):
            child: dict[str, list] = {}
            stack[-1].setdefault(m.group(1), []).append(child)
            stack.append(child)
        elif m.group(2):
            stack.pop()
        else:
            stack[-1].setdefault(m.group(3), []).append(_scalar(m.group(4)))
    return stack[0]


@dataclass
class FusionStep:
    """The last priority-fusion step that built a fusion, with the estimate it was fused on."""

    fusion: str
    producer: str
    consumer: str
    consumers: list[str]  # the producer's users in its last priority update
    us_fused: float | None
    us_unfused: float | None
    full: bool  # False: an incremental update (deltas, not run times) or none at all

    @property
    def exact(self) -> bool:
        return self.full and self.consumers == [self.consumer] and self.us_fused is not None

    def as_json(self) -> dict:
        out = {"producer": self.producer, "consumer": self.consumer, "exact": self.exact,
               "us_fused": _round(self.us_fused), "us_unfused": _round(self.us_unfused)}
        if self.exact:
            out["us"] = _round(self.us_fused - LAUNCH_OVERHEAD_US)
        if self.consumers != [self.consumer]:
            out["consumers"] = self.consumers
        return out


def _one(step: dict, key: str) -> object:
    return step.get(key, [None])[0]


def replay_fusion_steps(steps: list[dict]) -> dict[str, FusionStep]:
    """Fusion name -> its last fusion step, tracking which priority updates were incremental.

    XLA updates the priority of an operand of a new fusion incrementally (the record then holds
    deltas) when that operand is still queued; a queued producer is one whose last priority
    (us_unfused - us_fused, summed over incremental updates) was >= 0 and which was neither
    fused nor found ineligible since.
    """
    queued: dict[str, float] = {}
    last_update: dict[str, tuple[dict, bool]] = {}
    built: dict[str, FusionStep] = {}
    new_fusions: set[str] = set()
    in_fusions = False
    for step in steps:
        if "fusion" in step:
            body = step["fusion"][0]
            if not in_fusions:
                new_fusions, in_fusions = set(), True
            built[_one(body, "fusion_name")] = _fusion_step(body, last_update)
            new_fusions.add(_one(body, "fusion_name"))
            queued.pop(_one(body, "producer_name"), None)
            if _one(body, "fusion_name") != _one(body, "consumer_name"):
                queued.pop(_one(body, "consumer_name"), None)
            continue
        in_fusions = False
        if "producer_ineligible" in step:
            queued.pop(_one(step["producer_ineligible"][0], "producer_name"), None)
        elif "update_priority" in step:
            body = step["update_priority"][0]
            name = _one(body, "producer_name")
            incremental = name in queued and name not in new_fusions
            delta = (body.get("us_unfused", [0.0])[0]) - (body.get("us_fused", [0.0])[0])
            priority = queued.get(name, 0.0) + delta if incremental else delta
            if priority < 0:
                queued.pop(name, None)
            else:
                queued[name] = priority
            last_update[name] = (body, not incremental)
    return built


def _fusion_step(body: dict, last_update: dict[str, tuple[dict, bool]]) -> FusionStep:
    producer = _one(body, "producer_name")
    update, full = last_update.get(producer, ({}, False))
    return FusionStep(fusion=_one(body, "fusion_name"), producer=producer,
                      consumer=_one(body, "consumer_name"),
                      consumers=list(update.get("consumer_names", [])),
                      us_fused=_one(update, "us_fused"), us_unfused=_one(update, "us_unfused"),
                      full=full and bool(update))


# --- HLO helpers -----------------------------------------------------------------------------

def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def members(module: HloModule, inst: Instruction) -> list[str]:
    """Names of the ops inside a fusion (nested fusions flattened; parameters, constants out)."""
    out: list[str] = []
    for name in inst.called_computations:
        for op in module.computation(name).instructions:
            if op.opcode == "fusion":
                out.extend(members(module, op))
            elif op.opcode not in ("parameter", "constant"):
                out.append(op.name)
    return out


def member_key(module: HloModule, inst: Instruction) -> frozenset[str]:
    """Names of a fusion's non-trivial ops: what must agree for two fusions to be "the same"
    kernel across passes (CSE and simplification merge or drop broadcasts and bitcasts)."""
    return frozenset(op for op in _member_ops(module, inst) if op[1] not in TRIVIAL_OPS)


def _member_ops(module: HloModule, inst: Instruction) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name in inst.called_computations:
        for op in module.computation(name).instructions:
            if op.opcode == "fusion":
                out.extend(_member_ops(module, op))
            else:
                out.append((op.name, op.opcode))
    return out


def fusions(module: HloModule) -> dict[str, Instruction]:
    """Fusion instructions outside fused computations (the kernels), by name."""
    fused = {name for _, inst in module.instructions() if inst.opcode == "fusion"
             for name in inst.called_computations}
    return {inst.name: inst for comp, inst in module.instructions()
            if inst.opcode == "fusion" and comp.name not in fused}


def loop_computations(module: HloModule) -> dict[str, str]:
    """Kernel name -> its computation, for kernels outside the entry (while bodies etc.)."""
    kernels = fusions(module)
    return {inst.name: comp.name for comp, inst in module.instructions()
            if inst.name in kernels and not comp.is_entry}


def other_kernels(module: HloModule) -> list[str]:
    """Non-fusion instructions outside fused computations that launch work (custom-calls...)."""
    inner = {name for _, inst in module.instructions()
             if inst.opcode in ("fusion", "reduce", "sort", "scatter", "reduce-window",
                                "select-and-scatter", "all-reduce", "map")
             for name in inst.called_computations}
    return [inst.name for comp, inst in module.instructions()
            if comp.name not in inner and inst.opcode not in NOT_KERNELS | {"fusion"}]


def reification_costs(inst: Instruction) -> dict[str, float]:
    costs = inst.backend_config.get("reification_cost", [])
    return {MODEL_KEYS.get(c.get("name", ""), c.get("name", "")): float(c["exec_time_us"])
            for c in costs if "exec_time_us" in c}


def _normal_instruction(inst: Instruction, names: dict[str, str] | None = None) -> str:
    attrs = {k: v for k, v in inst.attrs.items() if k not in ("metadata", "backend_config")}
    # The stats pass adds reification costs, and a default backend_config where there was
    # none: compare configs without both (proto3 defaults carry no information).
    config = {k: v for k, v in inst.backend_config.items()
              if k != "reification_cost" and v not in _PROTO_DEFAULTS}
    if config or (inst.attrs.get("backend_config") and not inst.backend_config):
        attrs["backend_config"] = (json.dumps(config, sort_keys=True) if config
                                   else inst.attrs["backend_config"])
    copy = Instruction(name=inst.name, shape=inst.shape, opcode=inst.opcode,
                       operands=list(inst.operands), attrs=attrs, literal=inst.literal,
                       parameter_number=inst.parameter_number, is_root=inst.is_root)
    if names is not None:
        copy.name = names[inst.name]
        copy.operands = [names[o] for o in inst.operands]
        copy.attrs = {k: v for k, v in attrs.items() if k not in ("calls", "to_apply")}
    return print_instruction(copy)


def module_digest(module: HloModule) -> list[tuple[str, list[str]]]:
    """The module without metadata, stack-frame tables and reification costs."""
    return [(c.name, [_normal_instruction(i) for i in c.instructions])
            for c in module.computations]


def fusion_signature(module: HloModule, inst: Instruction) -> str:
    """A fusion's contents with instruction names replaced by positions (name-independent)."""
    head = _normal_instruction(inst, {inst.name: "f", **{o: "_" for o in inst.operands}})
    body = [line for name in inst.called_computations
            for line in _computation_signature(module, name)]
    return "\n".join([head, *body])


def _computation_signature(module: HloModule, name: str) -> list[str]:
    comp = module.computation(name)
    positions = {op.name: f"i{k}" for k, op in enumerate(comp.instructions)}
    lines: list[str] = []
    for op in comp.instructions:
        lines.append(_normal_instruction(op, positions))
        for callee in op.called_computations:
            lines.extend(_computation_signature(module, callee))
    return lines


# --- entries ---------------------------------------------------------------------------------

def kernel_kind(inst: Instruction) -> str:
    kind = inst.attrs.get("kind", "")
    backend = inst.backend_config.get("fusion_backend_config", {}).get("kind")
    return f"{kind}/{backend}" if backend else kind


def pick_estimate(kind: str, models: dict[str, float]) -> tuple[float, str] | None:
    """XLA's own model for this kernel type: the one priority fusion uses for it."""
    if kind.endswith("/__triton") and "indexing" in models:
        return models["indexing"], "reification_cost indexing-cost-model (tiled Triton model)"
    if "gpu_perf_model" in models:
        return models["gpu_perf_model"], "reification_cost GpuPerformanceModel"
    return None


def build_entries(final: HloModule, after_pf: HloModule | None,
                  steps: dict[str, FusionStep], drop_models: set[str]) -> list[dict]:
    pf_by_members = _unique_member_keys(after_pf) if after_pf is not None else {}
    entries = []
    loops = loop_computations(final)
    for name, inst in fusions(final).items():
        kind = kernel_kind(inst)
        models = {k: _round(v) for k, v in reification_costs(inst).items()
                  if k not in drop_models}
        names = members(final, inst)
        pf_name = pf_by_members.get(member_key(final, inst))
        step = steps.get(pf_name) if pf_name else None
        picked = pick_estimate(kind, models)
        if picked is None and step is not None and step.exact:
            picked = (step.us_fused - LAUNCH_OVERHEAD_US,
                      "priority-fusion: us_fused - launch overhead of the last fuse step")
        if picked is None:
            continue
        entry = {"fusion": name, "kind": kind, "us": _round(picked[0]), "source": picked[1],
                 "models": models}
        if name in loops:
            entry["computation"] = loops[name]
        if step is not None:
            entry["pf"] = {"fusion": pf_name, **step.as_json()}
        entry["members"] = names
        entries.append(entry)
    return entries


def _unique_member_keys(module: HloModule) -> dict[frozenset[str], str]:
    """Non-empty member key -> fusion name, for keys only one fusion has."""
    seen: dict[frozenset[str], list[str]] = {}
    for name, inst in fusions(module).items():
        seen.setdefault(member_key(module, inst), []).append(name)
    return {key: names[0] for key, names in seen.items() if key and len(names) == 1}


def remap_to_fixture(entries: list[dict], final: HloModule, fixture: HloModule) -> list[dict]:
    """Keep entries whose fusion has the same contents as a fixture fusion, under its name.

    Fusions with identical contents (same signature) are paired in module order, only when
    both modules have the same number of them (their estimates are equal anyway). ``members``
    become the fixture's names; ``pf`` keeps this compilation's names.
    """
    theirs, ours = _by_signature(fixture), _by_signature(final)
    rename: dict[str, str] = {}
    for sig, names in ours.items():
        if len(theirs.get(sig, ())) == len(names):
            rename.update(zip(names, theirs[sig]))
    kernels, loops = fusions(fixture), loop_computations(fixture)
    out = []
    for entry in entries:
        name = rename.get(entry["fusion"])
        if name is None:
            continue
        moved = {"fusion": name, "members": members(fixture, kernels[name])}
        if name in loops:
            moved["computation"] = loops[name]
        if name != entry["fusion"]:
            moved["compiled_name"] = entry["fusion"]
        kept = {k: v for k, v in entry.items() if k != "computation"}
        out.append({**kept, **moved})
    return out


def _by_signature(module: HloModule) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, inst in fusions(module).items():
        out.setdefault(fusion_signature(module, inst), []).append(name)
    return out


# --- driver ----------------------------------------------------------------------------------

def dump_one(inst, sharding, target: str, fixture_path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="xla_costs_") as tmp:
        dump_dir = Path(tmp) / "dump"
        dump_dir.mkdir()
        text, stubbed = compile_dumped(inst, sharding, dump_dir)
        record = parse_textproto(_read_one(dump_dir, "*priority_fusion_dump.txt") or "")
        after = _read_one(dump_dir, "*after_priority-fusion*.txt")
    final = parse_hlo(text)
    fixture = parse_hlo(fixture_path.read_text()) if fixture_path.exists() else None
    matches = fixture is not None and module_digest(final) == module_digest(fixture)
    steps = replay_fusion_steps(record.get("fusion_steps", []))
    entries = build_entries(final, parse_hlo(after) if after else None, steps,
                            TABLE_MODELS if stubbed else set())
    if not matches:
        entries = remap_to_fixture(entries, final, fixture) if fixture is not None else []
    device = record.get("gpu_device_info", [{}])[0].get("name", [None])[0]
    reference = fixture if fixture is not None else final
    kernels = fusions(reference)
    options = ["--xla_gpu_collect_cost_model_stats=true",
               "--xla_dump_hlo_pass_re=priority-fusion", "--xla_dump_to=<tmp>"]
    return {"target": target, "device": device, "xla_options": options,
            "matches_fixture": matches, "stub_perf_tables": stubbed,
            "launch_overhead_us": LAUNCH_OVERHEAD_US,
            "coverage": {"fusions": len(kernels), "with_us": len(entries),
                         "with_pf_exact": sum(1 for e in entries if e.get("pf", {}).get("exact")),
                         "other_kernels": other_kernels(reference)},
            "entries": entries}


def _read_one(folder: Path, pattern: str) -> str | None:
    found = sorted(glob.glob(str(folder / pattern)))
    return Path(found[0]).read_text() if found else None


def write_json(path: Path, data: dict) -> None:
    """One top-level key per line and one entry per line: compact but diffable."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
             for k, v in data.items() if k != "entries"]
    rows = ",\n".join("  " + json.dumps(e, separators=(",", ":")) for e in data["entries"])
    lines.append(f' "entries": [\n{rows}\n ]')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def default_models(config: str) -> list[str]:
    from stitch.models import get_model, list_models

    return [name for name in list_models() if config in get_model(name).configs
            and (DATA / name / f"{config}.gpu-h100.hlo").exists()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", help="comma-separated model names (default: every zoo "
                        "model with the config and GPU fixtures)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    parser.add_argument("--config", default="full")
    parser.add_argument("--specs", type=Path, default=REPO.parent / "shared" / "xla_gpu_specs")
    args = parser.parse_args()
    from stitch.models import build

    names = args.models.split(",") if args.models else default_models(args.config)
    targets = args.targets.split(",")
    shardings = gpu_shardings(args.specs)
    for name in names:
        inst = build(name, args.config)
        for target in targets:
            start = time.perf_counter()
            fixture = DATA / name / f"{args.config}.gpu-{target}.hlo"
            data = {"jax": jax.__version__, "model": name, "config": args.config,
                    **dump_one(inst, shardings[target], target, fixture)}
            write_json(OUT / f"{name}.{args.config}.{target}.json", data)
            cov = data["coverage"]
            print(f"{name}/{args.config}/{target}: {cov['with_us']}/{cov['fusions']} fusions, "
                  f"{cov['with_pf_exact']} pf-exact, match={data['matches_fixture']}, "
                  f"{time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
