"""The plan cache: a restarted job, or a second process, skips planning.

Key: sha256 over the module fingerprint (sha256 of the printed module), the stitch version
(release + a digest of its planning source, ``code_version``),
the target, the planner and its options (all ``ExplorerOptions`` fields but ``cancel`` and
``spill_worker``).
Entries live in memory (the FusionPlan itself) and on disk as JSON under
``$STITCH_CACHE_DIR/plans/`` (default ``$XDG_CACHE_HOME/stitch/plans``): per op graph, the
stitched plan's kernel member sets and origins in launch order and, where they have a data
form (``plan_data``), each kernel's kind, priced cost, tuned schedule or why it has none,
and chain schedule, and the baseline's kernels likewise (``priced``). JSON and not pickle:
nothing read from disk may run code. A graph with ``priced`` data is rebuilt from it as
stored (what a fresh planning of the same module by the same code gives: the key holds
both); one without is rebuilt from its member sets: kernels costed again, put in launch
order and validated, schedules re-tuned, the baseline recomputed. Every entry carries a
sha256 ``digest`` of its content, checked on reading: a changed field drops the entry. An
entry that does not fit the module, is malformed or fails validation is deleted and the plan
recomputed. One that loads but stitches nothing where it is used (the XLA pass:
``pass_planning``) is deleted and the module planned again, once; a plan that stitches
nothing when fresh is noted in its entry (``nothing_stitched``: the reason, an optional key),
so later compiles use it as it is instead of planning again.

Processes sharing the directory (a multi-process job on a shared file system) plan each
module once: ``planning(key)`` takes a per-key ``flock`` under ``plans/.locks/``; the first
process plans and writes, the others wait (polling, at most ``PLAN_LOCK_TIMEOUT_S``, then
plan themselves, logged) and read its entry, which is never seen half-written (atomic
replace).

The directory is created 0700 and refused (logged once, disk cache off, memory cache on)
when it is not owned by the user or is group/world-writable; files are written atomically
(temp file in the same directory, fsync, ``os.replace``) with mode 0600.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; elsewhere processes sharing a directory may plan a module twice.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from stitch.hlo.graph import OpGraph
from stitch.hlo.ir import HloModule
from stitch.hlo.printer import print_hlo

from ..errors import StitchError
from ..version import __version__
from .graph_plan import PlannedKernel
from .module_plan import FusionPlan, GraphResult
from .options import ExplorerOptions
from .plan_data import DataError, decoded, to_data
from ..cost.gemm_tile import GemmChainSchedule
from ..pricing.delta import KernelCost
from ..schedule.kernel_schedule import KernelSchedule

log = logging.getLogger(__name__)

# 2: priced kernels and baselines (plan_data) and the content digest.
FORMAT = 2
MEMORY_ENTRIES = 64
# How long a process waits for another one planning the same module before planning
# itself (planning a large training step takes minutes).
PLAN_LOCK_TIMEOUT_S = 900.0


# Module-level attributes that are compile metadata, not program: XLA's frontend attributes
# carry `fingerprint_before_lhs`, a hash of the module *with* stitch's per-compile request
# token, so it differs in every process and no plan was ever found again.
_METADATA_ATTRS = ("frontend_attributes",)


def module_fingerprint(module: HloModule) -> str:
    """sha256 of the printed module (the printer's canonical text, not the input's), its
    module-level metadata attributes left out."""
    program = dataclasses.replace(module, attrs={k: v for k, v in module.attrs.items()
                                                 if k not in _METADATA_ATTRS})
    return hashlib.sha256(print_hlo(program).encode("utf-8")).hexdigest()


def options_key(options: ExplorerOptions) -> dict:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if f.compare}       # not cancel, spill_worker: how, not what, to plan


def code_version() -> str:
    """The stitch version plans are keyed by: the release and a digest of the planning
    code's own source files (``stitch.codegen.cache.source_digest``, computed once per process),
    so any code change invalidates the plans an earlier version made."""
    from stitch.codegen.cache import PLANNING_PACKAGES, source_digest
    return f"{__version__}+src.{source_digest(PLANNING_PACKAGES)}"


def plan_key(fingerprint: str, version: str, target: str, planner: str,
             options: ExplorerOptions) -> str:
    text = json.dumps({"format": FORMAT, "module": fingerprint, "stitch": version,
                       "target": target, "planner": planner,
                       "options": options_key(options)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def default_plan_dir() -> Path:
    from stitch.codegen.cache import default_cache_dir
    return default_cache_dir() / "plans"


def _safe_dir(path: Path) -> bool:
    """Create ``path`` 0700 if missing; True when it is ours and not writable by others."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        log.warning("plan cache off: cannot create %s: %s", path, exc)
        return False
    if not stat.S_ISDIR(info.st_mode):
        log.warning("plan cache off: %s is not a directory", path)
        return False
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        log.warning("plan cache off: %s is not owned by this user", path)
        return False
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("plan cache off: %s is group- or world-writable", path)
        return False
    return True


