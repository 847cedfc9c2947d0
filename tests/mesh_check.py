"""Run in a subprocess with 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

    python tests/mesh_check.py OUT.json NEOX_DIR FAMILY [FAMILY ...]

For each family, the same tiny model twice: on one device (the float32 reference) and on the mesh data=2,model=4
(FSDP over data, tensor parallel over model). Scores token stats, a conditional-LL matrix and MoPe with both, the
mesh side under ``jax.transfer_guard("disallow")`` (no implicit transfer: parameters were placed once, batches are
put explicitly), and writes the largest absolute differences, the compiled token-stats programs and the number of
length buckets, and how the parameters are laid out, to OUT.json. ``tests/test_sharding.py`` asserts on them.
"""
import json
import sys

import jax
import numpy as np

import mia.models as mm
from mia.attacks import AttackContext, get
from mia.data.examples import Example
from mia.engine.batching import ScoringSettings, bucket_length
from mia.engine.conditional import loglik_matrix
from mia.engine.loop import compute_token_stats, jitted_token_stats
from mia.engine.stats import program_stats
from mia.sharding import make_mesh

from tiny_configs import shardable

V = 128
LENGTHS = [5, 40, 17, 3, 64, 33, 8, 21, 9, 11, 100, 2]
SETTINGS = ScoringSettings(progress=False, token_budget=256, min_bucket=64)


def models(name, neox_dir, one, mesh):
    """(reference on one device, the same weights on ``mesh``)."""
    if name == "gpt_neox":  # a real checkpoint: load() reads each device's shard from the memory map
        return mm.load(neox_dir, mesh=one), mm.load(neox_dir, mesh=mesh)
    hf = shardable(name)
    fam = mm.hub.family(hf["model_type"])
    # the families' own init: larger weights make float32 itself ill-conditioned here (llama with weights x3 has
    # |log p| ~ 50 and differs by 5e-4 between batch sizes on ONE device), which would test nothing about layouts
    base = mm.from_config(fam.config_cls.from_hf(hf), key=jax.random.PRNGKey(1))
    return mm.place(base, one), mm.place(base, mesh)


def scores(model, seqs, mope_chunk):
    stats = compute_token_stats(model, seqs, SETTINGS)
    ll = loglik_matrix(model, seqs[:2], seqs[2:8], include_first=True, settings=SETTINGS)
    ctx = AttackContext(model, [Example(str(i), tokens=s, label=i % 2) for i, s in enumerate(seqs)], SETTINGS, {},
                        {"seed": 3})
    mope = get("mope").fn(ctx, n=3, sigma=0.02, chunk=mope_chunk)
    return stats, ll, mope


def layout(model):
    """Per leaf: global shape, the shape one device holds, and the spec."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        name = "/".join(str(k.key) for k in path)
        out[name] = dict(shape=list(x.shape), shard=list(x.addressable_shards[0].data.shape), spec=str(x.sharding.spec))
    return out


def main(out_path, neox_dir, families):
    assert len(jax.devices()) == 8, jax.devices()
    one = make_mesh(devices=jax.devices()[:1])
    mesh = make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, V, n).astype(np.int32) for n in LENGTHS]
    report = {}
    for name in families:
        m1, m8 = models(name, neox_dir, one, mesh)
        with jax.transfer_guard("disallow"):
            s8, ll8, mope8 = scores(m8, seqs, mope_chunk=2)
        s1, ll1, mope1 = scores(m1, seqs, mope_chunk=3)
        report[name] = dict(
            stats={k: max(float(np.abs(a[k] - b[k]).max()) for a, b in zip(s1, s8)) for k in s1[0]},
            condll=float(np.abs(ll1 - ll8).max()), mope=float(np.abs(mope1 - mope8).max()),
            scale=dict(logprob=float(np.mean([np.abs(a["logprob"]).mean() for a in s1])),
                       condll=float(np.abs(ll1).mean()), mope=float(np.abs(mope1).mean())),
            # the step compute_token_stats runs (its arguments as it passes them: lru_cache keys by call)
            compiled_stats_programs=int(jitted_token_stats(m8, None, program_stats(None))._cache_size()),
            length_buckets=len({bucket_length(n, SETTINGS.min_bucket) for n in LENGTHS}),
            layout=layout(m8))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
