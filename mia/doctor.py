"""``mia doctor``: does mia work on this machine, and how fast? The first command to run on a new machine.

``doctor()`` runs the checks below and returns a ``DoctorReport`` (the rows as data; ``table()`` is what the command
prints, ``to_json()`` what ``--json`` writes). A check that raises becomes a failing row naming the error: the
doctor itself never ends in a traceback. Nothing is downloaded; the cache check creates the cache directories when
missing and writes a probe file in each (deleted at once), ``--json`` writes its file, and JAX fills its own
compilation cache only when ``JAX_COMPILATION_CACHE_DIR`` (or the process's jax config) sets one (docs/doctor.md
says exactly what is written). On the 2-core development CPU it takes under a minute.

  platform    backend, device kind and count, jax / jaxlib / flax / mia versions, the precision (``auto`` dtype)
              and the attention kernel auto picks here (information rows)
  attention   for every registered model family (its tiny config, ``mia.models.family.tiny_config``, random
              weights) and every attention kernel that can run here (what auto picks, plus blocked and exact):
              token stats of CHECK_ROWS in the auto dtype against float32 with jax's own attention
              (``jax.nn.dot_product_attention``'s XLA version, the xla kernel in float32: code independent of mia's
              exact and blocked kernels, so that on a float32 backend the exact row too compares two computations);
              the largest difference of any statistic at a scored position, against ``TOLERANCE`` of the dtype
  mesh        (several devices) the same rows in float32 on all local devices: every device on ``data``
              (parameters replicated, as ``mia score`` places them by default), then ``data`` x ``model`` with the
              largest model axis the heads divide (FSDP, as ``--mesh`` places them), against one device
  cache       the mia cache and the compilation cache directories are writable (a probe file is written and
              removed), and their size is within the cache's limit (``mia.files.cache_limit``)
  speed       token stats of a Pythia-160m-shaped random model in the auto dtype on every local device: tokens/s,
              and the model FLOP utilisation against the device's peak (``mia.flops``; unknown devices: tokens/s
              only). On a CPU the model keeps 2 of its 12 layers and the rows are short, so that it stays fast; the
              row says what was measured
  precision   for each attack scored from the token statistics alone (loss, zlib, mink, minkpp, surp), the
              largest bfloat16-vs-float32 difference in its score on the check rows of every family, against
              ``PRECISION_TOLERANCE`` (0.1 nats per row; zlib's divided by the row's compressed length)

A failing row makes ``first_failure`` name the first one, and ``mia doctor`` then exits 1. Every check can fail: the
attention rows compare every kernel, ``exact`` included, with jax's own attention in float32 (code independent of
mia's kernels), so they measure a real difference on a float32 backend too.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform as _platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from .files import cache_limit
from .files.atomic import write_json
from .attacks import AttackContext, get
from .attacks.registry import REGISTRY
from .attacks.zlib import zlib_length
from .data.examples import Example
from .engine.batching import put_padded
from .engine.compile_cache import ENV_SWITCH, compile_cache_wanted, default_compile_cache_dir
from .engine.loop import build_token_stats_step
from .engine.stats import CONTINUOUS_STATS, STAT_NAMES
from .files.hashing import default_cache_dir
from .flops import forward_flops_per_token, mfu, peak_tflops
from .models import attention as A
from .models import hub
from .models.family import FAMILIES, tiny_config
from .models.family import family as family_of
from .sharding import batch_sharding, describe, make_mesh, param_shardings, put_params
from .validate import InputError, output_file
from .version import __version__

CHECKS = ("platform", "attention", "mesh", "cache", "speed", "precision")
# positions the model reads per check row: more than one block of the blocked kernel, a multiple of 128 (splash). A
# row of n tokens feeds n - 1 positions (each text's last token is only predicted), so rows are CHECK_POSITIONS + 1.
CHECK_POSITIONS = 384
CHECK_LENGTHS = (385, 300, 129, 37, 385, 256, 2, 200)  # tokens of each check row (right padded to 385)
CHECK_VOCAB = 128  # the tiny configs' vocabulary
# largest |difference| of a token statistic (nats) against float32 with jax's attention (REFERENCE_KERNEL), by
# activation dtype: float32 kernels differ by summation order (at most 4e-6 here, never 0: the reference is other
# code); bfloat16 rounds weights and activations to 8 bits of mantissa (measured on the CPU: at most 0.11 over every
# family and kernel, splash in interpret mode included; an accelerator rounds elsewhere, hence the margin). A kernel
# that lets a query see the next token gives 1.7 to 3.8.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.5}
# the attention rows' reference: in float32 the xla kernel is jax.nn.dot_product_attention's XLA version on
# every backend (cuDNN runs only 16-bit inputs), under the model's "highest" matmul precision
REFERENCE_KERNEL = "xla"
MESH_TOLERANCE = 1e-4  # float32: a layout changes summation order only
# bf16 may move a check row's score by at most this much, for scores that are means of per-token log-probs (loss,
# mink, surp; nats) or of standardised log-probs (minkpp); zlib's (LL / compressed bytes) by this over the row's
# compressed length. Measured on the CPU: at most 0.0097 over every family (a tenth of it); weights that are not the
# float32 model's (garbage) move them by 2.4 to 20 times it.
PRECISION_TOLERANCE = 0.1
PRECISION_UNITS = {"loss": "nats", "mink": "nats", "surp": "nats", "minkpp": "sd units",
                   "zlib": "nats / compressed byte"}
SPEED = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
             vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048)  # Pythia-160m's shape
SPEED_POSITIONS = 2048  # positions the model reads per row (rows of 2049 tokens: 2048 predictions each)
SPEED_ROWS_PER_DEVICE = 8
SPEED_CPU_LAYERS = 2  # on a CPU: 2 of the 12 layers and 512 positions in all, so the line takes a few seconds
SPEED_CPU_POSITIONS = 512
SPEED_REPEATS = 3  # timed calls after the first (compiling) one; 1 on a CPU


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the report. ``ok``: True passed, False failed, None information only (nothing to fail).
    ``value`` is the number compared with ``tolerance`` (each in the row's units, named in ``result``)."""

    check: str
    result: str
    value: Optional[float] = None
    tolerance: Optional[float] = None
    ok: Optional[bool] = None


