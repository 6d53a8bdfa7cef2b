"""On-disk compile cache: PTX/cubin bytes keyed by a hash of everything that produced them.

Entries are written atomically (temp file + ``os.replace``) behind a header carrying a magic, a
format version, the payload length and its sha256, so a torn or corrupted file is detected on
read and rebuilt instead of being handed to the driver. ``get_or_create`` takes an advisory lock
per key so concurrent processes build a kernel once. The cache is an optimisation only: any
filesystem trouble is logged and the caller still gets its bytes.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import re
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

try:  # POSIX only; elsewhere atomic replace alone keeps readers safe (builds may duplicate).
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MAGIC = b"STCC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHQ32s")  # magic, format version, payload length, sha256(payload)
_KEY_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_ENTRY_SUFFIX = ".bin"
_LOCK_DIR = ".locks"
_KEY_DOMAIN = b"stitch-compile-cache-v1"  # bump to orphan every old key at once


def default_cache_dir() -> pathlib.Path:
    """$STITCH_CACHE_DIR, else $XDG_CACHE_HOME/stitch, else ~/.cache/stitch."""
    if explicit := os.environ.get("STITCH_CACHE_DIR"):
        return pathlib.Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(xdg) / "stitch"
    return pathlib.Path.home() / ".cache" / "stitch"


def cache_key(*parts: str | bytes) -> str:
    """sha256 hex over length-prefixed parts (length prefixes keep ("ab","c") != ("a","bc"))."""
    h = hashlib.sha256(_KEY_DOMAIN)
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest()


def encode_entry(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_entry(blob: bytes) -> bytes | None:
    """The payload, or None when the blob is truncated, corrupt or of another format version."""
    if len(blob) < _HEADER.size:
        return None
    magic, version, length, digest = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or version != FORMAT_VERSION or length != len(payload):
        return None
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0          # entries found damaged on read (and removed)
    rebuilt_corrupt: int = 0  # of those, rebuilt by get_or_create
    builds: int = 0           # build() calls made by get_or_create
    write_errors: int = 0


class CompileCache:
    """Bytes by key under ``directory`` (default: ``default_cache_dir()``).

    ``lock_timeout`` bounds how long get_or_create waits for another process's build before
    building itself (atomic replace keeps that safe, only wasteful).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 lock_timeout: float = 600.0) -> None:
        self.directory = pathlib.Path(directory) if directory is not None else default_cache_dir()
        self.lock_timeout = lock_timeout
        self.stats = CacheStats()
        self.enabled = True
        try:
            (self.directory / _LOCK_DIR).mkdir(parents=True, exist_ok=True)
            self._probe_writable()
        except OSError as exc:
            log.warning("compile cache disabled: %s is not writable (%s)", self.directory, exc)
            self.enabled = False

    def _probe_writable(self) -> None:
        # mkdir succeeds on an existing read-only directory; only a real write proves access.
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=".probe-")
        os.close(fd)
        os.unlink(name)

    def _path(self, key: str) -> pathlib.Path:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r} (use cache_key())")
        return self.directory / (key + _ENTRY_SUFFIX)

    # ------------------------------------------------------------------------------ read/write

    def _read(self, key: str) -> tuple[bytes | None, bool]:
        """(payload, was_corrupt). A corrupt entry is removed so the next write starts clean."""
        path = self._path(key)
        if not self.enabled:
            return None, False
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None, False
        except OSError as exc:
            log.warning("compile cache: cannot read %s (%s)", path, exc)
            return None, False
        payload = decode_entry(blob)
        if payload is None:
            log.warning("compile cache: corrupt entry %s (%d bytes); rebuilding", path, len(blob))
            self.stats.corrupt += 1
            with contextlib.suppress(OSError):
                path.unlink()
            return None, True
        return payload, False

    def get(self, key: str) -> bytes | None:
        payload, _ = self._read(key)
        if payload is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return payload

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if not self.enabled:
            return
        tmp_name: str | None = None
        try:
            fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_ENTRY_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(encode_entry(bytes(data)))
            # No fsync: a crash can leave a torn file only on power loss, and the checksum
            # catches that; readers never see a partial file thanks to rename atomicity.
            os.replace(tmp_name, path)
            tmp_name = None
        except OSError as exc:
            self.stats.write_errors += 1
            log.warning("compile cache: cannot write %s (%s); continuing uncached", path, exc)
        finally:
            if tmp_name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)

    def get_or_create(self, key: str, build: Callable[[], bytes]) -> bytes:
        """The cached bytes for ``key``, else ``build()`` once (across processes), stored."""
        payload, corrupt = self._read(key)
        if payload is not None:
            self.stats.hits += 1
            return payload
        with self._key_lock(key):
            # Another process may have built it while we waited for the lock.
            payload, corrupt_again = self._read(key)
            corrupt = corrupt or corrupt_again
            if payload is not None:
                self.stats.hits += 1
                return payload
            self.stats.misses += 1
            self.stats.builds += 1
            if corrupt:
                self.stats.rebuilt_corrupt += 1
            data = build()
            self.put(key, data)
            return data

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        if not self.enabled or fcntl is None:
            yield
            return
        lock_path = self.directory / _LOCK_DIR / (key + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("compile cache: cannot open lock %s (%s); building unlocked", lock_path, exc)
            yield
            return
        try:
            locked = self._acquire(fd, lock_path)
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _acquire(self, fd: int, lock_path: pathlib.Path) -> bool:
        # Poll rather than block so a builder that hangs cannot stall everyone forever.
        deadline = time.monotonic() + self.lock_timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("compile cache: waited %.0fs for %s; building without the lock",
                                self.lock_timeout, lock_path)
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as exc:  # e.g. a filesystem without flock support
                log.warning("compile cache: cannot lock %s (%s); building unlocked", lock_path, exc)
                return False

    def clear(self) -> None:
        """Remove every entry (and stale temp/lock files); stats are kept."""
        if not self.enabled:
            return
        for path in list(self.directory.glob("*" + _ENTRY_SUFFIX)) + list(self.directory.glob(".tmp-*")):
            with contextlib.suppress(OSError):
                path.unlink()
        for path in (self.directory / _LOCK_DIR).glob("*.lock"):
            with contextlib.suppress(OSError):
                path.unlink()

    def __contains__(self, key: str) -> bool:
        return self._read(key)[0] is not None
