"""Compile cache under a hostile or damaged directory: it may make stitch faster, never make it
read what another user planted, follow a link, block on a FIFO or eat memory."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import struct
import threading
import time

import pytest

from stitch.codegen import cache as cache_mod
from stitch.codegen.cache import SECRET_NAME, CompileCache, cache_key, decode_entry, encode_entry
from hlo_fixtures import DATA

pytestmark = pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW"), reason="POSIX only")


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def secret_of(directory) -> bytes:
    return (directory / SECRET_NAME).read_bytes()


def refused(caplog, directory, reason: str) -> bool:
    return any("compile cache disabled" in r.getMessage() and str(directory) in r.getMessage()
               and reason in r.getMessage() for r in caplog.records)


def builds_without_cache(cache: CompileCache) -> None:
    calls = []
    key = cache_key("k", os.urandom(8))
    for _ in range(2):
        assert cache.get_or_create(key, lambda: calls.append(1) or b"fresh") == b"fresh"
    assert calls == [1, 1]


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------------------- the directory

def test_created_0700_and_entries_0600_whatever_the_umask(tmp_path):
    directory = tmp_path / "parent" / "cache"
    with umask(0o002):
        cache = CompileCache(directory)
        key = cache_key("k")
        cache.put(key, b"payload")
    assert cache.enabled and cache.writable
    assert mode_of(directory) == 0o700
    assert mode_of(directory / f"{key}.bin") == 0o600
    assert mode_of(directory / SECRET_NAME) == 0o600
    assert len(secret_of(directory)) == 32
    assert CompileCache(directory).get(key) == b"payload"


def test_group_or_world_writable_directory_refused(tmp_path, caplog):
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o777)  # what another user would pre-create
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        cache = CompileCache(directory)
    assert not cache.enabled
    assert refused(caplog, directory, "writable by group or others")
    builds_without_cache(cache)
    assert not (directory / SECRET_NAME).exists()


def test_directory_of_another_user_refused(tmp_path, caplog, monkeypatch):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(directory, 65534, 65534)
    else:  # cannot give a directory away: be someone else instead
        me = os.geteuid()
        monkeypatch.setattr(cache_mod.os, "geteuid", lambda: me + 1)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        cache = CompileCache(directory)
    assert not cache.enabled
    assert refused(caplog, directory, "owned by uid")
    builds_without_cache(cache)


def test_symlinked_directory_refused_and_untouched(tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        cache = CompileCache(link)
    assert not cache.enabled
    assert refused(caplog, link, "symbolic link")
    builds_without_cache(cache)
    assert list(target.iterdir()) == []


def test_directory_holding_a_symlink_refused(tmp_path, caplog):
    cache = CompileCache(tmp_path / "c")
    key = cache_key("k")
    cache.put(key, b"ours")
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    (tmp_path / "c" / f"{cache_key('other')}.bin").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        again = CompileCache(tmp_path / "c")
    assert not again.enabled
    assert refused(caplog, tmp_path / "c", "symbolic link")
    assert again.get(key) is None


# ---------------------------------------------------------------------------- one entry

def test_entry_links_and_fifos_never_read(tmp_path, caplog):
    """Planted after the cache was opened: a link to /dev/zero, a link to a real entry, a FIFO.
    Each is ignored (never followed, never opened blocking) and rebuilt."""
    cache = CompileCache(tmp_path)
    real = cache_key("real")
    cache.put(real, b"real payload")
    keys = [cache_key(name) for name in ("zero", "alias", "fifo")]
    (tmp_path / f"{keys[0]}.bin").symlink_to("/dev/zero")
    (tmp_path / f"{keys[1]}.bin").symlink_to(tmp_path / f"{real}.bin")
    os.mkfifo(tmp_path / f"{keys[2]}.bin")
    results: dict[str, bytes] = {}

    def read_all() -> None:
        for key in keys:
            results[key] = cache.get_or_create(key, lambda key=key: b"built " + key.encode())

    worker = threading.Thread(target=read_all, daemon=True)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        worker.start()
        worker.join(20)
    assert not worker.is_alive(), "reading a planted entry blocked"
    assert results == {key: b"built " + key.encode() for key in keys}
    assert cache.stats.unsafe == 3 and cache.stats.builds == 3
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "symbolic link" in messages and "not a regular file" in messages
    for key in keys:  # replaced by real entries
        path = tmp_path / f"{key}.bin"
        assert stat.S_ISREG(os.lstat(path).st_mode)
        assert CompileCache(tmp_path).get(key) == b"built " + key.encode()


def test_oversized_entry_not_read(tmp_path, caplog):
    cache = CompileCache(tmp_path, max_entry_bytes=1024)
    key = cache_key("big")
    (tmp_path / f"{key}.bin").write_bytes(os.urandom(64 << 10))
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        assert cache.get_or_create(key, lambda: b"small") == b"small"
    assert cache.stats.unsafe == 1
    assert any("cap" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- authentication

def _plain_checksum_entry(payload: bytes, version: int) -> bytes:
    """The issue's attack: a header anyone can compute (magic, version, length, sha256)."""
    return struct.pack("<4sHQ32s", b"STCC", version, len(payload),
                       hashlib.sha256(payload).digest()) + payload


