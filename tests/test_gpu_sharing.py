"""Two runtimes, one GPU (stitch/frontends/tf/gpu_sharing.py, stitch/frontends/tf/cuda_libraries.py): with
TF's and jax's GPU initialization mocked, stitch turns TF's memory growth on and jax's
preallocation off before either starts, leaves a user's own settings alone, says so at
STITCH_LOG=info, and refuses where the two cannot share (a runtime already started, CUDA
libraries that cannot both load). Needs neither TF nor a GPU."""
from __future__ import annotations

import importlib.metadata
import logging
from types import SimpleNamespace

import pytest

from stitch.frontends.tf import cuda_libraries, gpu_sharing


class FakeTF:
    """tf.config and tf.sysconfig as a CUDA 12 TF build on a machine with ``gpus`` GPUs;
    ``started``: TF created its devices already (set_memory_growth raises, as TF does)."""

    def __init__(self, gpus=1, started=False, cuda="12.5.1", growth=False, logical=None):
        self.devices = [SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in range(gpus)]
        self.growth = {d.name: growth for d in self.devices}
        self.started = started
        fake = self

        class Experimental:
            @staticmethod
            def get_memory_growth(device):
                return fake.growth[device.name]

            @staticmethod
            def set_memory_growth(device, on):
                if fake.started:
                    raise RuntimeError("Physical devices cannot be modified after being "
                                       "initialized")
                fake.growth[device.name] = on

        self.config = SimpleNamespace(
            list_physical_devices=lambda kind: list(self.devices) if kind == "GPU" else [],
            get_logical_device_configuration=lambda device: logical,
            experimental=Experimental)
        info = {"is_cuda_build": cuda is not None, "cuda_version": cuda, "cudnn_version": "9"}
        self.sysconfig = SimpleNamespace(get_build_info=lambda: dict(info))


def _versions(installed: dict[str, str]):
    def version(dist):
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]
    return version


CUDA12_OK = _versions({"jax-cuda12-plugin": "0.10.2", "nvidia-cudnn-cu12": "9.10.2.21"})


def _share(tf, environ, jax_started=False, installed=CUDA12_OK):
    return gpu_sharing.share_gpu_with_tensorflow(
        tf, environ, jax_started=lambda: jax_started,
        cuda_check=lambda t: cuda_libraries.check_combination(t, installed))


@pytest.fixture(autouse=True)
def _fresh_decision(monkeypatch):
    monkeypatch.setattr(gpu_sharing, "_DECISION", None)


def test_both_runtimes_are_set_to_share_before_either_starts(caplog):
    tf, env = FakeTF(gpus=2), {}
    with caplog.at_level(logging.INFO, logger="stitch"):
        decision = _share(tf, env)
    assert decision.refusal is None and gpu_sharing.refusal() is None
    assert all(tf.growth.values())
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    text = caplog.text
    assert "memory growth on for TensorFlow's /physical_device:GPU:1" in text
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in text
    gpu_sharing.check_gpu_allowed()                     # does not raise


@pytest.mark.parametrize("user", [{"XLA_PYTHON_CLIENT_MEM_FRACTION": ".3"},
                                  {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
                                  {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}])
def test_a_users_jax_memory_setting_is_left_alone(user, caplog):
    env = dict(user)
    with caplog.at_level(logging.INFO, logger="stitch"):
        decision = _share(FakeTF(), env)
    assert env == user and decision.refusal is None
    assert "left as the user set it" in caplog.text and next(iter(user)) in caplog.text


def test_a_users_tf_growth_setting_is_left_alone():
    tf = FakeTF()
    decision = _share(tf, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert not any(tf.growth.values())
    assert "TF_FORCE_GPU_ALLOW_GROWTH=false" in decision.left_alone[0]
    tf = FakeTF(logical=["a 4 GiB logical device"])
    decision = _share(tf, {})
    assert not any(tf.growth.values()) and "logical device" in decision.left_alone[0]


def test_no_gpu_no_settings():
    env = {}
    decision = _share(FakeTF(gpus=0), env)
    assert env == {} and decision.made == [] and decision.refusal is None


def test_tf_devices_created_already_is_refused_with_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger="stitch"):
        decision = _share(FakeTF(started=True), {})
    assert "created before stitch could turn memory growth on" in decision.refusal
    assert "TF_FORCE_GPU_ALLOW_GROWTH=true" in decision.refusal
    assert "will not run TensorFlow steps on the GPU" in caplog.text
    with pytest.raises(gpu_sharing.GpuSharingError, match="memory growth"):
        gpu_sharing.check_gpu_allowed()


def test_jax_started_already_is_refused():
    env = {}
    decision = _share(FakeTF(), env, jax_started=True)
    assert "jax's GPU client started before TensorFlow" in decision.refusal
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env


def test_jax_started_is_asked_without_starting_it():
    assert gpu_sharing.jax_gpu_started({}) is False
    assert gpu_sharing.jax_gpu_started({"jax": object()}) is False
    bridge = SimpleNamespace(backends_are_initialized=lambda: True)
    assert gpu_sharing.jax_gpu_started({"jax": 1, "jax._src.xla_bridge": bridge}) is True
    bridge = SimpleNamespace(backends_are_initialized=lambda: False)
    assert gpu_sharing.jax_gpu_started({"jax": 1, "jax._src.xla_bridge": bridge}) is False


@pytest.mark.parametrize("installed, ok, why", [
    ({"jax-cuda12-plugin": "0.10.2", "nvidia-cudnn-cu12": "9.10.2.21"}, True, "share one"),
    ({"jax-cuda13-plugin": "0.10.2", "nvidia-cudnn-cu13": "9.13.0"}, False,
     "both load libcudnn.so.9"),
    ({"jax-cuda12-plugin": "0.10.2", "nvidia-cudnn-cu12": "9.3.0.75"}, False,
     "older than jax's plugin needs"),
    ({"jax-cuda12-plugin": "0.10.2", "jax-cuda13-plugin": "0.10.2"}, False, "both"),
    ({}, False, "no jax CUDA plugin"),
])
def test_cuda_library_combinations(installed, ok, why):
    combo = cuda_libraries.check_combination(FakeTF(), _versions(installed))
    assert combo.compatible is ok and why in combo.reason, combo.reason


def test_a_tf_build_without_cuda_is_refused_where_tf_has_a_gpu():
    combo = cuda_libraries.check_combination(FakeTF(cuda=None), CUDA12_OK)
    assert not combo.compatible and "not a CUDA build" in combo.reason
    decision = _share(FakeTF(cuda=None), {})
    assert decision.refusal == combo.reason


def test_an_incompatible_combination_keeps_the_stitched_side_off_the_gpu():
    installed = _versions({"jax-cuda13-plugin": "0.10.2"})
    decision = _share(FakeTF(), {}, installed=installed)
    assert "CUDA 13" in decision.refusal or "cuda13" in decision.refusal
    with pytest.raises(gpu_sharing.GpuSharingError, match="libcudnn.so.9"):
        gpu_sharing.check_gpu_allowed()
