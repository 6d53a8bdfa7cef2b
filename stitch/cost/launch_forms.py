"""Which launch forms a global-scope (grid barrier) kernel may take on the target, and what
each costs: the one rule the planner (``stitch.pricing.delta``'s price of a global-scope
pattern, ``ExplorerOptions.grid_sync``) and the XLA pass (the form it builds,
``stitch.xla_pass.entry``) both ask, so the planner never prices a kernel in a form the pass
will not build.

Settings (``STITCH_GRID_SYNC`` on the GPU pass; the host runs every form):
- ``off``: no global scope; a pattern only the global scope stitches is not a kernel;
- ``relaunch``: a launch per phase inside one custom call (no co-residency needed), priced
  as that chain of launches (``GlobalScope.chain_us``);
- ``barrier``: one persistent (cooperative) launch with grid barriers, priced as modeled;
- ``auto``: per kernel, whichever of the two is modeled faster.
"""
from __future__ import annotations

GRID_SYNC_SETTINGS = ("off", "relaunch", "barrier", "auto")


def allows_global(setting: str) -> bool:
    """Whether global-scope kernels are built at all under ``setting``."""
    _check(setting)
    return setting != "off"


def form_for(setting: str, persistent_s: float, chain_s: float) -> str | None:
    """The launch form (``stitch.codegen.kir.GRID_SYNC_MODES``: "barrier" | "relaunch") a
    global-scope kernel takes under ``setting``, given its modeled seconds as one
    persistent launch and as a chain of launches; None under "off"."""
    _check(setting)
    if setting == "off":
        return None
    if setting == "auto":
        return "relaunch" if chain_s < persistent_s else "barrier"
    return setting


def form_seconds(setting: str, persistent_s: float, chain_s: float) -> float | None:
    """The kernel's modeled seconds in the form ``setting`` gives it (None under "off")."""
    form = form_for(setting, persistent_s, chain_s)
    if form is None:
        return None
    return chain_s if form == "relaunch" else persistent_s


def _check(setting: str) -> None:
    if setting not in GRID_SYNC_SETTINGS:
        raise ValueError(f"grid sync setting {setting!r}: expected one of "
                         f"{', '.join(GRID_SYNC_SETTINGS)}")