def plan_entry(plan: FusionPlan, key: str) -> dict:
    """What is stored: per graph, the stitched kernels' member sets (op ids) and origins in
    launch order, and their priced data and the baseline's (``priced_data``) where every
    value has a data form."""
    graphs = []
    for g in plan.graphs:
        stored = {"name": g.graph.name, "ops": len(g.graph.nodes),
                  "kernels": [list(k.members) for k in g.stitched.kernels],
                  "origins": [k.origin for k in g.stitched.kernels],
                  "objective_s": g.report.objective_s, "status": g.report.status}
        try:
            stored["priced"] = priced_data(g)
        except DataError as exc:
            log.info("plan cache: graph %s stored as member sets only (a cached plan prices "
                     "and tunes it again): %s", g.graph.name, exc)
        graphs.append(stored)
    return {"format": FORMAT, "key": key, "module": plan.module_name, "target": plan.target,
            "planner": plan.planner, "baseline_source": plan.baseline_source,
            "graphs": graphs}


def priced_data(result: GraphResult) -> dict:
    """A graph's plans as data: per stitched kernel (launch order, as ``kernels``) its kind,
    cost, schedule, schedule note and chain schedule; per baseline kernel (launch order)
    its members, kind, origin and cost."""
    return {"kernels": [{"kind": k.kind, "cost": to_data(k.cost),
                         "schedule": to_data(k.schedule), "note": k.schedule_note,
                         "chain": to_data(k.chain_schedule)}
                        for k in result.stitched.kernels],
            "baseline": [{"members": list(k.members), "kind": k.kind, "origin": k.origin,
                          "cost": to_data(k.cost)} for k in result.baseline.kernels]}


# An entry's file starts with its digest: the sha256 of the rest of the object's JSON text
# (``sealed_text``), checked over the bytes read, without encoding the entry again.
_SEAL = '{"digest": "'
_DIGEST_END = len(_SEAL) + 64


def sealed_text(entry: dict) -> str:
    """An entry's file text: its content as a JSON object (all but a ``digest`` key) with
    the sha256 of that object's text as its first key, ``digest``."""
    body = json.dumps({k: v for k, v in entry.items() if k != "digest"})
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    rest = body[1:]
    return f'{_SEAL}{digest}"' + (rest if rest == "}" else ", " + rest)


def is_sealed(text: str) -> bool:
    """Whether ``text`` is as ``sealed_text`` wrote it: its digest matches its content."""
    if not text.startswith(_SEAL) or text[_DIGEST_END:_DIGEST_END + 1] != '"':
        return False
    rest = text[_DIGEST_END + 1:]
    rest = rest[2:] if rest.startswith(", ") else rest
    digest = hashlib.sha256(b"{" + rest.encode("utf-8")).hexdigest()
    return hmac.compare_digest(digest, text[len(_SEAL):_DIGEST_END])