@dataclasses.dataclass
class DoctorReport:
    rows: list
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok is not False for r in self.rows)

    @property
    def first_failure(self) -> Optional[Check]:
        return next((r for r in self.rows if r.ok is False), None)

    def table(self) -> str:
        """The rows as one fixed-width table, then a verdict line."""
        head = ("check", "status", "value", "tolerance", "result")
        body = [(r.check, {True: "ok", False: "FAIL", None: "info"}[r.ok], _num(r.value), _num(r.tolerance),
                 r.result) for r in self.rows]
        widths = [max(len(x[i]) for x in [head] + body) for i in range(4)]
        lines = ["  ".join([c.ljust(widths[0]), s.ljust(widths[1]), v.rjust(widths[2]), t.rjust(widths[3]), res])
                 .rstrip() for c, s, v, t, res in [head] + body]
        lines.insert(1, "-" * len(lines[0]))
        bad = self.first_failure
        verdict = (f"mia doctor: all checks passed in {self.seconds:.1f} s" if bad is None else
                   f"mia doctor: check '{bad.check}' failed ({sum(r.ok is False for r in self.rows)} failed in all, "
                   f"{self.seconds:.1f} s): {bad.result}")
        return "\n".join(lines + ["", verdict])

    def to_json(self) -> dict:
        bad = self.first_failure
        return {"ok": self.ok, "first_failure": None if bad is None else bad.check, "seconds": round(self.seconds, 2),
                "rows": [dataclasses.asdict(r) for r in self.rows]}


def _num(x: Optional[float]) -> str:
    if x is None:
        return ""
    if x == 0 or 1e-3 <= abs(x) < 1e5:
        return f"{x:.4g}"
    return f"{x:.2e}"


def failed(check: str, error: BaseException) -> Check:
    return Check(check, f"error: {A.failure_reason(error, 300)}", ok=False)


