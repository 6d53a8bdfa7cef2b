"""The GPU build queue (``kernel_builds.GpuPrebuild``): a build thread that frees up takes
the largest waiting build (its Kernel IR text's length, the structure key's), not the
oldest; results still come back per submitted kernel, in submission order, one build per
structure."""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from stitch.xla_pass import kernel_builds
from stitch.xla_pass.pass_request import PassRequest


@dataclass
class _Kernel:
    name: str

    def renamed(self, name: str) -> "_Kernel":
        return _Kernel(name)


def test_a_free_build_thread_takes_the_largest_waiting_build(monkeypatch) -> None:
    rng = random.Random()
    started: list[str] = []
    release = threading.Event()

    def fake_build(self, canonical, structure):
        started.append(structure)
        if len(started) == 1:
            release.wait(10)             # the first build holds the one thread
        return f"ptx of {structure}", None

    monkeypatch.setattr(kernel_builds.GpuPrebuild, "_build", fake_build)
    keys = ["k" * n for n in rng.sample(range(2, 400), 12)]
    names = [f"kernel_{i}" for i in range(len(keys))]
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with kernel_builds.GpuPrebuild(request, [object()]) as prebuild:
        for name, key in zip(names, keys):
            prebuild.submit(_Kernel(name), key)
        prebuild.submit(_Kernel("copy_of_0"), keys[0])    # same structure: no build
        release.set()
        results = list(prebuild.each_result())
    assert started[0] == keys[0]
    assert started[1:] == sorted(keys[1:], key=len, reverse=True)
    assert [r.ptx for r in results] == [f"ptx of {k}" for k in keys + [keys[0]]]


def test_a_failed_build_is_handed_back_for_its_kernels_only(monkeypatch) -> None:
    def fake_build(self, canonical, structure):
        if structure == "bad":
            raise RuntimeError("no PTX")
        return f"ptx of {structure}", None

    monkeypatch.setattr(kernel_builds.GpuPrebuild, "_build", fake_build)
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with kernel_builds.GpuPrebuild(request, [object(), object()]) as prebuild:
        for name, key in (("a", "good"), ("b", "bad"), ("c", "good"), ("d", "bad")):
            prebuild.submit(_Kernel(name), key)
        results = list(prebuild.each_result())
    assert [type(r).__name__ for r in results] == ["GpuBuild", "RuntimeError", "GpuBuild",
                                                   "RuntimeError"]