@pytest.mark.parametrize("forgery", ["sha256-v1", "sha256-v2", "other-secret", "other-key"])
def test_planted_entry_without_our_mac_ignored_and_replaced(tmp_path, caplog, forgery):
    cache = CompileCache(tmp_path)
    key = cache_key("kernel", forgery)
    evil = b"\x7fELF code someone else wrote"
    blob = {"sha256-v1": lambda: _plain_checksum_entry(evil, 1),
            "sha256-v2": lambda: _plain_checksum_entry(evil, 2),
            "other-secret": lambda: encode_entry(os.urandom(32), key, evil),
            "other-key": lambda: encode_entry(secret_of(tmp_path), cache_key("x"), evil)}[forgery]()
    (tmp_path / f"{key}.bin").write_bytes(blob)
    with caplog.at_level(logging.INFO, logger="stitch.codegen.cache"):
        assert cache.get(key) is None
        assert cache.get_or_create(key, lambda: b"ours") == b"ours"
    expected = "another format version" if forgery == "sha256-v1" else "failed authentication"
    assert any(expected in r.getMessage() for r in caplog.records)
    stored = (tmp_path / f"{key}.bin").read_bytes()
    assert decode_entry(secret_of(tmp_path), key, stored) == b"ours"


def test_secret_is_stable_and_checked(tmp_path, caplog):
    CompileCache(tmp_path / "c").put(cache_key("k"), b"v")
    secret = secret_of(tmp_path / "c")
    assert CompileCache(tmp_path / "c").get(cache_key("k")) == b"v"
    assert secret_of(tmp_path / "c") == secret  # created once
    os.chmod(tmp_path / "c" / SECRET_NAME, 0o644)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        readable = CompileCache(tmp_path / "c")
    assert not readable.enabled and refused(caplog, tmp_path / "c", "others can read")
    os.chmod(tmp_path / "c" / SECRET_NAME, 0o600)
    (tmp_path / "c" / SECRET_NAME).write_bytes(secret[:16])
    assert not CompileCache(tmp_path / "c").enabled


def test_secret_race_gives_one_secret(tmp_path):
    caches = []

    def open_cache() -> None:
        caches.append(CompileCache(tmp_path / "c"))

    threads = [threading.Thread(target=open_cache) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(caches) == 6 and all(c.enabled for c in caches)
    caches[0].put(cache_key("k"), b"v")
    assert all(c.get(cache_key("k")) == b"v" for c in caches)


# ---------------------------------------------------------------------------- housekeeping

def test_stale_temporaries_swept_on_open(tmp_path):
    CompileCache(tmp_path)
    old = tmp_path / ".tmp-killedwriter.bin"
    old.write_bytes(os.urandom(4096))
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    fresh = tmp_path / ".tmp-stillwriting.bin"
    fresh.write_bytes(b"x")
    cache = CompileCache(tmp_path)
    assert not old.exists() and fresh.exists()
    assert cache.stats.swept_temps == 1


def test_read_only_filled_cache_is_read(tmp_path, monkeypatch):
    key = cache_key("k")
    CompileCache(tmp_path).put(key, b"filled earlier")
    before = sorted(p.name for p in tmp_path.iterdir())
    if os.geteuid() == 0:  # root writes anywhere: make the write probe fail like EROFS does
        def read_only(_dir_fd: int) -> None:
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(cache_mod, "_probe_writable", read_only)
    else:
        os.chmod(tmp_path, 0o500)
    try:
        cache = CompileCache(tmp_path)
        assert cache.enabled and not cache.writable
        assert cache.get(key) == b"filled earlier"
        other = cache_key("other")
        calls = []
        assert cache.get_or_create(other, lambda: calls.append(1) or b"new") == b"new"
        assert calls == [1] and cache.stats.write_errors == 0
    finally:
        os.chmod(tmp_path, 0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_compile_goes_on_with_a_refused_default_cache(tmp_path, monkeypatch, caplog):
    """stitch.compile with the default cache at a directory another user could write: a
    warning, no caching, right numbers, nothing written there."""
    import pathlib

    import numpy as np

    import stitch.hlo
    from stitch import compiler

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("STITCH_CACHE_DIR", str(shared))
    text = (DATA / "softmax" / "tiny.pre.hlo").read_text()
    module = stitch.hlo.parse_hlo(text)
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(p.shape.dims).astype(np.float32)
            for p in module.entry.parameters]
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        exe = compiler.compile(text, "h100", poison_outputs=True)
    assert refused(caplog, shared, "writable by group or others")
    assert exe.kernels and exe.stats.host_cache_hits == 0
    for got, want in zip(exe(*args), stitch.hlo.evaluate(module, args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert list(shared.iterdir()) == []


def test_the_cache_still_works_in_exit_hooks_that_run_after_weakrefs(tmp_path):
    """A compile joined at exit (stitch.jit's compile thread) may still read and write the
    cache after weakref's own exit hook has run: the cache's descriptors must not be closed
    by it (nor their numbers reused for other files)."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import atexit, sys
        def late():       # registered first: runs after every hook registered later
            sys.stderr.write(f"late get: {cache.get('k1')!r}\\n")
            cache.put('k2', b'written at exit')
            sys.stderr.write(f"late put: {cache.get('k2')!r}\\n")
        atexit.register(late)
        from stitch.codegen.cache import CompileCache
        cache = CompileCache(sys.argv[1])   # its weakref.finalize: weakref's exit hook
        cache.put('k1', b'written before exit')
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "late get: b'written before exit'" in run.stderr, run.stderr[-2000:]
    assert "late put: b'written at exit'" in run.stderr, run.stderr[-2000:]
