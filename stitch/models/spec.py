"""The two records every zoo model is described by, plus a helper to declare arguments.

A model is a pure jax function whose every input (data and parameters alike) is a positional
array, so the lowered HLO carries parameters as HLO parameters rather than constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

CONFIGS: tuple[str, ...] = ("full", "tiny")
# Models that also have a "medium" config: big enough that a CPU step is milliseconds (per-call
# overheads no longer dominate), small enough to train on this CPU.
CONFIGS_WITH_MEDIUM: tuple[str, ...] = ("full", "medium", "tiny")

# Scale of data inputs: N(0, 1) * 0.5 keeps activations O(1) through every model.
DATA_SCALE = 0.5


@dataclass(frozen=True)
class ModelInstance:
    """One model at one configuration, ready to jit, lower or feed random inputs."""

    name: str
    config: str
    fn: Callable
    arg_specs: tuple[jax.ShapeDtypeStruct, ...]
    # Per arg: "float" (normal * scale) or "int:<high>" (uniform ints in [0, high)).
    arg_kinds: tuple[str, ...]
    # Extras beyond the required API; empty tuples mean "not given".
    arg_names: tuple[str, ...] = ()
    arg_scales: tuple[float, ...] = ()
    # Positions of the parameter args; for training steps the outputs after the loss are the
    # updated parameters in exactly this order.
    param_argnums: tuple[int, ...] = ()

    def random_args(self, seed: int = 0) -> list[np.ndarray]:
        """Fresh random inputs: floats ~ N(0,1)*scale (never zero), ints uniform in range."""
        rng = np.random.default_rng(seed)
        out: list[np.ndarray] = []
        for i, (spec, kind) in enumerate(zip(self.arg_specs, self.arg_kinds)):
            shape = tuple(spec.shape)
            if kind.startswith("int:"):
                high = int(kind.split(":", 1)[1])
                out.append(rng.integers(0, high, size=shape).astype(spec.dtype))
            elif kind == "float":
                scale = self.arg_scales[i] if self.arg_scales else DATA_SCALE
                values = rng.standard_normal(size=shape) * scale
                out.append(np.asarray(values, dtype=spec.dtype))
            else:
                raise ValueError(f"{self.name}: unknown arg kind {kind!r}")
        return out


@dataclass(frozen=True)
class ModelSpec:
    """Registry entry: what a model is and how to build it at a given config."""

    name: str
    description: str
    kind: str  # "inference" or "training"
    configs: tuple[str, ...]
    build: Callable[[str], ModelInstance]


C = TypeVar("C")


def pick_config(model: str, table: Mapping[str, C], config: str) -> C:
    """Look a config up, failing with the list of valid names (the documented error)."""
    if config not in table:
        raise ValueError(
            f"model {model!r} has no config {config!r}; valid configs: {', '.join(table)}"
        )
    return table[config]


@dataclass
class ArgTable:
    """Collects positional args in order: names, shapes, kinds and init scales.

    Data args go first and parameters after them, so a training step can split its args at
    `num_data` and return updated parameters in argument order.
    """

    names: list[str] = field(default_factory=list)
    specs: list[jax.ShapeDtypeStruct] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)

    def _add(self, name: str, shape: Sequence[int], dtype, kind: str, scale: float) -> None:
        if name in self.names:
            raise ValueError(f"duplicate arg name {name!r}")
        self.names.append(name)
        self.specs.append(jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype))
        self.kinds.append(kind)
        self.scales.append(float(scale))

    def data(self, name: str, shape: Sequence[int], scale: float = DATA_SCALE) -> None:
        if self.param_names:
            raise ValueError("data args must come before parameters")
        self._add(name, shape, jnp.float32, "float", scale)

    def ints(self, name: str, shape: Sequence[int], high: int) -> None:
        if self.param_names:
            raise ValueError("data args must come before parameters")
        self._add(name, shape, jnp.int32, f"int:{int(high)}", 1.0)

    def param(self, name: str, shape: Sequence[int], scale: float) -> None:
        self._add(name, shape, jnp.float32, "float", scale)
        self.param_names.append(name)

    def weight(self, name: str, shape: Sequence[int], fan_in: int | None = None) -> None:
        """A weight scaled by 1/sqrt(fan_in) (fan_in defaults to shape[0])."""
        fan = int(fan_in if fan_in is not None else shape[0])
        self.param(name, shape, 1.0 / math.sqrt(fan))

    def bias(self, name: str, shape: Sequence[int]) -> None:
        self.param(name, shape, 0.1)

    def norm(self, prefix: str, dim: int) -> None:
        """Layer-norm gamma/beta: random like any other input (std 0.5 / 0.1), never zero."""
        self.param(f"{prefix}_gamma", (dim,), DATA_SCALE)
        self.param(f"{prefix}_beta", (dim,), 0.1)

    @property
    def num_data(self) -> int:
        return len(self.names) - len(self.param_names)

    @property
    def data_names(self) -> list[str]:
        return self.names[: self.num_data]

    def instance(self, name: str, config: str, fn: Callable) -> ModelInstance:
        first_param = self.num_data
        return ModelInstance(
            name=name,
            config=config,
            fn=fn,
            arg_specs=tuple(self.specs),
            arg_kinds=tuple(self.kinds),
            arg_names=tuple(self.names),
            arg_scales=tuple(self.scales),
            param_argnums=tuple(range(first_param, len(self.names))),
        )

    def bind(self, args: Sequence[jax.Array]) -> dict[str, jax.Array]:
        """Name the positional args of a call (inference models)."""
        if len(args) != len(self.names):
            raise TypeError(f"expected {len(self.names)} args, got {len(args)}")
        return dict(zip(self.names, args))
