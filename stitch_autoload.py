"""Imported at interpreter start by ``stitch-autoload.pth`` (installed with stitch).

Does nothing unless STITCH_ENABLE is set to a true value. Then it installs an import hook that
patches jax (``jax.jit`` → ``stitch.jit``) right after jax is imported, and
``tf.function(jit_compile=True)`` and Keras' TensorFlow trainer when tensorflow/keras are
imported, so an unchanged training script runs under
stitch: ``STITCH_ENABLE=1 python train.py``. Nothing from stitch (numpy, llvmlite...) is
imported before the framework is, and nothing at all when the variable is unset.

The hook wraps the loader of the spec it hands to an import, whatever the order in which a
script imports the frameworks: a spec merely looked up (``importlib.util.find_spec("keras")``,
which TensorFlow's own import does) is not an import, so it does not use the framework's turn
up; a framework counts as done once its module has run.
"""
import os

_RAW = os.environ.get("STITCH_ENABLE", "").strip().lower()
_ON = _RAW in ("1", "true", "yes", "on")

if _RAW and not _ON and _RAW not in ("0", "false", "no", "off"):
    # Said, not guessed: a value that is neither on nor off leaves stitch off.
    import logging
    logging.getLogger("stitch.autoload").warning(
        "STITCH_ENABLE=%r is not one of 1/true/yes/on or 0/false/no/off: stitch stays off",
        os.environ["STITCH_ENABLE"])

if _ON:
    import sys
    import threading

    class _PatchAfterImport:
        """A meta-path finder that lets the real finders load a watched module, then runs
        stitch's patch for it (once per module object)."""

        watched = ("jax", "keras", "tensorflow")

        def __init__(self):
            self.done = set()              # names whose module ran and was handed to patch
            self._local = threading.local()

        def find_spec(self, name, path=None, target=None):
            if name not in self.watched or name in self.done or name in sys.modules:
                return None
            resolving = getattr(self._local, "names", None)
            if resolving is None:
                resolving = self._local.names = set()
            if name in resolving:          # our own lookup below: the real finders answer
                return None
            resolving.add(name)
            try:
                import importlib.util
                spec = importlib.util.find_spec(name)
            finally:
                resolving.discard(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            loader = spec.loader
            real_exec = loader.exec_module
            if getattr(real_exec, "__stitch_wrapped__", False):
                return spec
            done = self.done

            def exec_module(module, _real=real_exec, _name=name):
                _real(module)
                if _name in done:
                    return
                done.add(_name)
                try:
                    from stitch.autoload import patch
                    patch(_name, module)
                except Exception as exc:  # never break the user's import
                    sys.stderr.write(f"stitch: autoload could not patch {_name}: {exc}\n")
            exec_module.__stitch_wrapped__ = True
            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