# ------------------------------------------------------------------------------------------------ check rows
def check_rows(n_data: int) -> list:
    """The check rows' tokens (int32, lengths ``CHECK_LENGTHS`` repeated to a multiple of ``n_data`` rows), seeded."""
    n = max(len(CHECK_LENGTHS), -(-len(CHECK_LENGTHS) // n_data) * n_data)
    rng = np.random.default_rng(0)
    return [rng.integers(0, CHECK_VOCAB, CHECK_LENGTHS[i % len(CHECK_LENGTHS)]).astype(np.int32) for i in range(n)]


def random_params(module, seed: int, dtype=np.float32, tile: Optional[int] = None):
    """Random parameters of a Flax decoder module, drawn with NumPy (no init program to compile): kernels and
    embeddings ~ N(0, 1/fan_in) (fan_in = the leaf's second-to-last axis, the width for an embedding [V, D], so a
    tied head's logits are as spread as an untied one's), biases 0, norm weights 1. ``tile``: draw only that many
    numbers and repeat them (the speed line's large model, whose values do not matter)."""
    shapes = jax.eval_shape(partial(module.init, method=hub.init_method(module)), jax.random.PRNGKey(0),
                            jnp.zeros((1, 2), jnp.int32))["params"]
    rng = np.random.default_rng(seed)
    block = None if tile is None else rng.standard_normal(tile, np.float32)

    def fill(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "bias":
            return np.zeros(leaf.shape, dtype)
        if name not in ("kernel", "embedding"):
            return np.ones(leaf.shape, dtype)
        fan_in = leaf.shape[-1] if name == "embedding" else leaf.shape[-2]
        x = rng.standard_normal(leaf.shape, np.float32) if block is None else np.resize(block, leaf.shape)
        return (x / np.sqrt(fan_in)).astype(dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def tiny_models(model_type: str) -> dict:
    """{"float32": Model, "bfloat16": Model}: the family's tiny config with random weights (``random_params``, seed
    0), the bf16 model holding the float32 weights rounded to bf16."""
    fam = family_of(model_type)
    cfg = fam.config_cls.from_hf(tiny_config(model_type))
    params = random_params(fam.module_cls(cfg, dtype=jnp.float32, param_dtype=jnp.float32), 0)
    low = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    return {"float32": hub.from_config(cfg, params=params, dtype="float32"),
            "bfloat16": hub.from_config(cfg, params=low, dtype="bfloat16")}


def token_stats_on(model, rows: list, length: int, mesh, *, kernel: Optional[str] = None, fsdp: bool = False) -> dict:
    """{stat: [B, T-1] float32, "mask": [B, T-1]} of ``rows`` (right padded to ``length``) by the engine's token-stats
    step on ``mesh`` (parameters replicated, or FSDP); ``kernel``: the attention kernel (None: auto)."""
    shardings = param_shardings(model.params, mesh, fsdp=fsdp)
    step = build_token_stats_step(model, mesh, shardings)
    with A.forced_kernel(kernel):
        out = step(put_params(model.params, shardings), *put_padded(rows, len(rows), length, batch_sharding(mesh)))
        return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


def largest_difference(a: dict, b: dict) -> float:
    """The largest |a - b| of any token statistic at a scored position; inf when the scored positions differ (a row
    or a token lost) or a value there is not finite."""
    m = a["mask"]
    if not np.array_equal(m, b["mask"]):
        return math.inf
    worst = 0.0
    for s in CONTINUOUS_STATS:  # top1 (0 or 1) flips at a near-tie of the two largest logits, by design
        x, y = a[s][m].astype(np.float64), b[s][m].astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            return math.inf
        worst = max(worst, float(np.abs(x - y).max(initial=0.0)))
    return worst


# ------------------------------------------------------------------------------------------------ the checks
class _Run:
    """State shared by the checks of one doctor run: the devices, the tiny models and memoized token stats."""

    def __init__(self, families: Sequence[str]):
        self.devices = jax.local_devices()
        self.backend = jax.default_backend()
        self.dtype = hub.default_dtype()
        self.families = list(families)
        self.one = make_mesh(devices=self.devices[:1])
        self.rows = check_rows(len(self.devices))
        self._models: dict = {}
        self._stats: dict = {}

    def model(self, family: str, dtype: str):
        if family not in self._models:
            self._models[family] = tiny_models(family)
        return self._models[family][dtype]

    def stats(self, family: str, dtype: str, kernel: Optional[str], mesh=None, fsdp: bool = False) -> dict:
        """Token stats of the check rows, memoized by (family, dtype, kernel, mesh, fsdp); mesh None: one device."""
        key = (family, dtype, kernel, None if mesh is None else tuple(mesh.shape.items()), fsdp)
        if key not in self._stats:
            self._stats[key] = token_stats_on(self.model(family, dtype), self.rows, CHECK_POSITIONS + 1,
                                              self.one if mesh is None else mesh, kernel=kernel, fsdp=fsdp)
        return self._stats[key]

    def reference(self, family: str) -> dict:
        """float32 token stats with exact attention (the precision rows' float32 side)."""
        return self.stats(family, "float32", "exact")

    def attention_reference(self, family: str) -> dict:
        """float32 token stats with jax's own attention (``REFERENCE_KERNEL``): what the attention rows compare every
        kernel with, the exact kernel in float32 included."""
        return self.stats(family, "float32", REFERENCE_KERNEL)

    def auto_kernel(self, length: int, dtype: str, heads: int = 4, head_dim: int = 16,
                    family: Optional[str] = None) -> str:
        """What auto picks for ``length`` positions in an engine step here, failures aside; for ``family``'s tiny
        model when given (a soft-capped family, Gemma 2, never gets xla: ``attention.auto_kernel``)."""
        softcap = None if family is None else getattr(self.model(family, "float32").config, "attn_logit_softcapping",
                                                      None)
        with A.over_mesh(self.one):
            return A.auto_kernel(len(self.rows), heads, length, length, head_dim, jnp.dtype(dtype), softcap=softcap)


def platform_rows(run: _Run) -> list:
    kinds = sorted({d.device_kind for d in run.devices})
    small, long = run.auto_kernel(CHECK_POSITIONS, run.dtype), run.auto_kernel(SPEED_POSITIONS, run.dtype, 12, 64)
    forced = os.environ.get("MIA_ATTENTION", "").strip()
    return [
        Check("platform", f"{run.backend}: {len(run.devices)} x {', '.join(kinds)} (process {jax.process_index()} of "
                          f"{jax.process_count()})"),
        Check("versions", f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, mia "
                          f"{__version__}, python {_platform.python_version()}"),
        Check("auto precision", f"{run.dtype} (float32 on a CPU, bfloat16 on a GPU/TPU; --dtype float32 asks for "
                                "float32)"),
        Check("auto attention", f"{small} at {CHECK_POSITIONS} positions, {long} at {SPEED_POSITIONS} (12 heads of 64)"
                                + (f"; MIA_ATTENTION={forced} overrides it" if forced else "")),
    ]


def kernels_here(run: _Run, family: Optional[str] = None) -> list:
    """(kernel, is auto's pick) for every kernel that can run on this backend: auto's pick (for ``family``'s model
    when given), blocked, exact."""
    auto = run.auto_kernel(CHECK_POSITIONS, run.dtype, family=family)
    return [(k, k == auto) for k in dict.fromkeys([auto, "blocked", "exact"])]


def attention_rows(run: _Run) -> list:
    tol = TOLERANCE.get(run.dtype, TOLERANCE["bfloat16"])
    rows = []
    for family in run.families:
        for kernel, auto in kernels_here(run, family):
            name = f"attention {family} {kernel}"
            try:
                ref = run.attention_reference(family)
                d = largest_difference(ref, run.stats(family, run.dtype, kernel))
            except Exception as e:  # a kernel that cannot lower, compile or run here
                row = failed(name, e)
                if auto and kernel in A.FALLIBLE:
                    row = dataclasses.replace(row, result=row.result + f"; runs fall back to {A.FALLBACK} attention "
                                                                      "here, with one warning line")
                rows.append(row)
                continue
            where = f"max |Δ| of token stats vs float32 with jax's attention, {run.dtype}, {len(run.rows)} rows " \
                    f"x {CHECK_POSITIONS} positions" + (" (auto's pick)" if auto else "")
            rows.append(Check(name, where, d, tol, bool(d <= tol)))
    return rows


def model_axis(n_devices: int, heads: int, kv_heads: int) -> int:
    """The largest model axis > 1 that divides the devices and both head counts (1: none)."""
    return max((m for m in range(2, n_devices + 1) if n_devices % m == 0 and heads % m == 0 and kv_heads % m == 0),
               default=1)


def mesh_rows(run: _Run) -> list:
    n = len(run.devices)
    if n == 1:
        return [Check("mesh", "1 device: no mesh to compare (run with several devices to check one)")]
    rows = []
    for family in run.families:
        cfg = run.model(family, "float32").config
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or cfg.num_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        m = model_axis(n, heads, kv)
        layouts = [({"data": n}, False)] + ([({"data": n // m, "model": m}, True)] if m > 1 else [])
        for axes, fsdp in layouts:
            mesh = make_mesh(axes, run.devices)
            name = f"mesh {family} {describe(mesh)}"
            try:
                one = run.stats(family, "float32", run.auto_kernel(CHECK_POSITIONS, "float32", family=family))
                d = largest_difference(one, run.stats(family, "float32", None, mesh, fsdp))
            except Exception as e:
                rows.append(failed(name, e))
                continue
            what = "FSDP" if fsdp else "parameters replicated"
            rows.append(Check(name, f"max |Δ| of token stats vs one device, float32, auto attention, {what}", d,
                              MESH_TOLERANCE, bool(d <= MESH_TOLERANCE)))
    return rows


def probe_directory(path: Path) -> None:
    """Create ``path`` if needed and write, read back and remove a probe file in it; raises OSError if it cannot."""
    path.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".mia-doctor-", dir=path)
    try:
        os.write(fd, b"mia doctor")
        os.close(fd)
        if Path(probe).read_bytes() != b"mia doctor":
            raise OSError(f"{probe}: read back other bytes than written")
    finally:
        Path(probe).unlink(missing_ok=True)


def cache_rows(run: _Run) -> list:
    rows = []
    root = Path(default_cache_dir())
    try:
        cache_limit.check_env()
        limit = cache_limit.max_bytes()
    except Exception as e:
        return [failed("cache limit", e)]
    for name, path, kind in (("cache dir", root, None), ("compile cache dir", default_compile_cache_dir(), "xla")):
        if kind == "xla" and not compile_cache_wanted():
            rows.append(Check(name, f"{path}: switched off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})"))
            continue
        try:
            probe_directory(path)
            size = sum(e.size for e in cache_limit.scan(root) if kind is None or e.kind == kind)
        except Exception as e:
            rows.append(Check(name, f"{path}: not writable ({type(e).__name__}: {e}); set MIA_CACHE_DIR to a "
                                    "writable directory", ok=False))
            continue
        over = "" if size <= limit else "; over the limit: `mia cache prune --max-gb N` (or the next write) evicts"
        share = "all entries" if kind is None else "compiled programs"
        rows.append(Check(name, f"{path}: writable; bytes used ({share}) against the cache limit "
                                f"{cache_limit.fmt_bytes(limit)} ({cache_limit.ENV_MAX_GB}){over}", float(size),
                          float(limit), size <= limit))
    return rows


def speed_shape(backend: str, n_data: int) -> tuple:
    """(layers, rows, positions per row) of the speed line: Pythia-160m's 12 layers, 8 rows of 2048 positions per
    device on an accelerator; on a CPU 2 layers and ``SPEED_CPU_POSITIONS`` in all (one row per device, at least 64).
    A row holds one token more than its positions (the last is only predicted)."""
    if backend == "cpu":
        return SPEED_CPU_LAYERS, n_data, max(64, SPEED_CPU_POSITIONS // n_data)
    return SPEED["num_hidden_layers"], SPEED_ROWS_PER_DEVICE * n_data, SPEED_POSITIONS


def speed_model(layers: int, dtype: str):
    """A Pythia-160m-shaped GPT-NeoX (``layers`` of its 12) with random weights in ``dtype``."""
    fam = family_of("gpt_neox")
    cfg = fam.config_cls.from_hf(dict(SPEED, num_hidden_layers=layers, model_type="gpt_neox"))
    module = fam.module_cls(cfg, dtype=hub.DTYPES[dtype], param_dtype=hub.DTYPES[dtype])
    params = random_params(module, 1, hub.DTYPES[dtype], tile=1 << 20)
    return hub.Model(module, params, None, cfg, "gpt_neox", None, "mia-doctor-speed")


def speed_rows(run: _Run) -> list:
    n = len(run.devices)
    layers, rows, positions = speed_shape(run.backend, n)
    model = speed_model(layers, run.dtype)
    mesh = make_mesh(devices=run.devices)
    shardings = param_shardings(model.params, mesh, fsdp=False)
    step = build_token_stats_step(model, mesh, shardings)
    params = put_params(model.params, shardings)
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, SPEED["vocab_size"], positions + 1).astype(np.int32) for _ in range(rows)]
    args = put_padded(tokens, rows, positions + 1, batch_sharding(mesh))
    with A.recording_kernels() as used:
        t0 = time.perf_counter()
        out = jax.block_until_ready(step(params, *args))
        compile_s = time.perf_counter() - t0
    times = []
    repeats = 1 if run.backend == "cpu" else SPEED_REPEATS
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, *args))
        times.append(time.perf_counter() - t0)
    best = min(times)
    host = jax.device_get(out)
    finite = all(np.isfinite(np.asarray(host[s])[np.asarray(host["mask"])]).all()
                 for s in ("logprob", "mean_logp", "std_logp", "entropy"))
    tokens_s = rows * positions / best  # tokens scored (each position predicts one)
    kind = run.devices[0].device_kind
    peak = peak_tflops(kind)
    flops = forward_flops_per_token(SPEED["hidden_size"], layers, SPEED["intermediate_size"], SPEED["vocab_size"],
                                    positions) * rows * positions
    util = mfu(flops, best, peak, n)
    shape = ("Pythia-160m shape" if layers == SPEED["num_hidden_layers"] else
             f"Pythia-160m shape with {layers} of its 12 layers (CPU: kept small)")
    kernels = ", ".join(dict.fromkeys(used)) or "?"
    rate = (f"MFU {100 * util:.1f}% of {peak:g} TFLOP/s bf16 per device ({kind})" if util is not None else
            f"MFU n/a (no peak known for {kind})")
    result = (f"tokens/s of token stats, {shape}, {rows} x {positions} positions, {run.dtype}, {kernels} attention, "
              f"{n} device(s), best of {repeats} ({best * 1e3:.0f} ms; compile {compile_s:.1f} s); {rate}")
    if not finite:
        result += "; NON-FINITE token stats"
    return [Check("speed", result, tokens_s, None, bool(finite and math.isfinite(tokens_s)))]


def stats_attacks() -> list:
    """The registered attacks scored from the token statistics alone (and the text): no further model call."""
    return sorted(n for n, s in REGISTRY.items() if "stats" in s.needs and set(s.needs) <= {"stats", "text"})


def check_texts(rows: list) -> list:
    """The check rows' texts (for zlib): their token ids written out."""
    return [" ".join(map(str, t.tolist())) for t in rows]


def attack_scores(model, rows: list, stats: dict, attacks: Sequence[str]) -> dict:
    """{attack: [N] scores} of the check rows from their token stats (texts: ``check_texts``)."""
    per_row = [{s: stats[s][i, :len(t) - 1] for s in STAT_NAMES} for i, t in enumerate(rows)]
    examples = [Example(str(i), tokens=t, text=x) for i, (t, x) in enumerate(zip(rows, check_texts(rows)))]
    ctx = AttackContext(model, examples, _stats=per_row)
    return {a: np.asarray(get(a).fn(ctx, **get(a).defaults), np.float64) for a in attacks}


def precision_allowance(attack: str, rows: list) -> np.ndarray:
    """[N] how far bf16 may move each check row's score: ``PRECISION_TOLERANCE``, over the compressed length for
    zlib (whose score is the mean log-prob divided by it)."""
    if attack == "zlib":
        return PRECISION_TOLERANCE / np.array([zlib_length(x) for x in check_texts(rows)], np.float64)
    return np.full(len(rows), PRECISION_TOLERANCE)


def precision_rows(run: _Run) -> list:
    try:
        attacks = stats_attacks()
        scores = {}
        for family in run.families:
            low = run.stats(family, "bfloat16", run.auto_kernel(CHECK_POSITIONS, "bfloat16", family=family))
            scores[family] = (attack_scores(run.model(family, "float32"), run.rows, run.reference(family), attacks),
                              attack_scores(run.model(family, "bfloat16"), run.rows, low, attacks))
    except Exception as e:
        return [failed("precision", e)]
    rows = []
    for a in attacks:
        allowed = precision_allowance(a, run.rows)
        worst = None  # (|Δ| / allowance, |Δ|, allowance, family, row)
        for family, (f32, bf16) in scores.items():
            x, y = f32[a], bf16[a]
            d = np.where(np.isfinite(x) & np.isfinite(y), np.abs(x - y), 0.0)
            d[np.isfinite(x) != np.isfinite(y)] = math.inf  # a score bf16 loses (or makes up)
            i = int(np.argmax(d / allowed))
            if worst is None or d[i] / allowed[i] > worst[0]:
                worst = (d[i] / allowed[i], float(d[i]), float(allowed[i]), family, i)
        _, d, tol, family, i = worst
        unit = PRECISION_UNITS.get(a, "score units")
        what = (f"largest |Δ score| bfloat16 vs float32 over {len(run.rows)} check rows x {len(scores)} families "
                f"(at {family}, a {len(run.rows[i])}-token row), in {unit}")
        if d == 0:
            what += "; no difference"
        rows.append(Check(f"precision {a}", what, d, tol, bool(d <= tol)))
    return rows


CHECK_FUNCTIONS: dict = {"platform": platform_rows, "attention": attention_rows, "mesh": mesh_rows,
                         "cache": cache_rows, "speed": speed_rows, "precision": precision_rows}


# ------------------------------------------------------------------------------------- the arguments of a run
def name_list(names, what: str, known: Sequence[str], noun: str) -> list:
    """``names`` (a comma-separated string, as ``--checks`` / ``--families`` give them, or a sequence) checked
    before anything runs: at least one, each of ``known`` (``noun`` names them in the error: "doctor check(s)").
    One ``InputError`` line naming ``what`` otherwise (an empty list would run nothing and report every check
    passed)."""
    if isinstance(names, str):
        names = names.split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    if not names:
        raise InputError(f"{what}: empty; give some of {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError(f"{what}: unknown {noun} {', '.join(unknown)}; expected some of {', '.join(known)}")
    return list(dict.fromkeys(names))


def check_report_path(path, what: str = "--json") -> Path:
    """The JSON report's destination, checked before a minute of checks: not a directory, no file in its way, and
    writable (its directory is created, as ``mia score --out``'s is, and a probe file is written in it and removed
    at once: a read-only file system or a directory the user may not write is found even as root). One
    ``InputError`` line naming ``what`` otherwise."""
    p = output_file(path, what)
    try:
        p.absolute().parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=p.absolute().parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{what} {p}: cannot be written ({e.strerror or e})") from None
    return p


def doctor(*, checks: Sequence[str] = CHECKS, families: Optional[Sequence[str]] = None,
           progress: Optional[Callable[[str], None]] = None) -> DoctorReport:
    """Run the checks (``CHECKS``, in that order; a subset by name) on ``families`` (default: every registered
    family) and return the report. ``progress(check)`` is called before each check starts. An empty ``checks`` or
    ``families``, or a name that is not one, is a ``ValueError`` (``name_list``) before anything runs."""
    checks = name_list(checks, "checks", CHECKS, "doctor check(s)")
    if families is not None:
        families = name_list(families, "families", sorted(FAMILIES), "model family(-ies)")
    t0 = time.perf_counter()
    families = sorted(FAMILIES) if families is None else list(families)
    rows: list = []
    try:
        run = _Run(families)
    except Exception as e:
        return DoctorReport([failed("platform", e)], time.perf_counter() - t0)
    for c in CHECKS:
        if c not in checks:
            continue
        if progress is not None:
            progress(c)
        try:
            rows += CHECK_FUNCTIONS[c](run)
        except Exception as e:
            rows.append(failed(c, e))
    return DoctorReport(rows, time.perf_counter() - t0)


def write_report(report: DoctorReport, path) -> None:
    """``report.to_json()`` to ``path`` (written atomically; its directory created if missing)."""
    Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    write_json(path, report.to_json(), indent=1)


def print_progress(check: str) -> None:
    print(f"mia doctor: {check} ...", file=sys.stderr, flush=True)

