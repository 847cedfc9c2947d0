"""Random initialisation of a testbed model in NumPy: the distributions of Flax's defaults, without compiling.

``module.init`` runs the model once to create its parameters; on a busy 2-core CPU that costs 5-10 s per model
(eagerly or jit-compiled), more than training a smoke model. Here the parameter tree comes from
``jax.eval_shape`` (tracing only) and every leaf is drawn by its name, with the distributions Flax would use:

  ``kernel`` [..., fan_in, fan_out]   truncated normal on [-2, 2], scaled to std 1/sqrt(fan_in)  (lecun_normal)
  ``embedding`` [V, D]                normal, std 1/sqrt(D)      (nn.Embed's default variance_scaling)
  ``bias``                            zeros
  ``weight`` (LayerNorm / RMSNorm scale)   ones

Leaves are drawn in tree-flatten order from ``numpy.random.default_rng([seed, 0x1A17])``; an unknown leaf name is
an error (a new layer type must say how it is initialised).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..models.hub import module_abstract_params

# std of a standard normal truncated to [-2, 2] (jax.nn.initializers.truncated_normal's correction)
_TRUNC_STD = 0.87962566103423978


def _truncated_normal(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Standard normal values redrawn until they fall within [-2, 2]."""
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2
    return out


def leaf_init(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Initial value (float64) of the parameter leaf called ``name`` with ``shape``."""
    if name == "kernel":
        return _truncated_normal(rng, shape) / _TRUNC_STD / np.sqrt(shape[-2])
    if name == "embedding":
        return rng.standard_normal(shape) / np.sqrt(shape[-1])
    if name == "bias":
        return np.zeros(shape)
    if name == "weight":
        return np.ones(shape)
    raise ValueError(f"no initialisation rule for a parameter named {name!r} {list(shape)}")


def init_params(module, seed: int):
    """Parameters of a family's Flax ``module`` (``mia.models.hub.module_abstract_params``: the shapes of its
    init, traced once per config), drawn by :func:`leaf_init`."""
    shapes = module_abstract_params(module)
    rng = np.random.default_rng([int(seed), 0x1A17])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for path, leaf in leaves:
        name = str(getattr(path[-1], "key", path[-1]))
        out.append(jnp.asarray(leaf_init(name, tuple(leaf.shape), rng).astype(leaf.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)
