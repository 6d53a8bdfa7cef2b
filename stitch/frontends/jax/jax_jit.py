"""``stitch.jit``: jax.jit that switches to stitched kernels once they are built.

The first calls of each input signature run stock ``jax.jit``; the signature is lowered on
the calling thread and compiled again by XLA on stitch's compile thread with stitch's pass on
for that compile (``stitch.xla_pass.entry``): XLA hands its fused module to stitch, which puts
its stitched kernels in as FFI custom calls; the next call after that runs that executable.
Any failure while planning, building or running the stitched executable is logged and that
signature stays on stock XLA for good; it is never raised into the caller's loop.
``verify=True`` runs the first stitched call next to the stock one and falls back when they
differ.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stitch.config import (Settings, check_device, check_options, check_target, configure_logging,
                     injected_failure, log_kernels, setting_raw)
from stitch.errors import Cancelled, StitchError, StitchRuntimeError
from stitch.frontends.switching import SwitchEntry, SwitchingFunction
from stitch.frontends.verify import compare_trees
from stitch.xla_pass.xla_stderr import xla_stderr_captured

log = logging.getLogger("stitch.jit")  # the user-facing hierarchy (STITCH_LOG)

VERIFY_RTOL = 1e-4           # relative L2 error tolerated by verify=True (f32 reductions)
# Compiles waiting behind the running one, over all functions; past it the oldest waiting
# signature is dropped and compiled again on its next call.
MAX_WAITING_COMPILES = 8


# ``_split``'s key for a call holding an already deleted (donated) array.
_DELETED = object()


class CompileCancelled(Cancelled):
    """The interpreter is exiting: the compile thread stops between kernels."""


_EXITING = "the compile had not finished when the interpreter exited"


# ------------------------------------------------------------------------ compile thread
class _CompileThread:
    """One daemon thread running compile jobs in order; joined at interpreter exit (a live
    LLVM thread at exit has crashed the process), the running job stops between kernels.

    At most ``max_waiting`` jobs wait: past that the oldest waiting one is cancelled (its
    future's done callbacks say so), so 200 input shapes never queue 200 lowered modules."""

    def __init__(self, max_waiting: int = MAX_WAITING_COMPILES) -> None:
        self.max_waiting = max_waiting
        self._waiting: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self.stopping = threading.Event()

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        dropped: list[Future] = []
        with self._wakeup:
            if self.stopping.is_set():
                future.set_exception(CompileCancelled(_EXITING))
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stitch-compile",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.shutdown)
            self._waiting.append((job, future))
            while len(self._waiting) > self.max_waiting:
                dropped.append(self._waiting.popleft()[1])
            self._wakeup.notify()
        for old in dropped:      # outside the lock: cancel() runs the owners' callbacks
            old.cancel()
        return future

    def waiting(self) -> int:
        with self._wakeup:
            return len(self._waiting)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._waiting and not self.stopping.is_set():
                    self._wakeup.wait()
                if not self._waiting:
                    return
                job, future = self._waiting.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - reported through the future
                    future.set_exception(exc)
            del job, future      # idle, the thread must not keep the last function alive

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop taking jobs; the waiting ones still run, and stop at their first check."""
        with self._wakeup:
            self.stopping.set()
            thread = self._thread
            self._wakeup.notify_all()
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("stitch compile thread still busy after %.0fs at exit", timeout)

    def check(self) -> None:
        if self.stopping.is_set():
            raise CompileCancelled(_EXITING)


COMPILE_THREAD = _CompileThread()


def run_on_compile_thread(job: Callable[[], Any]) -> Any:
    """Run ``job`` on stitch's compile thread and wait for it (keeps LLVM on one thread)."""
    if threading.current_thread().name == "stitch-compile":
        return job()
    return COMPILE_THREAD.submit(job).result()


# ------------------------------------------------------------------------------- entries
@dataclass
class _Entry(SwitchEntry):
    # Leaf indices (dynamic args and kwargs flattened) the caller donated, when the stitched
    # executable lost XLA's input/output aliasing: deleted by hand after each call.
    donated_leaves: tuple[int, ...] = ()
    device: str = ""          # where its stitched kernels run ("cpu" | "gpu"), once compiling


def _stock_jit() -> Callable:
    import jax
    return getattr(jax.jit, "__stitch_original__", jax.jit)


@functools.lru_cache(maxsize=1)
def _array_type() -> type:
    import jax
    return type(jax.numpy.zeros(()))


class StitchedFunction(SwitchingFunction):
    """The callable ``stitch.jit`` returns; attributes it lacks (``lower``, ``trace``...)
    come from the stock ``jax.jit`` function."""

    entry_type = _Entry
    job_decisions = True      # in a jax.distributed job, switch and keep with the job

    def __init__(self, fn: Callable, *, target: str | None, device: str | None,
                 async_compile: bool, verify: bool | int | None, guard: bool,
                 static_argnums: Sequence[int],
                 static_argnames: Sequence[str], jit_kwargs: dict, settings: Settings):
        configure_logging()
        self.fn = fn
        self.target = target or settings.target
        self.device = device or settings.device
        # Settings stitch cannot read leave the function on stock jax (reported once by
        # Settings.read); the program still runs, exactly as jax.jit would run it.
        self.disabled_reason = "; ".join(settings.problems)
        self.async_compile = async_compile
        # verify=None: the first stitched call is checked where stitched kernels run on a
        # GPU (a launch failure or a wrong kernel shows there first), not on the host.
        self.verify = verify
        self._init_switching(guard)
        self.static_argnums = tuple(sorted(int(i) for i in static_argnums))
        self.static_argnames = tuple(static_argnames)
        self.stock = _stock_jit()(fn, static_argnums=self.static_argnums,
                                  static_argnames=self.static_argnames, **jit_kwargs)
        self._jitted = self.stock       # what is lowered for the pass (tests may wrap stock)
        # jax.jit functions report their compiled-signature count (private but long-lived
        # API); without it every call computes our own key.
        self._jax_cache_size = callable(getattr(self.stock, "_cache_size", None))
        self._signature = _safe_signature(fn)
        if self.disabled_reason:
            self.stats.fallbacks.append(f"unreadable settings: {self.disabled_reason}")
        self.__name__ = getattr(fn, "__name__", "fn")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["stock"], name)

    def __repr__(self) -> str:
        return f"stitch.jit({self.__qualname__}, target={self.target!r})"

    # --- signatures ---------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict, deleted_ok: bool = False
               ) -> tuple[Any, tuple, dict]:
        """(cache key or None, dynamic positional args, dynamic keyword args).

        The key follows jax's own cache: each leaf's abstract value as jax types it (shape,
        dtype and weak type: a Python ``2.0`` is a weak f32, ``np.float64(2.0)`` a strong
        one, and they give different result dtypes), the sharding of committed arrays (an
        executable runs on the devices it was compiled for) and the x64 flag. None (run
        stock) inside another trace; ``_DELETED`` when an array is already deleted
        (donated), unless ``deleted_ok`` (keyed as when it was live): ``_call_deleted``
        lets jax raise the caller's error."""
        import jax

        # Negative static_argnums count from the end of this call's positional arguments,
        # as jax.jit counts them.
        static_pos = {i if i >= 0 else len(args) + i for i in self.static_argnums}
        for name in self.static_argnames:
            if name not in kwargs and self._signature is not None:
                params = list(self._signature.parameters)
                if name in params and params.index(name) < len(args):
                    static_pos.add(params.index(name))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        static = tuple((i, args[i]) for i in sorted(static_pos) if i < len(args))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static += tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        if not _trace_state_clean():
            return None, dyn_args, dyn_kwargs
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        array_type = _array_type()
        avals = []
        for x in leaves:
            if type(x) is array_type:          # the common case: a jax array
                if not deleted_ok and x.is_deleted():
                    return _DELETED, dyn_args, dyn_kwargs
                avals.append((x.shape, x.dtype, x.weak_type,
                              x.sharding if x.committed else None))
                continue
            if isinstance(x, jax.core.Tracer):
                return None, dyn_args, dyn_kwargs
            try:
                aval = _typeof(x)
            except TypeError:                  # not an array jax accepts: jax says why
                return None, dyn_args, dyn_kwargs
            # dtype objects hash and compare by value; str(dtype) costs microseconds.
            avals.append((tuple(aval.shape), aval.dtype, aval.weak_type,
                          x.sharding if isinstance(x, jax.Array) and x.committed else None))
        try:
            key = (tree, tuple(avals), static, _x64_enabled())
            hash(key)
        except TypeError:
            return None, dyn_args, dyn_kwargs
        return key, dyn_args, dyn_kwargs

    # --- calling ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.disabled_reason:
            return self.stock(*args, **kwargs)
        if self._fast_stock_path():
            # No signature runs stitched: let jax's own dispatch find the signature. Its
            # cache grows only for a signature it has not seen, which we must compile too.
            before = self._jitted._cache_size()
            result = self.stock(*args, **kwargs)
            if self._jitted._cache_size() == before:
                with self._lock:
                    self.stats.calls += 1
                    if len(self._entries) == 1:      # the signature is the one there is
                        next(iter(self._entries.values())).counters.calls += 1
                return result
            key = self._split(args, kwargs)[0]
            self._count_call(None if key is _DELETED else key, args, kwargs)
            return result
        key, dyn_args, dyn_kwargs = self._split(args, kwargs)
        if key is _DELETED:
            return self._call_deleted(args, kwargs)
        entry, call_number = self._count_call(key, args, kwargs)
        if self._undecided:
            self._job_gate(call_number)
        if entry is None or entry.state != "ready":
            return self.stock(*args, **kwargs)
        if self._in_guard_trial(entry):
            return self._guarded_call(entry, dyn_args, dyn_kwargs, args, kwargs, call_number)
        return self._call_stitched(entry, dyn_args, dyn_kwargs, args, kwargs, call_number)

    def _call_deleted(self, args: tuple, kwargs: dict) -> Any:
        """A call holding an already deleted array: the caller's error, raised as jax.jit
        raises it, by the executable jax.jit would run, unwrapped and uncaught. That is the
        stitched one where the signature runs stitched (its call donated the array; stock
        jax may never have run the signature, and jax checks a signature it has not run
        differently), else stock. A donated buffer: a ValueError from Execute; an array
        the caller deleted: a RuntimeError. The signature's state does not change."""
        key, dyn_args, dyn_kwargs = self._split(args, kwargs, deleted_ok=True)
        with self._lock:              # counted, never a new signature (nor its compile)
            self.stats.calls += 1
            call_number = self.stats.calls
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                entry.counters.calls += 1
        call = entry.call if entry is not None and entry.state == "ready" else None
        if call is None:
            return self.stock(*args, **kwargs)
        result = call(*dyn_args, **dyn_kwargs)
        # It ran: the deleted array was an argument the program does not use.
        if entry.donated_leaves:
            _delete_donated((dyn_args, dyn_kwargs), entry.donated_leaves)
        self._count_stitched(entry, call_number)
        return result

    def _guarded_call(self, entry: _Entry, dyn_args: tuple, dyn_kwargs: dict, args: tuple,
                      kwargs: dict, call_number: int) -> Any:
        """A guard trial call (switching.py), timed to completion."""
        import jax

        stitched_turn = self._stitched_turn(entry)
        start = time.perf_counter()
        if stitched_turn:
            result = self._call_stitched(entry, dyn_args, dyn_kwargs, args, kwargs,
                                         call_number)
        else:
            result = self.stock(*args, **kwargs)
        jax.block_until_ready(result)
        self._guard_record(entry, stitched_turn, time.perf_counter() - start)
        return result

    def _fast_stock_path(self) -> bool:
        """Every signature seen so far settled on stock XLA (or compiling): the call needs no
        signature key of ours (it costs ~30 us per call in Python). A new signature then
        runs stock first and compiles after (in sync mode, before returning)."""
        entries = list(self._entries.values())
        # jax shares one compiled-signature cache among all jax.jit wrappers of a function:
        # the first signature always takes the slow path; a later one that jax compiled
        # for another wrapper first stays on stock XLA (correct, just not stitched).
        return (self._jax_cache_size and bool(entries) and not self._undecided
                and not any(e.state in ("ready", "dropped") for e in entries))

    def _call_stitched(self, entry: _Entry, dyn_args: tuple, dyn_kwargs: dict, args: tuple,
                       kwargs: dict, call_number: int) -> Any:
        expected = None
        check = self._verify_this_call(entry)
        try:
            injected_failure("run")
            if check:
                # Stock first, on copies: the stitched call may donate the caller's buffers.
                expected = self.stock(*_copies(args), **_copies(kwargs))
            result = entry.call(*dyn_args, **dyn_kwargs)
            if entry.donated_leaves:
                _delete_donated((dyn_args, dyn_kwargs), entry.donated_leaves)
            if check:
                reason = compare_trees(result, expected, VERIFY_RTOL)
                if reason is not None:
                    self._fail(entry, f"verify: stitched result differs from XLA ({reason})")
                    return expected
                entry.verified = True
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            failure = exc
        else:
            self._count_stitched(entry, call_number)
            return result
        reason = f"stitched call failed: {type(failure).__name__}: {failure}"
        if expected is not None:
            self._fail(entry, reason)
            return expected
        if _any_deleted((dyn_args, dyn_kwargs)):
            # The failed call consumed donated inputs (_split let no deleted array through):
            # stock cannot run on them either.
            self._fail(entry, reason)
            raise StitchRuntimeError(f"{self.__qualname__}: {reason}, after its donated "
                                     "inputs were consumed") from failure
        # Stock decides whose error it was: if it raises too, the error is the caller's and
        # reaches them as jax.jit raises it (outside this handler: no chained stitch error),
        # the signature staying stitched; if it runs, the stitched program is at fault.
        result = self.stock(*args, **kwargs)
        self._fail(entry, reason)
        return result

    def _verify_this_call(self, entry: _Entry) -> bool:
        """verify=True checks the first stitched call; verify=N every N-th, from the first;
        None (the default when STITCH_VERIFY is unset) the first on a GPU."""
        if self.verify is None:
            return entry.device == "gpu" and not entry.verified
        if not self.verify:
            return False
        if self.verify is True:
            return not entry.verified
        return entry.counters.stitched_calls % int(self.verify) == 0

    # --- compiling ----------------------------------------------------------------------
    def _start_compile(self, entry: _Entry, args: tuple, kwargs: dict, call_number: int) -> None:
        # Lowered here, on the calling thread: tracing may need the caller's context (flax
        # nnx.jit's update context is thread-local), and jax has just traced this signature
        # for the stock call, so it costs little. Only the Lowered (abstract values, no
        # buffers) goes to the compile thread.
        start = time.perf_counter()
        try:
            injected_failure("compile")
            lowered = self._jitted.lower(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - stays on stock jax
            if isinstance(exc, StitchError):
                self._compile_failed(entry, time.perf_counter() - start, exc)
            else:
                # jax's own error (an untraceable function): the stock call raises it to
                # the caller as jax.jit does; a second line from stitch would only repeat it.
                self._fail(entry, f"jax could not lower the function: {type(exc).__name__}: "
                                  f"{exc}", quiet=True)
            return
        log.info("%s: compiling stitched kernels for %s (call %d, %s)", self.__qualname__,
                 self.target, call_number, "in the background" if self.async_compile
                 else "before running")
        job = functools.partial(self._compile, entry, lowered, time.perf_counter() - start)
        entry.future = COMPILE_THREAD.submit(job)
        entry.future.add_done_callback(
            lambda future: future.cancelled() and self._dropped_from_queue(entry))
        if not self.async_compile:
            try:
                entry.future.result()
            except Exception:  # noqa: BLE001 - recorded by _compile; Ctrl-C propagates
                pass

    def _compile(self, entry: _Entry, lowered: Any, earlier: float) -> None:
        """The same lowered function compiled by XLA with stitch's pass on for it."""
        from stitch.xla_pass.entry import PassRequest, compile_with_pass, ensure_registered

        start = time.perf_counter() - earlier
        xla_said = None
        try:
            COMPILE_THREAD.check()         # queued before exit began: record it, do not compile
            device = entry.device = self.device or _default_device()
            ensure_registered("cpu" if device == "cpu" else "cuda")
            request = PassRequest(self.__qualname__, self.target, device,
                                  cancel=COMPILE_THREAD.stopping.is_set)
            # XLA's C++ lines about this attempt (a module it rejects before the retry)
            # are said in one stitch line, not printed raw (xla_stderr.py).
            with xla_stderr_captured() as xla_said:
                compiled, report = compile_with_pass(lowered, request)
            if xla_said.lines:
                log.info("%s: XLA's log during stitch's compile, recovered from: %s",
                         self.__qualname__, xla_said.gist())
            if not report.kernels_stitched:
                raise StitchError(report.reason_nothing_stitched())
            if log_kernels():
                log.info("%s: stitched module:\n%s", self.__qualname__, compiled.as_text())
        except BaseException as exc:  # noqa: BLE001 - any failure means stock XLA
            self._compile_failed(entry, time.perf_counter() - start, exc,
                                 xla_said=xla_said.gist() if xla_said is not None else "")
            if not isinstance(exc, Exception):
                raise                            # Ctrl-C / SystemExit: recorded, then out
            return
        elapsed = time.perf_counter() - start
        entry.call = compiled
        entry.donated_leaves = _lost_donations(lowered, compiled)
        self._program_ready(entry, report, elapsed)
        log.debug("%s: stitched executable ready in %.1fs: %d stitched kernels (%d left to "
                  "XLA)", self.__qualname__, elapsed, report.kernels_stitched,
                  len(report.fallbacks))


def _copies(tree: Any) -> Any:
    """Fresh copies of the jax arrays in ``tree`` (what a donating call may delete)."""
    import jax
    return jax.tree_util.tree_map(
        lambda x: jax.numpy.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def _lost_donations(lowered: Any, compiled: Any) -> tuple[int, ...]:
    """The donated leaves, when the stitched executable has no input/output aliasing left.

    jaxlib 0.10.2's HLO transformation hook rebuilds the module it gets back without its
    ``input_output_alias`` (``HloModule::ReplaceEntryComputation`` resets it, even for
    unchanged bytes), so XLA neither reuses nor frees the donated buffers. The caller was
    promised they are gone after the call: stitch deletes them itself (memory is freed after
    the call instead of reused during it). jaxlib 0.11 keeps the aliasing: nothing is lost
    there and XLA updates the donated buffers in place, as jax.jit does."""
    import jax

    donated = tuple(i for i, info in enumerate(jax.tree_util.tree_leaves(lowered.args_info))
                    if getattr(info, "donated", False))
    if not donated or "input_output_alias=" in compiled.as_text()[:20_000]:
        return ()
    log.debug("stitched executable lost XLA's input/output aliasing: %d donated buffers "
              "are deleted after each call", len(donated))
    return donated


def _delete_donated(tree: Any, leaves: tuple[int, ...]) -> None:
    """Delete the donated ``leaves`` of ``tree`` as XLA's donation does: their buffers
    handed to ``device_put(donate=True)`` and freed with its result, so a later call with
    them raises what jax.jit raises for a donated array (``Array.delete()`` instead leaves
    an array jax reports as deleted by the caller: another exception). Whatever that did
    not delete is deleted by hand."""
    import jax
    flat = jax.tree_util.tree_leaves(tree)
    donated = [flat[i] for i in leaves if i < len(flat)]
    donated = [x for x in donated if isinstance(x, jax.Array) and not x.is_deleted()]
    if not donated:
        return
    try:
        for taken in jax.device_put(donated, donate=True, may_alias=False):
            taken.delete()
    except Exception as exc:  # noqa: BLE001 - deleted by hand below
        log.debug("donated buffers deleted by hand: device_put(donate=True) failed: %s", exc)
    for x in donated:
        if not x.is_deleted():
            x.delete()


def _any_deleted(tree: Any) -> bool:
    import jax
    return any(isinstance(x, jax.Array) and x.is_deleted()
               for x in jax.tree_util.tree_leaves(tree))


def _typeof(x: Any) -> Any:
    """jax's abstract value of an argument (weak type included), as jax.jit keys it."""
    import jax
    typeof = getattr(jax, "typeof", None)
    if typeof is not None:
        return typeof(x)
    from jax._src import api_util          # jax < 0.6 has no public typeof
    return api_util.shaped_abstractify(x)


def _x64_enabled() -> bool:
    import jax
    return bool(jax.config.jax_enable_x64)


def _trace_state_clean() -> bool:
    """False inside another trace (an outer jax.jit, grad, vmap...): such a call must go to
    stock jax so the outer trace sees jax's own primitive."""
    from jax._src import core
    return core.trace_state_clean()


def _default_device() -> str:
    import jax
    return "gpu" if jax.default_backend() == "gpu" else "cpu"


def _verify_default(settings: Settings) -> bool | int | None:
    """STITCH_VERIFY when set; else None: the first stitched call verified on a GPU."""
    if (setting_raw("STITCH_VERIFY") or "").strip():
        return settings.verify
    return None


def _safe_signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _argnums(argnums: Sequence[int] | None) -> tuple[int, ...]:
    """static_argnums as a tuple; anything but whole numbers is a TypeError, as jax says it."""
    got = tuple(argnums or ())
    for i in got:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"static_argnums: {i!r} cannot be interpreted as an integer")
    return got


def jit(fn: Callable | None = None, *, target: str | None = None, device: str | None = None,
        async_compile: bool | None = None, verify: bool | None = None,
        guard: bool | None = None, static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None, **jit_kwargs: Any) -> Any:
    """Like ``jax.jit``, switching to stitched kernels once they are built (module docstring).

    ``target``: the GPU the fusion plan is made for (default STITCH_TARGET or "h100");
    ``device``: "cpu" runs the stitched kernels' host programs, "gpu" their PTX (default:
    gpu when jax has one); ``async_compile`` (default STITCH_ASYNC, on): compile in the
    background while stock XLA runs; ``verify`` (default STITCH_VERIFY; unset: on a GPU,
    on the host off): check the first stitched call against XLA (on copies of the
    arguments, so a failure never reruns stock on donated buffers); ``guard`` (default
    STITCH_GUARD, on): time the first calls after the switch on both paths and keep the
    faster. Other keyword arguments go to ``jax.jit``.
    Usable as ``@stitch.jit`` or ``@stitch.jit(target="v100")``.
    """
    configure_logging()                  # before the settings: a problem is logged through it
    # A wrong argument is the caller's mistake: raised here, as jax.jit raises its own.
    target, device = check_target(target), check_device(device)
    check_options(async_compile=async_compile, verify=verify, guard=guard)
    settings = Settings.read()           # unreadable ones: StitchedFunction stays stock
    options = dict(target=target, device=device,
                   async_compile=settings.async_compile if async_compile is None else async_compile,
                   verify=_verify_default(settings) if verify is None else verify,
                   guard=settings.guard if guard is None else guard,
                   static_argnums=(static_argnums,) if isinstance(static_argnums, int)
                   else _argnums(static_argnums),
                   static_argnames=(static_argnames,) if isinstance(static_argnames, str)
                   else tuple(static_argnames or ()),
                   jit_kwargs=jit_kwargs, settings=settings)
    if fn is None:
        return lambda f: StitchedFunction(f, **options)
    return StitchedFunction(fn, **options)
