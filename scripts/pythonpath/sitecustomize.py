"""stitch from a checkout, without installing it: put this folder and the checkout on
PYTHONPATH and ``STITCH_ENABLE=1`` works as with the installed ``stitch-autoload.pth``::

    PYTHONPATH=/path/to/stitch:/path/to/stitch/scripts/pythonpath STITCH_ENABLE=1 python train.py

Python imports ``sitecustomize`` at start-up; this one imports ``stitch_autoload`` (which does
nothing unless STITCH_ENABLE is set). It hides no other ``sitecustomize``: one found later on
sys.path is run too.

``STITCH_BLOCK_MODULES=pulp,highspy,...`` (the GPU kit's rehearsal): importing those fails
with ImportError, as on a machine that lacks them.
"""
import importlib.util
import os
import sys

_blocked = tuple(m.strip() for m in os.environ.get("STITCH_BLOCK_MODULES", "").split(",")
                 if m.strip())
if _blocked:
    class _Blocker:
        """A meta-path finder refusing the listed top-level packages."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _blocked:
                raise ImportError(f"{name} is blocked (STITCH_BLOCK_MODULES): the GPU "
                                  "machine does not have it")
            return None

    sys.meta_path.insert(0, _Blocker())

if importlib.util.find_spec("stitch_autoload") is not None:
    import stitch_autoload  # noqa: F401  (installs the hook only under STITCH_ENABLE)


def _chain_next_sitecustomize() -> None:
    """Run a sitecustomize that sits later on sys.path (ours shadowed it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_stitch_next_sitecustomize",
                                                          candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain_next_sitecustomize()
