"""CUDA registration of stitch's pass: jax's public call under the names CUDA clients report
("gpu" among them), and directly on a CUDA client jax had started before stitch registered
(jax 0.10.2's initialization hook never fires for it). Exercised with stand-in clients: no
GPU needed."""
from __future__ import annotations

import types

import pytest

from stitch.integration import pass_registration, xla_pass

jax = pytest.importorskip("jax")


@pytest.fixture
def fresh_registration(monkeypatch):
    monkeypatch.setattr(pass_registration, "_REGISTERED", set())
    public: list = []
    import jax.extend.xla as xla_ext
    monkeypatch.setattr(xla_ext, "register_hlo_module_transformation",
                        lambda cb, **kw: public.append(kw))
    direct: list = []
    from jax._src.lib import _xla
    monkeypatch.setattr(_xla, "register_xla_transform_c_api",
                        lambda client, name, stage, cb: direct.append((client, name, stage)),
                        raising=False)
    return public, direct


def test_cuda_registration_names_the_gpu_platform(fresh_registration) -> None:
    public, _ = fresh_registration
    xla_pass.ensure_registered("cuda")
    assert "gpu" in public[0]["platforms"] and "cuda" in public[0]["platforms"]


def test_an_already_started_cuda_client_gets_the_pass(fresh_registration,
                                                      monkeypatch) -> None:
    public, direct = fresh_registration
    from jax._src import xla_bridge
    started = types.SimpleNamespace(platform="gpu")
    other = types.SimpleNamespace(platform="cpu")
    monkeypatch.setattr(xla_bridge, "_backends", {"cuda": started, "cpu": other})
    xla_pass.ensure_registered("cuda")
    assert [c for c, _, _ in direct] == [started]
    xla_pass.ensure_registered("cuda")                   # once per process
    assert len(direct) == 1 and len(public) == 1


def test_cpu_registration_is_unchanged(fresh_registration, monkeypatch) -> None:
    public, direct = fresh_registration
    from jax._src import xla_bridge
    monkeypatch.setattr(xla_bridge, "_backends", {"gpu": types.SimpleNamespace(platform="gpu")})
    xla_pass.ensure_registered("cpu")
    assert public[0]["platforms"] == ["cpu"] and direct == []
