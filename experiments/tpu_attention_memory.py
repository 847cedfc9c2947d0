"""Compile-only memory of one attention call per kernel on one TPU v5e chip (libtpu, no TPU attached).

    unshare -n python -m experiments.tpu_attention_memory [--batch 8 --heads 12 --head-dim 64 --lengths 2048,4096]

Run it where the ``libtpu`` wheel is installed (a separate venv, see docs/engine.md#plan); ``unshare -n`` keeps libtpu
from looking for a cloud metadata server. Each kernel of ``mia.models.attention`` is lowered on bf16
``jax.ShapeDtypeStruct``s placed on the abstract chip of the ``v5e:1x1`` topology and compiled by libtpu; printed:
``compiled.memory_analysis()``'s temporaries, arguments and output per kernel. ``splash`` is the kernel as dispatched
(with its run-time layout check and the blocked fallback under ``lax.cond``); ``splash_only`` is the Pallas call
alone (q scaled, the [B, H, T, E] transposes, segment ids), without the fallback branch.
"""
from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--topology", default="v5e:1x1")
    args = ap.parse_args(argv)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from mia.engine.plan import topology_devices
    from mia.models import attention as A

    sh = SingleDeviceSharding(topology_devices(args.topology)[0])
    b, h, e, scale = args.batch, args.heads, args.head_dim, args.head_dim ** -0.5

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def splash_only(q, k, v, q_pos, k_pos, k_valid):
        return A.splash_per_device(q, k, v, k_valid.astype(jnp.int32), scale=scale, window=None, interpret=False)

    kernels = {"exact": partial_kernel(A.exact_attention, scale), "blocked": partial_kernel(A.blocked_attention, scale),
               "splash": partial_kernel(A.splash_attention, scale, interpret=False), "splash_only": splash_only}
    print(f"{'T':>6} {'kernel':<12} {'temp MiB':>10} {'args MiB':>9} {'out MiB':>8}   (B={b}, {h} heads of {e}, bf16, "
          f"{args.topology})")
    with A.planning_for("tpu", "tpu"):
        for t in (int(x) for x in args.lengths.split(",")):
            qkv = [sds((b, t, h, e), jnp.bfloat16) for _ in range(3)]
            rows = (sds((b, t), jnp.int32), sds((b, t), jnp.int32), sds((b, t), jnp.bool_))
            for name, fn in kernels.items():
                try:
                    m = jax.jit(fn).lower(*qkv, *rows).compile().memory_analysis()
                except Exception as err:  # report and go on: one kernel failing to compile is a result
                    print(f"{t:>6} {name:<12} failed: {str(err).strip().splitlines()[0][:200]}")
                    continue
                mib = [x / 2 ** 20 for x in (m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes)]
                print(f"{t:>6} {name:<12} {mib[0]:>10.1f} {mib[1]:>9.1f} {mib[2]:>8.1f}", flush=True)


def partial_kernel(kernel, scale, **kw):
    return lambda *a: kernel(*a, scale=scale, **kw)


if __name__ == "__main__":
    main()