class PlanCache:
    """Plans by key, in memory and (when the directory is safe) on disk."""

    def __init__(self, directory: Path | str | None = None, disk: bool = True):
        self.directory = Path(directory) if directory is not None else None
        self.disk = disk
        self._checked: bool | None = None
        self.memory: dict[str, FusionPlan] = {}
        # Keys whose fresh plan stitched nothing where it was used: why (note_failure).
        self.failures: dict[str, str] = {}
        self.hits = self.disk_hits = self.misses = self.dropped = 0
        # Wall seconds spent rebuilding plans from disk entries (their disk hits).
        self.disk_seconds = 0.0

    # --- disk --------------------------------------------------------------------------
    def _dir(self) -> Path | None:
        if not self.disk:
            return None
        if self._checked is None:
            if self.directory is None:
                self.directory = default_plan_dir()
            self._checked = _safe_dir(self.directory)
        return self.directory if self._checked else None

    def _path(self, key: str) -> Path | None:
        d = self._dir()
        return d / f"{key}.json" if d is not None else None

    def read(self, key: str) -> dict | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            text = path.read_text(encoding="utf-8")
            entry = json.loads(text)
        except (OSError, ValueError) as exc:
            log.warning("plan cache: unreadable entry %s dropped: %s", path.name, exc)
            self.drop(key)
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or \
                entry.get("key") != key:
            self.drop(key)
            return None
        if not is_sealed(text):
            log.warning("plan cache: entry %s does not match its digest; dropped", path.name)
            self.drop(key)
            return None
        if isinstance(entry.get("nothing_stitched"), str):
            self.failures[key] = entry["nothing_stitched"]
        return entry

    def write(self, key: str, entry: dict) -> None:
        """Store ``entry`` under ``key``, sealed with the digest of its content (any
        ``digest`` it has is replaced)."""
        path = self._path(key)
        if path is None:
            return
        text = sealed_text(entry)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
            except BaseException:
                with _suppress():
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("plan cache: cannot write %s: %s", path, exc)

    def drop(self, key: str) -> None:
        self.dropped += 1
        self.memory.pop(key, None)
        self.failures.pop(key, None)
        path = self._path(key)
        if path is not None:
            with _suppress():
                path.unlink()

    @contextlib.contextmanager
    def planning(self, key: str, cancel: Callable[[], bool] | None = None
                 ) -> Iterator[None]:
        """Held while ``key`` is planned: across processes sharing the directory, one plans
        and the others wait here (then find its entry). ``cancel``: polled while waiting;
        once true, the wait ends (the caller's planning notices the cancel itself). Without
        a disk directory or flock, nothing is held."""
        from stitch.codegen.cache import held_lock
        d = self._dir()
        if d is None or fcntl is None:
            yield
            return
        try:
            (d / ".locks").mkdir(mode=0o700, exist_ok=True)
            fd = os.open(d / ".locks" / f"{key}.lock",
                         os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            log.warning("plan cache: no lock for %s (%s): planning unlocked", key[:12], exc)
            yield
            return
        with held_lock(fd, f"plan cache: {key[:12]}", PLAN_LOCK_TIMEOUT_S, cancel,
                       on_wait=lambda: log.info("plan cache: another process is planning "
                                                "%s; waiting for its plan", key[:12])):
            yield

    # --- memory ------------------------------------------------------------------------
    def remember(self, key: str, plan: FusionPlan) -> None:
        if len(self.memory) >= MEMORY_ENTRIES:
            oldest = next(iter(self.memory))
            self.memory.pop(oldest)
            self.failures.pop(oldest, None)
        self.memory[key] = plan

    # --- plans that stitch nothing --------------------------------------------------------
    def failure(self, key: str) -> str | None:
        """Why the plan of ``key`` stitched nothing when it was fresh, if it did (noted)."""
        return self.failures.get(key)

    def note_failure(self, key: str, reason: str) -> None:
        """Remember that the plan of ``key``, freshly made, stitched nothing, and why: in
        memory and in its disk entry, so no later compile plans it again for that."""
        self.failures[key] = reason
        entry = self.read(key)
        if entry is not None:
            entry["nothing_stitched"] = reason
            self.write(key, entry)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, OSError)


_DEFAULT: PlanCache | None = None


