"""Imported at interpreter start by ``stitch-autoload.pth`` (installed with stitch).

Does nothing unless STITCH_ENABLE is set to a true value. Then it installs an import hook that
patches jax (``jax.jit`` → ``stitch.jit``) right after jax is imported, and
``tf.function(jit_compile=True)`` and Keras' TensorFlow trainer when tensorflow/keras are
imported, so an unchanged training script runs under
stitch: ``STITCH_ENABLE=1 python train.py``. Nothing from stitch (numpy, llvmlite...) is
imported before the framework is, and nothing at all when the variable is unset.
"""
import os

_ON = os.environ.get("STITCH_ENABLE", "").strip().lower() in ("1", "true", "yes", "on")

if _ON:
    import sys

    class _PatchAfterImport:
        """A meta-path finder that lets the real finders load a watched module, then runs
        stitch's patch for it (once)."""

        watched = ("jax", "keras", "tensorflow")

        def __init__(self):
            self.done = set()

        def find_spec(self, name, path=None, target=None):
            if name not in self.watched or name in self.done:
                return None
            self.done.add(name)
            import importlib.util
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module, _real=real_exec, _name=name):
                _real(module)
                try:
                    from integration.autoload import patch
                    patch(_name, module)
                except Exception as exc:  # never break the user's import
                    sys.stderr.write(f"stitch: autoload could not patch {_name}: {exc}\n")
            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
