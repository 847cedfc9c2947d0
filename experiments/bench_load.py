"""Benchmark: host memory and time of loading a checkpoint (``mia.models.load``), streamed vs whole-leaf.

Writes a Pythia-1B-shaped GPT-NeoX checkpoint with random weights (hidden 2048, 16 layers, 8 heads, MLP 8192,
vocab 50,304: 1.01 B parameters; bf16 by default, 2 GB) to a temp dir, one tensor at a time, then loads it in a fresh
subprocess per row and reports: parameter bytes, the child's resident set after its imports (baseline), its peak
resident set during the load (``VmHWM``, reset after the imports through ``/proc/self/clear_refs``), peak - baseline
("load peak"), load peak / parameter bytes, the transient (load peak - parameter bytes: on a CPU the placed
parameters themselves live in host memory, so that is what the load costs beyond its result) and seconds.

Rows (``--modes``):
  stream     ``load()`` of this checkout: each device's shard read and converted block by block from the
             memory map into its final dtype, the map's pages dropped as it goes.
  whole      the whole-leaf path (``hub.params_from_hf``: every leaf stacked whole on the host, widened to float32,
             then converted): what loading cost before streaming, kept as the bit-for-bit reference.
  baseline   ``load()`` of another checkout of mia (``--baseline DIR``, e.g. a worktree of the commit before
             streaming), imported from DIR.

Every row prints a digest of the loaded parameters (SHA-256 over every leaf's bytes), so equal digests mean
bit-identical params. ``--devices 8 --mesh model=8`` loads over 8 fake CPU devices with tensor parallel shardings.

    python -m experiments.bench_load [--ckpt-dtype bfloat16] [--param-dtype float32] [--devices 8 --mesh model=8]
                                     [--modes stream,whole] [--baseline DIR] [--keep DIR]

Memory is measured exactly (the kernel's high-water mark); seconds are disturbed by anything else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192, vocab_size=50304)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_checkpoint(root: Path, dtype: str, shape: dict, seed: int = 0) -> int:
    """config.json + model.safetensors of a random GPT-NeoX, written one tensor at a time (host memory: one
    tensor). Returns the number of parameters."""
    import ml_dtypes
    import transformers as tf

    from mia.models.hub import SAFETENSORS_NAMES, abstract_params, family

    fam = family("gpt_neox")
    hf = tf.GPTNeoXConfig(max_position_embeddings=2048, tie_word_embeddings=False, **shape).to_dict()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf))
    cfg = fam.config_cls.from_hf(hf)
    _, shapes = abstract_params(fam, cfg)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {}
    for m in fam.param_mappings(cfg):
        leaf = shapes
        for k in m.path:
            leaf = leaf[k]
        s = tuple(leaf.shape) if m.layer is None else tuple(leaf.shape)[1:]
        tensors[m.hf_name] = s[::-1] if m.transpose else s
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        n = int(np.prod(tensors[name]))
        size = n * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[np.dtype(np_dtype)], "shape": list(tensors[name]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(seed)
    with open(root / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name in sorted(tensors):
            shape_ = tensors[name]
            rows = max(1, (16 << 20) // max(1, int(np.prod(shape_[1:])) if len(shape_) > 1 else 1))
            for r in range(0, shape_[0], rows):  # 16 M values at a time
                part = (rng.standard_normal((min(rows, shape_[0] - r),) + tuple(shape_[1:]), np.float32) * 0.02)
                f.write(part.astype(np_dtype).tobytes())
    return sum(int(np.prod(s)) for s in tensors.values())


def child(path: str, mode: str, param_dtype: str, mesh: str) -> None:
    """Load once and print one JSON line (run in a fresh process: the peak resident set is this load's)."""
    import hashlib

    import jax

    import mia.models as mm
    from mia.sharding import make_mesh, parse_mesh
    from mia.models import hub

    mesh_obj = make_mesh(parse_mesh(mesh, len(jax.devices()))) if mesh else None
    base = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    if mode == "whole":
        fam, cfg, _ = hub.load_config(path)
        tensors = hub.read_safetensors(Path(path) / "model.safetensors")
        _, shapes = hub.abstract_params(fam, cfg, hub.DTYPES[param_dtype], hub.DTYPES[param_dtype])
        params = hub.params_from_hf(tensors, fam, cfg, shapes, hub.DTYPES[param_dtype])
        if mesh_obj is not None:
            from mia.sharding import param_shardings, put_params
            params = put_params(params, param_shardings(shapes, mesh_obj))
    else:
        params = mm.load(path, dtype=param_dtype, tokenizer=False, mesh=mesh_obj).params
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    n_bytes = sum(x.size * x.dtype.itemsize for _, x in leaves)
    h = hashlib.sha256()
    for p, x in sorted(leaves, key=lambda t: jax.tree_util.keystr(t[0])):
        h.update(np.ascontiguousarray(np.asarray(jax.device_get(x))).tobytes())
    root = str(Path(mm.__file__).resolve().parent.parent.parent)  # the checkout whose mia was imported
    print(json.dumps(dict(mode=mode, mia=root, base_kib=base, peak_kib=peak, hwm_reset=reset, param_bytes=int(n_bytes),
                          seconds=seconds, digest=h.hexdigest()[:16], devices=len(jax.devices()))))


def run_child(path: Path, mode: str, args) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(Path(args.baseline).resolve() if mode == "baseline" else ROOT)
    # run as a script from the checkpoint's folder: neither this checkout's root (which ``-m`` would put first on
    # sys.path) nor its experiments/ holds a ``mia`` that could shadow the baseline's
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), "--mode",
           "stream" if mode == "baseline" else mode, "--param-dtype", args.param_dtype, "--mesh", args.mesh]
    r = subprocess.run(cmd, env=env, cwd=path.parent, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{mode}: the load failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["mode"] = mode
    if Path(out["mia"]) != Path(env["PYTHONPATH"]).resolve():
        raise SystemExit(f"{mode}: imported mia from {out['mia']}, not {env['PYTHONPATH']}")
    return out


def table(rows: list[dict], ckpt_bytes: int) -> str:
    gb = lambda kib: kib * 1024 / 1e9  # noqa: E731
    lines = ["| path | param GB | baseline RSS GB | load peak GB | peak / params | transient GB | s (approx.) "
             "| digest |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = r["param_bytes"] / 1e9
        load_peak = gb(r["peak_kib"] - r["base_kib"])
        lines.append(f"| {r['mode']} | {params:.2f} | {gb(r['base_kib']):.2f} | {load_peak:.2f} | "
                     f"{load_peak / params:.2f} | {load_peak - params:.2f} | {r['seconds']:.1f} | {r['digest']} |")
    lines.append(f"\ncheckpoint file: {ckpt_bytes / 1e9:.2f} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--devices", type=int, default=1, help="fake CPU devices of each load")
    ap.add_argument("--mesh", default="", help="e.g. model=8 (default: every device on data, replicated)")
    ap.add_argument("--modes", default="stream,whole", help="comma-separated: stream, whole, baseline")
    ap.add_argument("--baseline", default=None, help="another mia checkout, for the baseline row")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.mode, args.param_dtype, args.mesh)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("stream", "whole", "baseline")]
    if bad:
        ap.error(f"--modes: unknown mode {bad[0]!r} (stream, whole, baseline)")
    if "baseline" in modes and not args.baseline:
        ap.error("--modes baseline needs --baseline DIR (a checkout of mia to import)")
    shape = dict(SHAPE, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_load_"))
    try:
        ckpt = work / "model"
        if not (ckpt / "model.safetensors").exists():
            t0 = time.perf_counter()
            n = write_checkpoint(ckpt, args.ckpt_dtype, shape)
            print(f"wrote {n / 1e9:.2f} B parameters ({args.ckpt_dtype}) in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        rows = []
        for mode in modes:
            rows.append(run_child(ckpt, mode, args))
            print(json.dumps(rows[-1]), flush=True)
        print(f"\ncheckpoint {args.ckpt_dtype} -> params {args.param_dtype}, {args.devices} device(s)"
              + (f", mesh {args.mesh}" if args.mesh else ""))
        print(table(rows, (ckpt / "model.safetensors").stat().st_size))
        digests = {r["digest"] for r in rows}
        print("params identical across rows" if len(digests) == 1 else "PARAMS DIFFER between rows")
        return 0 if len(digests) == 1 else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
