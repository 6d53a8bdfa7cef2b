"""On-disk compile cache: round trip, corruption detection, cross-process build-once, fallback."""
from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import time

import pytest

from stitch.codegen import cache as cache_mod
from stitch.codegen.cache import CompileCache, cache_key, decode_entry, default_cache_dir, encode_entry


def test_cache_key_is_length_prefixed_and_stable():
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert cache_key("ptx", b"sm_80") == cache_key(b"ptx", "sm_80")
    assert cache_key("x") != cache_key("x", "")
    key = cache_key("define void @k()", "sm_80", "13.0.88")
    assert len(key) == 64 and int(key, 16) >= 0


def test_default_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("STITCH_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("STITCH_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "stitch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "stitch"


def test_round_trip_and_stats(tmp_path):
    cache = CompileCache(tmp_path)
    key = cache_key("kernel", "sm_80")
    assert cache.get(key) is None
    cache.put(key, b"\x7fELF cubin bytes")
    assert cache.get(key) == b"\x7fELF cubin bytes"
    assert key in cache
    calls = []
    assert cache.get_or_create(key, lambda: calls.append(1) or b"other") == b"\x7fELF cubin bytes"
    assert calls == []
    other = cache_key("kernel", "sm_90")
    assert cache.get_or_create(other, lambda: b"built") == b"built"
    assert CompileCache(tmp_path).get(other) == b"built"  # persisted for a new instance
    assert (cache.stats.hits, cache.stats.misses, cache.stats.builds) == (2, 2, 1)
    assert not list(tmp_path.glob(".tmp-*"))  # no temp files left behind
    cache.clear()
    assert cache.get(key) is None and cache.get(other) is None


def test_empty_payload_and_bad_keys(tmp_path):
    cache = CompileCache(tmp_path)
    cache.put("empty", b"")
    assert cache.get("empty") == b""
    with pytest.raises(ValueError):
        cache.get("../escape")


def test_header_detects_damage():
    secret, key = os.urandom(32), cache_key("k")
    blob = encode_entry(secret, key, b"payload")
    assert decode_entry(secret, key, blob) == b"payload"
    assert decode_entry(secret, key, blob[:-1]) is None          # truncated payload
    assert decode_entry(secret, key, blob[:10]) is None          # truncated header
    flipped = bytearray(blob)
    flipped[-3] ^= 0x01
    assert decode_entry(secret, key, bytes(flipped)) is None     # bit flip
    assert decode_entry(secret, key, b"XXXX" + blob[4:]) is None  # foreign file
    assert decode_entry(os.urandom(32), key, blob) is None       # another user's secret
    assert decode_entry(secret, cache_key("other"), blob) is None  # moved to another key


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_rebuilt(tmp_path, caplog, damage):
    cache = CompileCache(tmp_path)
    key = cache_key("k", damage)
    cache.put(key, b"A" * 100)
    path = tmp_path / f"{key}.bin"
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[:-10]
    elif damage == "flip":
        blob[-1] ^= 0xFF
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))

    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        data = cache.get_or_create(key, lambda: b"B" * 100)
    assert data == b"B" * 100
    assert cache.stats.rebuilt_corrupt == 1 and cache.stats.corrupt == 1
    assert any("damaged or failed authentication" in r.message for r in caplog.records)
    assert CompileCache(tmp_path).get(key) == b"B" * 100  # healed on disk


def _racer(directory: str, key: str, marker_dir: str, start_at: float, out: multiprocessing.Queue) -> None:
    cache = CompileCache(directory)

    def build() -> bytes:
        # Record each build; slow enough that the other process arrives while this one builds.
        pathlib.Path(marker_dir, f"build-{os.getpid()}").touch()
        time.sleep(0.5)
        return b"cubin:" + os.urandom(16)  # different per builder, so a double build shows

    time.sleep(max(0.0, start_at - time.time()))
    out.put(cache.get_or_create(key, build))


def test_two_processes_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    markers = tmp_path / "markers"
    markers.mkdir()
    key = cache_key("raced kernel")
    out = ctx.Queue()
    start_at = time.time() + 1.0  # both past interpreter start-up before racing
    procs = [ctx.Process(target=_racer, args=(str(tmp_path / "c"), key, str(markers), start_at, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(list(markers.iterdir())) == 1, "build ran more than once"
    assert results[0] == results[1] and results[0].startswith(b"cubin:")


def test_unwritable_directory_falls_back(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        cache = CompileCache(blocker / "cache")
    assert not cache.enabled
    assert any("compile cache disabled" in r.message and str(blocker) in r.message
               for r in caplog.records)
    calls = []
    key = cache_key("k")
    assert cache.get_or_create(key, lambda: calls.append(1) or b"x") == b"x"
    assert cache.get_or_create(key, lambda: calls.append(1) or b"x") == b"x"
    assert calls == [1, 1]  # no caching, but no crash
    cache.put(key, b"y")
    assert cache.get(key) is None
    cache.clear()


def test_write_failure_is_logged_not_raised(tmp_path, caplog, monkeypatch):
    cache = CompileCache(tmp_path)

    def failing_replace(src, dst, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", failing_replace)
    with caplog.at_level(logging.WARNING, logger="stitch.codegen.cache"):
        assert cache.get_or_create(cache_key("k"), lambda: b"data") == b"data"
    assert cache.stats.write_errors == 1
    assert not list(tmp_path.glob(".tmp-*"))
    assert any("cannot write" in r.message for r in caplog.records)
