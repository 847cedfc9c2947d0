"""Open a checkpoint directory without reading its weights: ``check_checkpoint(path)`` and ``weights_digest``.

``check_checkpoint`` reads config.json through the family's config checks (``hub.load_config``), the safetensors
header of every weight file (the shard index too: ``hub.weight_files``; a ``pytorch_model.bin`` through
``torch_bin``, whose pickle names shapes without running anything), and checks, with the loader's own strict
name/shape mapping (``hub.host_params_from_hf`` on zero-byte stand-ins of the right shapes), that every tensor the
family needs is present with the right shape and a floating dtype, and that no unknown tensor is there. No weight
byte is read except the digest's sample (below); a bad checkpoint is one ``CheckpointError``/``ConfigError`` line
naming its path, in seconds on a multi-GB directory.

``weights_digest(files)``: SHA-256 over, per weight file in order, its size, its safetensors header whole (the 8-byte
length and the JSON) and a fixed sample of its bytes: the whole file when it is at most ``SAMPLE_WHOLE`` (6 MiB),
else its first and last MiB and ``SAMPLE_BLOCKS`` (64) blocks of 64 KiB at evenly spaced offsets in between (about
6 MiB read per file, whatever its size). The rule: byte-identical files give identical digests; any change of the
size, a header (a tensor name, dtype, shape or offset) or a sampled byte gives another digest. A change confined to
bytes outside the sample is not seen; two training steps of one run differ in essentially every parameter, hence in
every sampled block, so different weights are told apart with near certainty, while an edit of a few bytes may not
be (``hub.fingerprint``, the cache's content address, covers every byte).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from ..validate import safetensors_header
from . import hf_cache
from .hub import (SAFETENSORS_DTYPES, CheckpointError, weight_files, abstract_params, host_params_from_hf, load_config,
                  StackedView)
from .layouts import native_layout
from .torch_bin import read_torch_bin

SAMPLE_EDGE = 1 << 20  # bytes hashed at each end of a weight file
SAMPLE_BLOCK = 1 << 16  # bytes per evenly spaced block
SAMPLE_BLOCKS = 64
SAMPLE_WHOLE = 2 * SAMPLE_EDGE + SAMPLE_BLOCKS * SAMPLE_BLOCK  # a file this small is hashed whole
DIGEST_VERSION = "1"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """What ``check_checkpoint`` found: the directory, its family, weight files, tensor count, parameter count (of the
    tensors the family uses), their dtypes and the weights' sampled ``digest`` (``weights_digest``)."""

    path: str
    model_type: str
    files: tuple
    n_tensors: int
    n_params: int
    dtypes: tuple
    digest: str

    def to_json(self) -> dict:
        return {"path": self.path, "model_type": self.model_type, "files": list(self.files),
                "n_tensors": self.n_tensors, "n_params": self.n_params, "dtypes": list(self.dtypes),
                "digest": self.digest, "digest_covers": DIGEST_COVERS}


DIGEST_COVERS = (f"sha256 of each weight file's size, safetensors header, first/last {SAMPLE_EDGE >> 20} MiB and "
                 f"{SAMPLE_BLOCKS} evenly spaced {SAMPLE_BLOCK >> 10} KiB blocks (whole file when <= "
                 f"{SAMPLE_WHOLE >> 20} MiB)")


