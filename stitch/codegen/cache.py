"""On-disk compile cache: build products (host object code, PTX, cubins) keyed by a hash of
everything that produced them.

A cache entry can be native code that gets loaded into this process, so the rule is that the
cache may make stitch faster but must never make it run code it did not build, nor crash or
hang it:

- The directory is created 0700 and refused (a logged warning naming the path and the reason;
  the cache is off, compilation goes on) when it is a symlink, is not owned by the current
  user, is group/world-writable, or holds a symlink. Every entry is opened relative to the
  directory's descriptor with ``O_NOFOLLOW | O_NONBLOCK`` and read only when ``fstat`` says it
  is a regular file under a size cap (a FIFO cannot block, a link to /dev/zero cannot eat
  memory).
- Each entry carries an HMAC-SHA256 over its key and payload with a per-user secret (32 random
  bytes, created once 0600 in the directory and read with the same checks). An entry whose MAC
  fails is logged, removed and rebuilt, never returned. Callers may add a ``validate`` check
  of the payload (``stitch.codegen.objcheck`` for host objects) as defence in depth.
- Entries are written 0600, atomically (temp file + ``os.replace``); temporaries older than an
  hour (left by a killed writer) are swept when the cache is opened. ``get_or_create`` takes a
  per-key advisory lock, so concurrent processes build each entry once.
- A read-only directory that already holds entries (and the secret) is still read; only writes
  are skipped.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import logging
import os
import pathlib
import re
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

try:  # POSIX only; elsewhere atomic replace alone keeps readers safe (builds may duplicate).
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MAGIC = b"STCC"
FORMAT_VERSION = 2  # 2: HMAC over key + payload (1 was a plain sha256 of the payload)
_HEADER = struct.Struct("<4sHQ32s")  # magic, format version, payload length, HMAC-SHA256
_KEY_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_ENTRY_SUFFIX = ".bin"
_TMP_PREFIX = ".tmp-"
_LOCK_DIR = ".locks"
SECRET_NAME = "secret.key"
SECRET_BYTES = 32
_KEY_DOMAIN = b"stitch-compile-cache-v1"  # bump to orphan every old key at once
_MAC_DOMAIN = b"stitch-compile-cache-entry-v2"
DEFAULT_MAX_ENTRY_BYTES = 256 << 20  # no kernel's object, PTX or cubin comes near this
STALE_TEMP_SECONDS = 3600.0
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

Validator = Callable[[bytes], "str | None"]  # None: the payload is fine; else why it is not


def default_cache_dir() -> pathlib.Path:
    """$STITCH_CACHE_DIR, else $XDG_CACHE_HOME/stitch, else ~/.cache/stitch."""
    if explicit := os.environ.get("STITCH_CACHE_DIR"):
        return pathlib.Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(xdg) / "stitch"
    return pathlib.Path.home() / ".cache" / "stitch"


def _length_prefixed(h: "hashlib._Hash | hmac.HMAC", *parts: str | bytes) -> None:
    # Length prefixes keep ("ab", "c") != ("a", "bc").
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(struct.pack("<Q", len(data)))
        h.update(data)


# The packages whose code decides what a cached plan or PTX holds (``source_digest``).
# Folders of the stitch package; "" is its top-level files alone. Every folder the planner
# imports is listed (tests/test_import_layers.py checks).
PLANNING_PACKAGES = ("hlo", "codegen", "analysis", "cost", "schedule", "pricing",
                     "explorer", "models", "")
CODEGEN_PACKAGES = ("hlo", "codegen")
_SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent   # the stitch package


@functools.lru_cache(maxsize=None)
def source_digest(packages: tuple[str, ...], root: pathlib.Path = _SOURCE_ROOT) -> str:
    """sha256 (first 16 hex digits) over the ``.py`` files of ``packages`` (folders under
    ``root``; "" is root's own files, not its folders) (relative path and bytes, in path order): a version that changes with any edit to the
    code, where the distribution's version string does not (an editable install, a
    checkout between releases). Once per process: ~1 MB read, a few milliseconds."""
    h = hashlib.sha256()
    for package in packages:
        base = root / package
        for path in sorted(base.rglob("*.py") if package else base.glob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            _length_prefixed(h, path.relative_to(root).as_posix(), data)
    return h.hexdigest()[:16]


def cache_key(*parts: str | bytes) -> str:
    """sha256 hex over length-prefixed parts."""
    h = hashlib.sha256(_KEY_DOMAIN)
    _length_prefixed(h, *parts)
    return h.hexdigest()


def entry_mac(secret: bytes, key: str, payload: bytes) -> bytes:
    """HMAC-SHA256 binding ``payload`` to ``key`` (an entry copied under another key fails)."""
    mac = hmac.new(secret, _MAC_DOMAIN, hashlib.sha256)
    _length_prefixed(mac, key, payload)
    return mac.digest()


def encode_entry(secret: bytes, key: str, payload: bytes) -> bytes:
    payload = bytes(payload)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), entry_mac(secret, key, payload)) + payload


def decode_entry(secret: bytes, key: str, blob: bytes) -> bytes | None:
    """The payload, or None when the blob is truncated, of another format, or its MAC fails."""
    if len(blob) < _HEADER.size:
        return None
    magic, version, length, mac = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or version != FORMAT_VERSION or length != len(payload):
        return None
    if not hmac.compare_digest(mac, entry_mac(secret, key, payload)):
        return None
    return payload


def _other_format(blob: bytes) -> bool:
    return (len(blob) >= _HEADER.size and blob[:4] == MAGIC
            and _HEADER.unpack_from(blob)[1] != FORMAT_VERSION)


class _Refused(Exception):
    """The directory (or its secret) cannot be trusted; the message says why."""


class _Unsafe(Exception):
    """One file in the directory is not something we may read; the message says why."""


def _describe_mode(mode: int) -> str:
    return f"mode {stat.S_IMODE(mode):04o}"


def _read_regular(dir_fd: int, name: str, cap: int) -> tuple[bytes, os.stat_result]:
    """Bytes of ``name`` under ``dir_fd``: never follows a link, never blocks on a FIFO, never
    reads more than ``cap`` bytes. FileNotFoundError when absent; _Unsafe otherwise."""
    try:
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unsafe("is a symbolic link") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unsafe("is not a regular file")
        if st.st_size > cap:
            raise _Unsafe(f"is {st.st_size} bytes, over the {cap}-byte cap")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, cap + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise _Unsafe(f"grew over the {cap}-byte cap while being read")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _probe_writable(dir_fd: int) -> None:
    """Raises OSError unless a file can be created in the directory (mode bits are not proof:
    a read-only mount or an ACL can forbid it)."""
    name = f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    os.close(fd)
    os.unlink(name, dir_fd=dir_fd)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0          # entries whose header or MAC failed (removed, never returned)
    unsafe: int = 0           # entries that were not regular files / over the cap (removed)
    invalid: int = 0          # authenticated entries the caller's validate() rejected (removed)
    rebuilt_corrupt: int = 0  # of the three above, rebuilt by get_or_create
    builds: int = 0           # build() calls made by get_or_create
    write_errors: int = 0
    swept_temps: int = 0      # stale temporaries removed when the cache was opened


class CompileCache:
    """Bytes by key under ``directory`` (default: ``default_cache_dir()``).

    ``enabled`` is False when the directory was refused (the reason is logged and kept in
    ``disabled_reason``); ``writable`` is False for a read-only cache (read, never written).
    ``lock_timeout`` bounds how long get_or_create waits for another process's build before
    building itself (atomic replace keeps that safe, only wasteful).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 lock_timeout: float = 600.0, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 stale_temp_seconds: float = STALE_TEMP_SECONDS) -> None:
        self.directory = pathlib.Path(directory) if directory is not None else default_cache_dir()
        self.lock_timeout = lock_timeout
        self.max_entry_bytes = max_entry_bytes
        self.stale_temp_seconds = stale_temp_seconds
        self.stats = CacheStats()
        self.enabled = False
        self.writable = False
        self.disabled_reason = ""
        self._fds: list[int] = []  # closed by the finalizer (or close())
        self._closer = weakref.finalize(self, _close_fds, self._fds)
        # Not at interpreter exit: a compile still finishing then (joined by an exit hook
        # that may run after weakref's) would use closed descriptors, or worse, numbers
        # reused for unrelated files. The process's end closes them.
        self._closer.atexit = False
        self._dir_fd = -1
        self._locks_fd = -1
        self._secret = b""
        try:
            self._open()
            self.enabled = True
        except (_Refused, OSError) as exc:
            reason = str(exc) if isinstance(exc, _Refused) else f"cannot be used ({exc})"
            self.disabled_reason = reason
            log.warning("compile cache disabled: %s %s; compiling without it", self.directory, reason)
            self.close()

    # ------------------------------------------------------------------------------ opening

    def _open(self) -> None:
        path = self.directory
        created = False
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
                created = True
            except FileExistsError:
                pass  # another process made it first: checked below like any other
            st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise _Refused("is a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            raise _Refused("is not a directory")
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Refused("is a symbolic link") from exc
            raise
        self._fds.append(fd)
        self._dir_fd = fd
        if created:
            os.fchmod(fd, 0o700)  # mkdir's mode is filtered by the umask; be exact
        self._check_owned(os.fstat(fd), "is")
        try:
            _probe_writable(fd)
            self.writable = True
        except OSError as exc:
            log.info("compile cache %s is read-only (%s): entries are read, not written",
                     path, exc)
        self._scan()
        self._open_locks()
        self._secret = self._load_secret()

    def _check_owned(self, st: os.stat_result, what: str) -> None:
        uid = os.geteuid()
        if st.st_uid != uid:
            raise _Refused(f"{what} owned by uid {st.st_uid}, not by this user (uid {uid})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise _Refused(f"{what} writable by group or others ({_describe_mode(st.st_mode)}; "
                           "if it is yours and trusted, chmod go-w it)")

    def _scan(self) -> None:
        """Refuse a directory holding symlinks (stitch never makes one); sweep temporaries a
        killed writer left behind."""
        now = time.time()
        for name in os.listdir(self._dir_fd):
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise _Refused(f"holds a symbolic link ({name})")
            if (name.startswith(_TMP_PREFIX) and self.writable and stat.S_ISREG(st.st_mode)
                    and now - st.st_mtime > self.stale_temp_seconds):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir_fd)
                    self.stats.swept_temps += 1
                    log.info("compile cache: removed stale temporary %s (%d bytes)",
                             self.directory / name, st.st_size)

    def _open_locks(self) -> None:
        if not self.writable or fcntl is None:
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(_LOCK_DIR, 0o700, dir_fd=self._dir_fd)
        try:
            fd = os.open(_LOCK_DIR, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                         dir_fd=self._dir_fd)
        except OSError as exc:
            log.warning("compile cache: no lock directory in %s (%s); builds are not "
                        "coordinated across processes", self.directory, exc)
            return
        self._fds.append(fd)
        self._check_owned(os.fstat(fd), f"has a lock directory {_LOCK_DIR} that is")
        self._locks_fd = fd

    def _load_secret(self) -> bytes:
        try:
            return self._read_secret()
        except FileNotFoundError:
            if not self.writable:
                raise _Refused(f"is read-only and holds no {SECRET_NAME} to check entries "
                               f"with") from None
        tmp = f"{_TMP_PREFIX}secret-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600,
                     dir_fd=self._dir_fd)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
        finally:
            os.close(fd)
        try:
            # link, not replace: when two processes race, the first secret wins for both.
            os.link(tmp, SECRET_NAME, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
        return self._read_secret()

    def _read_secret(self) -> bytes:
        try:
            data, st = _read_regular(self._dir_fd, SECRET_NAME, SECRET_BYTES)
        except _Unsafe as exc:
            raise _Refused(f"has a {SECRET_NAME} that {exc}") from None
        self._check_owned(st, f"has a {SECRET_NAME}")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise _Refused(f"has a {SECRET_NAME} others can read ({_describe_mode(st.st_mode)})")
        if len(data) != SECRET_BYTES:
            raise _Refused(f"has a {SECRET_NAME} of {len(data)} bytes, not {SECRET_BYTES}")
        return data

    def close(self) -> None:
        """Release the directory's descriptors; the cache is off afterwards."""
        self.enabled = False
        self.writable = False
        _close_fds(self._fds)
        self._fds.clear()
        self._dir_fd = self._locks_fd = -1

    # ------------------------------------------------------------------------------ read/write

    def _name(self, key: str) -> str:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r} (use cache_key())")
        return key + _ENTRY_SUFFIX

    def _discard(self, name: str) -> None:
        if self.writable:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._dir_fd)

    def _read(self, key: str, validate: Validator | None = None) -> tuple[bytes | None, bool]:
        """(payload, was_rejected). A rejected entry is removed so the next write starts clean."""
        name = self._name(key)
        if not self.enabled:
            return None, False
        path = self.directory / name
        try:
            blob, _ = _read_regular(self._dir_fd, name, self.max_entry_bytes + _HEADER.size)
        except FileNotFoundError:
            return None, False
        except _Unsafe as exc:
            log.warning("compile cache: ignoring entry %s: it %s; rebuilding", path, exc)
            self.stats.unsafe += 1
            self._discard(name)
            return None, True
        except OSError as exc:
            log.warning("compile cache: cannot read %s (%s)", path, exc)
            return None, False
        payload = decode_entry(self._secret, key, blob)
        if payload is None and _other_format(blob):
            # Written by an older stitch (format 1 had no MAC): not trusted, quietly replaced.
            log.info("compile cache: entry %s has another format version; rebuilding", path)
            self.stats.corrupt += 1
            self._discard(name)
            return None, True
        if payload is None:
            log.warning("compile cache: entry %s (%d bytes) is damaged or failed authentication "
                        "(not written by this user's stitch); ignored and rebuilt", path, len(blob))
            self.stats.corrupt += 1
            self._discard(name)
            return None, True
        if validate is not None and (problem := validate(payload)) is not None:
            log.warning("compile cache: entry %s rejected: %s; rebuilding", path, problem)
            self.stats.invalid += 1
            self._discard(name)
            return None, True
        return payload, False

    def get(self, key: str, validate: Validator | None = None) -> bytes | None:
        """The payload stored under ``key`` (authenticated, and passing ``validate`` if given),
        else None. Does not lock: use get_or_create to build."""
        payload, _ = self._read(key, validate)
        if payload is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return payload

    def put(self, key: str, data: bytes) -> None:
        name = self._name(key)
        if not (self.enabled and self.writable):
            return
        if len(data) > self.max_entry_bytes:
            log.info("compile cache: %d-byte entry %s over the cap; not stored", len(data), key)
            return
        tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}{_ENTRY_SUFFIX}"
        written = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                         0o600, dir_fd=self._dir_fd)
            written = True
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(encode_entry(self._secret, key, data))
            # No fsync: a crash can leave a torn file only on power loss, and the MAC catches
            # that; readers never see a partial file thanks to rename atomicity.
            os.replace(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            written = False
        except OSError as exc:
            self.stats.write_errors += 1
            log.warning("compile cache: cannot write %s (%s); continuing uncached",
                        self.directory / name, exc)
        finally:
            if written:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self._dir_fd)

    def get_or_create(self, key: str, build: Callable[[], bytes], *,
                      validate: Validator | None = None) -> bytes:
        """The cached bytes for ``key``, else ``build()`` once (across processes), stored.

        ``validate(payload)`` returns None for a usable payload, else the reason it is not (the
        entry is then removed and rebuilt)."""
        payload, rejected = self._read(key, validate)
        if payload is not None:
            self.stats.hits += 1
            return payload
        with self._key_lock(key):
            # Another process may have built it while we waited for the lock.
            payload, rejected_again = self._read(key, validate)
            rejected = rejected or rejected_again
            if payload is not None:
                self.stats.hits += 1
                return payload
            self.stats.misses += 1
            self.stats.builds += 1
            if rejected:
                self.stats.rebuilt_corrupt += 1
            data = build()
            self.put(key, data)
            return data

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        if not self.enabled or self._locks_fd < 0 or fcntl is None:
            yield
            return
        lock_name = key + ".lock"
        try:
            fd = os.open(lock_name, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o600,
                         dir_fd=self._locks_fd)
        except OSError as exc:
            log.warning("compile cache: cannot open lock %s (%s); building unlocked",
                        self.directory / _LOCK_DIR / lock_name, exc)
            yield
            return
        with held_lock(fd, f"compile cache: {lock_name}", self.lock_timeout):
            yield

    def clear(self) -> None:
        """Remove every entry (and temp/lock files); the secret and stats are kept."""
        if not (self.enabled and self.writable):
            return
        for name in os.listdir(self._dir_fd):
            if name.endswith(_ENTRY_SUFFIX) or name.startswith(_TMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir_fd)
        if self._locks_fd >= 0:
            for name in os.listdir(self._locks_fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._locks_fd)

    def __contains__(self, key: str) -> bool:
        return self._read(key)[0] is not None


@contextlib.contextmanager
def held_lock(fd: int, what: str, timeout: float,
              cancel: Callable[[], bool] | None = None,
              on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """An exclusive ``flock`` on ``fd`` (closed on exit) held for the block; yields whether
    it was taken. Polled rather than blocking, so a holder that hangs cannot stall everyone:
    after ``timeout`` seconds, or once ``cancel()`` is true, the block runs unlocked (said
    with ``what``). ``on_wait``: called once when another process holds it."""
    locked = False
    try:
        deadline = time.monotonic() + timeout
        delay, waited = 0.001, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if on_wait is not None and not waited:
                    on_wait()
                waited = True
                if time.monotonic() >= deadline:
                    log.warning("%s: waited %.0fs for another process; going on without the "
                                "lock", what, timeout)
                    break
                if cancel is not None and cancel():
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as exc:  # e.g. a filesystem without flock support
                log.warning("%s: cannot lock (%s); going on unlocked", what, exc)
                break
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