def default_plan_cache() -> PlanCache:
    """The process-wide cache (memory + $STITCH_CACHE_DIR/plans)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PlanCache()
    return _DEFAULT


class StaleEntry(StitchError):
    """A stored plan does not fit the module it was looked up for."""


@dataclasses.dataclass
class StoredGraph:
    """One graph's part of an entry, checked against the graph: the stitched kernels'
    member sets and origins, and the kernels as priced (stitched and baseline, in launch
    order; None for an entry without ``priced`` data: rebuild from the member sets)."""
    sets: list[frozenset[int]]
    origins: list[str]
    kernels: list[PlannedKernel] | None = None
    baseline: list[PlannedKernel] | None = None


KINDS = ("fused", "gemm", "gemm_chain", "opaque", "control")


def stored_graphs(entry: dict, graphs: list[OpGraph]) -> list[StoredGraph]:
    """The stored plans per graph, checked against ``graphs`` (StaleEntry if not)."""
    stored = entry.get("graphs")
    if not isinstance(stored, list) or len(stored) != len(graphs):
        raise StaleEntry("graph count differs")
    out = []
    for g, graph in zip(stored, graphs):
        if not isinstance(g, dict):
            raise StaleEntry(f"graph {graph.name}: malformed entry ({type(g).__name__})")
        if g.get("name") != graph.name or g.get("ops") != len(graph.nodes):
            raise StaleEntry(f"graph {graph.name} differs")
        kernels, origins = g.get("kernels"), g.get("origins")
        if not isinstance(kernels, list) or not isinstance(origins, list) or \
                len(kernels) != len(origins):
            raise StaleEntry("malformed kernels")
        sets = [frozenset(_members(members, graph)) for members in kernels]
        result = StoredGraph(sets, [str(o) for o in origins])
        if "priced" in g:
            try:
                result.kernels, result.baseline = _priced_kernels(g["priced"], graph, kernels,
                                                                  result.origins)
            except DataError as exc:
                raise StaleEntry(f"graph {graph.name}: {exc}") from exc
        out.append(result)
    return out


def _members(members: object, graph: OpGraph) -> tuple[int, ...]:
    """A stored member list: op ids of ``graph``, ascending (StaleEntry if not)."""
    if not isinstance(members, list) or not members or not all(
            type(v) is int and 0 <= v < len(graph.nodes) for v in members):
        raise StaleEntry(f"graph {graph.name}: bad member list")
    if any(a >= b for a, b in zip(members, members[1:])):
        raise StaleEntry(f"graph {graph.name}: member list not ascending")
    return tuple(members)


def _priced_kernels(priced: object, graph: OpGraph, kernels: list, origins: list[str]
                    ) -> tuple[list[PlannedKernel], list[PlannedKernel]]:
    """The stitched and baseline kernels of a graph's ``priced`` data (DataError, or
    StaleEntry, when it is malformed or does not fit ``kernels``)."""
    if not isinstance(priced, dict) or not isinstance(priced.get("kernels"), list) or \
            not isinstance(priced.get("baseline"), list) or \
            len(priced["kernels"]) != len(kernels):
        raise DataError("malformed priced kernels")
    stitched = []
    for members, origin, data in zip(kernels, origins, priced["kernels"]):
        kernel = _kernel(data, _members(members, graph), origin)
        if not isinstance(data.get("note"), str):
            raise DataError("malformed schedule note")
        kernel.schedule_note = data["note"]
        kernel.schedule = decoded(data.get("schedule"), KernelSchedule, optional=True)
        kernel.chain_schedule = decoded(data.get("chain"), GemmChainSchedule, optional=True)
        if kernel.schedule is not None and kernel.schedule.members != kernel.members:
            raise DataError("a schedule of other members")
        stitched.append(kernel)
    baseline = []
    for data in priced["baseline"]:
        if not isinstance(data, dict) or not isinstance(data.get("origin"), str):
            raise DataError("malformed baseline kernel")
        baseline.append(_kernel(data, _members(data.get("members"), graph), data["origin"]))
    return stitched, baseline


def _kernel(data: object, members: tuple[int, ...], origin: str) -> PlannedKernel:
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise DataError("malformed kernel")
    return PlannedKernel(members, data["kind"], decoded(data.get("cost"), KernelCost), origin)