def sample_ranges(size: int) -> list:
    """[(begin, end)] byte ranges of a ``size``-byte file that the digest hashes: [(0, size)] when ``size`` is at most
    ``SAMPLE_WHOLE``, else the first and last ``SAMPLE_EDGE`` bytes and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK``
    bytes, the first right after the head, the last right before the tail, the rest evenly spaced between."""
    if size <= SAMPLE_WHOLE:
        return [(0, size)]
    lo, span = SAMPLE_EDGE, size - 2 * SAMPLE_EDGE - SAMPLE_BLOCK
    blocks = [(lo + i * span // (SAMPLE_BLOCKS - 1), lo + i * span // (SAMPLE_BLOCKS - 1) + SAMPLE_BLOCK)
              for i in range(SAMPLE_BLOCKS)]
    return [(0, SAMPLE_EDGE), *blocks, (size - SAMPLE_EDGE, size)]


def weights_digest(files) -> str:
    """32 hex digits: the sampled content digest of weight files (module docstring: what it covers, the rule)."""
    h = hashlib.sha256(f"mia-weights-sample|{DIGEST_VERSION}".encode())
    for f in files:
        f = Path(f)
        size = f.stat().st_size
        h.update(f"|file:{size}|".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors" and size >= 8:
                n = int.from_bytes(fh.read(8), "little")
                fh.seek(0)
                h.update(b"header:" + fh.read(8 + min(n, size - 8)))
            for lo, hi in sample_ranges(size):
                fh.seek(lo)
                h.update(fh.read(hi - lo))
    return h.hexdigest()[:32]


def _shape_only(path: Path) -> dict:
    """name -> zero-byte stand-in array of the tensor's dtype and shape (nothing of the data region is read)."""
    if path.suffix == ".bin":
        return {k: np.broadcast_to(np.zeros((), v.dtype), v.shape)
                for k, v in read_torch_bin(path, error=CheckpointError).items()}
    header, _ = safetensors_header(path, error=CheckpointError)
    return {k: np.broadcast_to(np.zeros((), SAFETENSORS_DTYPES[dtype]), shape)
            for k, (dtype, shape, _) in header.items()}


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, StackedView):
        yield from tree.layers
    else:
        yield tree


def check_checkpoint(path, digest: bool = True) -> CheckpointRecord:
    """Open the checkpoint at ``path`` (a directory or ``ORG/NAME[@REVISION]`` of the HF cache) without reading its
    weights, check it as ``mia.load`` would (config, every tensor's name, shape and dtype) and return its record;
    ``digest=False`` leaves ``digest`` empty (nothing but headers read). One ``CheckpointError``/``ConfigError`` line
    naming the path on any problem."""
    root = hf_cache.model_dir(path, error=CheckpointError)
    fam, cfg, raw = load_config(root)
    layout = native_layout(raw)
    files = weight_files(root)
    tensors: dict = {}
    origin: dict = {}
    for f in files:
        part = _shape_only(f)
        tensors.update(part)
        origin.update(dict.fromkeys(part, f))
    if layout:
        tensors = layout.hf_tensors(tensors, cfg, str(root), CheckpointError)
    _, shapes = abstract_params(fam, cfg)
    params = host_params_from_hf(tensors, fam, cfg, shapes, source=str(root), origin=origin)
    used = list(_leaves(params))
    bad = sorted({np.dtype(a.dtype).name for a in used} - set(FLOAT_NAMES))
    if bad:
        raise CheckpointError(f"{root}: weight tensor dtype(s) {', '.join(bad)} unsupported; the model needs floating "
                              f"point ({', '.join(FLOAT_DTYPES)})")
    return CheckpointRecord(str(root), fam.model_type, tuple(f.name for f in files), len(tensors),
                            int(sum(int(np.prod(a.shape, dtype=np.int64)) for a in used)),
                            tuple(sorted({np.dtype(a.dtype).name for a in used})),
                            weights_digest(files) if digest else "")


def identical_pairs(records: dict) -> list:
    """[(label_a, label_b)] of the records (label -> ``CheckpointRecord``) with the same non-empty digest, in order."""
    first: dict = {}
    pairs = []
    for label, r in records.items():
        if not r.digest:
            continue
        if r.digest in first:
            pairs.append((first[r.digest], label))
        else:
            first[r.digest] = label
    return pairs


__all__ = ["CheckpointRecord", "check_checkpoint", "weights_digest", "sample_ranges", "identical_pairs",
           "DIGEST_COVERS"]
