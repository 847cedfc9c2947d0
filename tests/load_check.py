"""Run in a subprocess with 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

    python tests/load_check.py OUT.json WORK_DIR

Writes tiny checkpoints (GPT-NeoX in bf16, Llama in float32) under WORK_DIR and loads each with
``mesh=data=2,model=4`` (FSDP over data, tensor parallel over model), one row per read block, then compares every
leaf's global value bit for bit with the whole-leaf path (``hub.params_from_hf``) and records which leaves differ
and how many are split across devices. ``tests/test_streaming_load.py`` asserts on OUT.json.
"""
import json
import sys
from pathlib import Path

import jax
import numpy as np

import mia.models as mm
from mia import sharding
from mia.sharding import make_mesh

from test_streaming_load import bits, reference, write_checkpoint
from tiny_configs import shardable


def main(out_path, work):
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh({"data": 2, "model": 4})
    sharding.BLOCK_BYTES = 1
    report = {}
    for family, ckpt_dtype, param_dtype in (("gpt_neox", "bfloat16", "float32"), ("llama", "float32", "bfloat16")):
        path = write_checkpoint(shardable(family), ckpt_dtype, Path(work) / family)
        got = mm.load(path, dtype=param_dtype, tokenizer=False, mesh=mesh).params
        want = reference(path, param_dtype)
        differ, split = [], 0
        for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                  jax.tree_util.tree_flatten_with_path(want)[0]):
            if a.dtype != b.dtype or not np.array_equal(bits(a), bits(b)):
                differ.append(jax.tree_util.keystr(p))
            split += a.addressable_shards[0].data.shape != a.shape
        report[f"{family}/{ckpt_dtype}->{param_dtype}"] = dict(differ=differ, split_leaves=split)
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
