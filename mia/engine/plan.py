"""``mia plan``: will a scoring run fit? Compile the step ahead of time on abstract parameters and read XLA's memory.

    mia plan --model DIR|CONFIG.json|pythia-12b --dtype bfloat16 --batch 8 --length 2048 \
        [--mesh data=1,model=8] [--topology v5e:2x4] [--device-memory 80GiB]
        [--attack stats|camia|mope[:n=10,chunk=2]|recall[:prefix_len=N]|em_mia[:group=G]|samia[:n=10,top_k=50]]

Nothing is allocated: parameters are ``jax.ShapeDtypeStruct``s (from ``jax.eval_shape`` of the module's init)
carrying the shardings ``mia.sharding`` would give them on the mesh, the step is
``jit(...).lower(...).compile()``d,
and ``compiled.memory_analysis()`` gives the per-device figures XLA's buffer assignment computed:

  params_bytes  bytes of this device's parameter shards (exact, from the shardings)
  peak_bytes    the larger of XLA's ``peak_memory_in_bytes`` and arguments + outputs + temporaries - aliased
                (the temporaries are one arena packed by liveness, so this bound is what the step needs at most;
                XLA:CPU's own peak figure leaves the arena out)
  device_bytes  the device's memory: the TPU chip's HBM for ``--topology``; the local device's ``bytes_limit``;
                or ``--device-memory``; unknown (null) on a CPU without ``--device-memory``
  fits          peak_bytes <= device_bytes (null when device_bytes is unknown)

With ``--topology`` (e.g. ``v5e:2x4``, ``v4:2x2x1``, ``v6e:2x2``) the step is compiled by libtpu for that TPU slice
through ``jax.experimental.topologies``, with no TPU present (``pip install libtpu``, ideally in a separate venv;
run it with networking disabled, e.g. under ``unshare -n``, since libtpu otherwise may look for a cloud metadata
server; we set ``TPU_SKIP_MDS_QUERY=1`` and ``JAX_PLATFORMS=cpu`` when jax is not imported yet). Without it, the step
is compiled for the local devices. XLA:CPU's memory analysis is NOT representative of bf16 on accelerators (it
upcasts bf16 arithmetic to float32 and fuses differently); use it for float32, or as an estimate only.

Each attack's steps are built by the same functions the engine jits them with (``build_token_stats_step``,
``conditional.build_prefix_step`` / ``build_cond_step``, ``build_decode_step``, MoPe's ``build_mope_step``), so a plan
lowers the very programs ``mia score`` runs (tests compare the StableHLO text). What ``--attack NAME`` lowers is
registered (``register_planned_attack``): the engine registers its own steps here, an attack with a step of its own
registers it from its module (MoPe's perturbed step, CAMIA's token-stats pass over its repeated text), so the engine
never imports an attack. ReCaLL / EM-MIA plan two steps, the prefix pass and the conditional-LL call, at the padded
shapes ``loglik_matrix`` uses (``conditional_shapes``); SaMIA plans ``generate``'s decode loop at ``samia_shapes``.

The last line printed is one JSON object ``{"params_bytes", "peak_bytes", "device_bytes", "fits", ...}``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models import attention as A
from ..models.common import ConfigError
from ..models.hub import Model, resolve_dtypes, abstract_params, config_from_hf, family, read_config_json
from ..validate import check_hf_config
from .batching import ScoringSettings, bucket_length, pow2_floor, row_length
from .conditional import build_cond_step, build_prefix_step, prefix_room, prefix_shardings
from .generate import Sampling, build_decode_step
from .loop import build_token_stats_step
from .stats import STAT_NAMES, program_stats
from ..sharding import batch_sharding, make_mesh, param_shardings, replicated, sharded_bytes

GiB = 1 << 30

# Usable HBM per TPU chip by jax ``device_kind`` (lower case). v5e: 16 GiB of HBM, of which 15.75 GiB are available
# to programs; the others are the data-sheet HBM sizes.
TPU_HBM_BYTES = {
    "tpu v4": 32 * GiB,
    "tpu v5 lite": int(15.75 * GiB),
    "tpu v5": 95 * GiB,
    "tpu v6 lite": 32 * GiB,
}

# Shapes of the models our users score, so that ``--model pythia-12b`` works without a checkpoint on disk.
# Numbers from the public config.json files of EleutherAI/pythia-*-deduped, allenai/OLMo-7B-hf,
# meta-llama/Llama-3.1-8B and Qwen/Qwen2.5-7B.
_PYTHIA = {  # name: (hidden, layers, heads, vocab)
    "70m": (512, 6, 8, 50304), "160m": (768, 12, 12, 50304), "410m": (1024, 24, 16, 50304),
    "1b": (2048, 16, 8, 50304), "1.4b": (2048, 24, 16, 50304), "2.8b": (2560, 32, 32, 50304),
    "6.9b": (4096, 32, 32, 50432), "12b": (5120, 36, 40, 50688),
}
NAMED_SHAPES = {
    **{f"pythia-{k}": {"model_type": "gpt_neox", "hidden_size": d, "num_hidden_layers": n, "num_attention_heads": h,
                       "intermediate_size": 4 * d, "vocab_size": v, "rotary_pct": 0.25, "max_position_embeddings": 2048,
                       "use_parallel_residual": True, "tie_word_embeddings": False}
       for k, (d, n, h, v) in _PYTHIA.items()},
    "olmo-7b": {"model_type": "olmo", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 50304,
                "max_position_embeddings": 2048, "tie_word_embeddings": False, "clip_qkv": None},
    # the architecture fields of meta-llama/Llama-3.1-8B's and Qwen/Qwen2.5-7B's config.json
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                     "bos_token_id": 128000, "eos_token_id": 128001, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "bos_token_id": 151643, "eos_token_id": 151643, "rope_theta": 1000000.0,
                   "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28},
}


class PlanError(ValueError):
    """A request ``mia plan`` cannot compile; one line for the user."""


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """Per-device figures of one compiled step (bytes)."""

    params_bytes: int
    peak_bytes: int
    device_bytes: Optional[int]
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    devices: int
    device_kind: str
    mesh: dict
    peak_source: str
    group_bytes: Optional[int] = None  # MoPe: the largest leaf group perturbed at once (per device)
    steps: Optional[dict] = None  # several compiled steps (ReCaLL, EM-MIA): {name: {"shape", "peak_bytes", ...}}
    platform: str = "cpu"  # the backend the attention kernels were chosen for
    attention: tuple = ()  # sorted distinct (kernel chosen there, kernel compiled here) pairs of the traced calls

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    def to_json(self) -> dict:
        return {"params_bytes": self.params_bytes, "peak_bytes": self.peak_bytes, "device_bytes": self.device_bytes,
                "fits": self.fits, "temp_bytes": self.temp_bytes, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "devices": self.devices, "device_kind": self.device_kind,
                "mesh": self.mesh, "peak_source": self.peak_source, "group_bytes": self.group_bytes,
                "steps": self.steps, "platform": self.platform,
                "attention": [{"chosen": c, "compiled": k} for c, k in self.attention]}

    @property
    def stand_in(self) -> bool:
        """Some attention kernel was compiled in place of the one the platform runs (``planning_for``)."""
        return any(c != k for c, k in self.attention)


# ----------------------------------------------------------------------------------------------- inputs
def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '16g', '17179869184' -> bytes (GB = 1e9, GiB = 2^30; a bare 'G' means GiB)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise PlanError(f"--device-memory {text!r}: expected a size such as 80GiB, 80GB or 16g")
    value, unit, binary, b = m.groups()
    power = " kmgt".index(unit) if unit else 0
    base = 1024 if (binary or not b) else 1000
    try:
        n = int(float(value) * base ** power)
    except (ValueError, OverflowError):  # "." or "1.2.3"; 400 nines (an infinite float)
        raise PlanError(f"--device-memory {text!r}: expected a size such as 80GiB, 80GB or 16g") from None
    if n < 1:
        raise PlanError(f"--device-memory {text!r}: must be more than 0 bytes")
    return n


def config_source(model: str) -> str:
    """What errors about ``--model``'s config name: the named shape, or the config.json path."""
    if model in NAMED_SHAPES:
        return model
    try:
        return str(Path(model) / "config.json") if Path(model).is_dir() else model
    except OSError:  # a name too long: read_hf_config says so
        return model


def read_hf_config(model: str) -> dict:
    """The HF config dict of a model directory, a config.json file, or a name in NAMED_SHAPES."""
    if model in NAMED_SHAPES:
        return dict(NAMED_SHAPES[model])
    path = Path(config_source(model))
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        raise PlanError(f"--model {model[:300]}: cannot be looked at ({e.strerror or e})") from None
    if not path.exists():
        raise PlanError(f"--model {model}: no such directory or config.json "
                        f"(or a named shape: {', '.join(NAMED_SHAPES)})")
    hf = read_config_json(path)  # the checks ``mia score`` runs: JSON, then every known field's type and range
    if "model_type" not in hf:
        raise PlanError(f"{path}: field 'model_type' is missing")
    return hf


# libtpu's multi-process lock: the path is fixed in libtpu (TMPDIR does not move it); a process that loads libtpu
# takes a POSIX lock on it for its whole life, and a second one fails with "The TPU is already in use by process ..."
LIBTPU_LOCK = "/tmp/libtpu_lockfile"
_LOCK_WORDS = ("already in use", "libtpu_lockfile", "multi-process lockfile")


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def libtpu_lock_state(path: Optional[str] = None) -> Optional[str]:
    """"held" when another process holds a lock on libtpu's lock file, "unopenable" when the file exists but this
    user cannot open it (another user's, perhaps stale), None when it is absent or free. Tests the lock only
    (``os.lockf(F_TEST)``): nothing is acquired."""
    path = LIBTPU_LOCK if path is None else path
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except PermissionError:
        return "unopenable"
    try:
        os.lockf(fd, os.F_TEST, 0)
    except OSError:
        return "held"
    finally:
        os.close(fd)
    return None


def lock_message(name: str, error_text: str, path: Optional[str] = None) -> Optional[str]:
    """The one-line error for ``--topology name`` when libtpu failed on its lock file (by libtpu's error text or
    the file's state); None when the failure is something else."""
    path = LIBTPU_LOCK if path is None else path
    state = libtpu_lock_state(path)
    if state is None and not any(w in error_text for w in _LOCK_WORDS):
        return None
    if state == "unopenable":
        how = (f"libtpu's lock file {path} exists but cannot be opened by this user (another user's TPU program, or "
               f"a stale file): wait for it, or remove it (sudo rm {path})")
    else:
        how = (f"libtpu's lock file {path} is held by another process (a TPU program or another `mia plan "
               f"--topology`; `fuser {path}` names it): wait for it to finish, or run this plan with "
               f"ALLOW_MULTIPLE_LIBTPU_LOAD=1 (planning compiles only and uses no TPU chip); if no process holds it, "
               f"remove the stale file (rm {path}; TMPDIR does not move it)")
    return f"--topology {name!r}: {how}"


def topology_devices(name: str):
    """Abstract devices of a TPU topology (e.g. 'v5e:2x4'), compiled for by libtpu without a TPU."""
    if not libtpu_installed():
        raise PlanError("--topology needs the libtpu wheel (pip install libtpu, ideally in a separate venv); "
                        "it is not installed in this environment")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(name, platform="tpu").devices)
    except Exception as e:  # libtpu's INVALID_ARGUMENT for a name it does not know; ABORTED when it is locked
        locked = lock_message(name, str(e))
        if locked:
            raise PlanError(locked) from None
        dims = re.fullmatch(r"[^:]+:(\d+)x(\d+)(?:x(\d+))?", name)
        if dims and "chips_per_host_bounds" in str(e):  # a slice smaller than one host, e.g. v5e:1x1
            bounds = tuple(int(d or 1) for d in dims.groups())
            try:
                return list(topologies.get_topology_desc(name, platform="tpu", chips_per_host_bounds=bounds).devices)
            except Exception as e2:
                e = e2
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"--topology {name!r}: libtpu does not know it ({msg}); examples: v5e:2x4, v4:2x2x1, "
                        "v6e:2x2") from None


def device_memory(device, override: Optional[int]) -> Optional[int]:
    """Bytes of memory of one device: the override, the TPU table, the runtime's bytes_limit, else None."""
    if override is not None:
        return override
    kind = str(getattr(device, "device_kind", "")).lower()
    if kind in TPU_HBM_BYTES:
        return TPU_HBM_BYTES[kind]
    try:
        stats = device.memory_stats()
    except Exception:  # abstract or CPU devices have none
        stats = None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


# ----------------------------------------------------------------------------------------------- the plan
def shard_bytes(abstract_tree) -> int:
    """Bytes of ONE device's shards of a pytree of ShapeDtypeStructs with shardings (max over devices)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def memory_figures(compiled) -> tuple[int, int, int, int, str]:
    """(peak, argument, temp, output, source) bytes per device from ``compiled.memory_analysis()``."""
    m = compiled.memory_analysis()
    if m is None:
        raise PlanError("this backend reports no memory analysis for compiled programs")
    arg, tmp, out = int(m.argument_size_in_bytes), int(m.temp_size_in_bytes), int(m.output_size_in_bytes)
    alias = int(getattr(m, "alias_size_in_bytes", 0))
    bound = arg + out + tmp - alias
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    # XLA:CPU reports a peak below arguments + temporaries (it leaves the temp arena out); take the larger figure,
    # so that "fits" is never claimed on an optimistic number.
    if peak >= bound:
        return peak, arg, tmp, out, "peak_memory_in_bytes"
    return bound, arg, tmp, out, "arguments+outputs+temporaries-aliased"


def largest_group_bytes(model, shapes, shardings) -> int:
    """Per-device bytes of the largest parameter group a step transforms at once (MoPe perturbs one at a time): the
    non-layer leaves (embeddings, head, final norm) together, or one layer's slice of the stacked leaves."""
    layers = model.module.LAYERS
    top = {k: v for k, v in shapes.items() if k != layers}
    top_bytes = sharded_bytes(top, {k: v for k, v in shardings.items() if k != layers})
    stack = sharded_bytes(shapes[layers], shardings[layers])
    n_layers = int(model.config.num_hidden_layers)
    return max(top_bytes, stack // n_layers)


def abstract_model(hf: dict, dtype: str, source: str = "config"):
    """(Model with no params, abstract params pytree) of an HF config dict; nothing is allocated. The config is
    checked as ``mia score`` checks it (``mia.models.hub.config_from_hf``); errors name ``source``."""
    try:
        fam = family(hf["model_type"])
        cfg = config_from_hf(fam.config_cls, check_hf_config(hf, source, error=ConfigError), source, fam.harmless)
    except KeyError as e:
        raise PlanError(f"{source}: required field {e} is missing") from None
    except ConfigError as e:
        raise PlanError(f"{source}: {e}" if source not in str(e) else str(e)) from None
    act, param = resolve_dtypes(dtype)  # the loader's policy (float16: fp16 parameters, float32 compute)
    module, shapes = abstract_params(fam, cfg, act, param)
    return Model(module, None, None, cfg, fam.model_type, None, "plan"), shapes


@dataclasses.dataclass(frozen=True)
class PlannedAttack:
    """How ``mia plan --attack NAME`` lowers the steps an attack runs.

    ``lower(model, mesh, shardings, params, batch, length, **options)`` -> [(step name, shape, jax ``Lowered``)],
    with ``params`` abstract (``jax.ShapeDtypeStruct`` carrying ``shardings``) and rows over ``data``;
    ``options``: option as typed after ``NAME:`` -> (keyword of ``lower``, default); every option is an integer >= 1;
    ``describe(options)`` -> the step's name as ``mia plan`` prints it; ``per_step``: report every step's figures;
    ``group_bytes(model, shapes, shardings)`` -> the largest parameter group held twice (MoPe), or None."""

    name: str
    lower: Callable
    options: dict = dataclasses.field(default_factory=dict)
    describe: Callable = None
    per_step: bool = False
    group_bytes: Optional[Callable] = None

    def help(self) -> str:
        opts = ",".join(f"{k}={'INT' if d is None else d}" for k, (_, d) in self.options.items())
        return f"{self.name}[:{opts}]" if opts else self.name


PLANNED: dict[str, PlannedAttack] = {}


def register_planned_attack(name: str, lower: Callable, *, options: Optional[dict] = None,
                            describe: Optional[Callable] = None, per_step: bool = False,
                            group_bytes: Optional[Callable] = None) -> PlannedAttack:
    """Register how ``mia plan`` lowers the steps of attack ``name`` (see ``PlannedAttack``). The engine registers
    the steps it owns (stats, recall, em_mia, samia); an attack with a step of its own registers it from its module
    (``mia.attacks.mope``, ``mia.attacks.camia``), so the engine never imports an attack."""
    spec = PlannedAttack(name, lower, dict(options or {}), describe or (lambda opts: name), per_step, group_bytes)
    PLANNED[name] = spec
    return spec


def planned_attack(name: str) -> PlannedAttack:
    """The registered ``PlannedAttack`` (``PlanError`` naming the known ones otherwise). Attack-owned plans are
    registered when ``mia.attacks`` is imported (``mia plan`` does)."""
    if name not in PLANNED:
        raise PlanError(f"--attack {name!r}: expected {attack_help()}")
    return PLANNED[name]


def attack_help() -> str:
    """The registered planned attacks with their options: stats first, then by name."""
    names = sorted(PLANNED, key=lambda n: (n != "stats", n))
    return ", ".join(PLANNED[n].help() for n in names)


def row_args(b: int, t: int, sharding) -> tuple:
    """Abstract (tokens int32 [b, t], mask bool [b, t]) with ``sharding``."""
    return (jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=sharding))


def token_stats_steps(name: str, model, mesh, shardings, params, batch: int, t: int, stats=STAT_NAMES) -> list:
    """[(name, (batch, t), the token-stats step for ``stats`` (``mia.engine.stats.program_stats``: the program a
    run asking for them compiles) lowered at batch x t rows over ``data``)]."""
    step = build_token_stats_step(model, mesh, shardings, None, program_stats(stats))
    return [(name, (batch, t), step.lower(params, *row_args(batch, t, batch_sharding(mesh))))]


def samia_shapes(context: int, length: int, settings: ScoringSettings = ScoringSettings()) -> dict:
    """Shapes of SaMIA's generation for texts of ``length`` tokens with a ``context``-token model: the prompt is the
    first half (SaMIA prompts with the first half of the words; here half of the tokens), left padded to its length
    bucket (``generate`` buckets prompts by ``bucket_length``), and the continuation fills the rest of min(length,
    context): {"prompt": S padded, "prompt_tokens": P, "new": N}."""
    total = min(length, context)
    plen = max(1, total // 2)
    new = total - plen
    if new < 1:
        raise PlanError(f"--attack samia: a {length}-token text leaves no room to generate after its prompt")
    return {"prompt": int(bucket_length(plen, settings.min_bucket)), "prompt_tokens": int(plen), "new": int(new)}


def conditional_shapes(attack: str, context: int, length: int, prefix_len: Optional[int] = None,
                       group: Optional[int] = None, settings: ScoringSettings = ScoringSettings()) -> dict:
    """Padded shapes of the conditional-LL steps ``mia score`` runs for ReCaLL / EM-MIA on targets of ``length``
    tokens with a ``context``-token model: {"group": G prefix rows, "prefix": S, "target": T} (S, T powers of two,
    as ``loglik_matrix`` buckets them), with the attacks' context rule (``mia.attacks.fit.prefix_room``).

    recall: one prefix of ``prefix_len`` tokens (default: the most the rule allows, max(C - L, C // 2)), G = 1.
    em_mia: every text is a prefix, so prefixes of min(L, max(C - L, C // 2)) tokens; G = ``group`` or the engine's
    group size when there are many prefixes (``settings.token_budget`` prefix tokens, at most ``max_batch`` rows).
    Targets longer than C - prefix are cut to it, as the attacks cut them."""
    wanted = length if attack == "em_mia" else (context if prefix_len is None else prefix_len)
    plen = prefix_room(context, length, wanted)
    tlen = min(length, context - plen)
    need = 1 if attack == "recall" else 2
    if plen < 1 or tlen < need:
        raise PlanError(f"--attack {attack}: no room for a prefix and a {need}-token target in the model's "
                        f"{context}-token context (prefix {plen}, target {tlen} tokens)")
    s, t = bucket_length(plen, settings.min_bucket), bucket_length(tlen, settings.min_bucket)
    if attack == "recall":
        g = 1
    else:
        g = group or pow2_floor(max(1, min(settings.max_batch, settings.token_budget // s)))
    return {"group": int(g), "prefix": int(s), "target": int(t), "prefix_tokens": int(plen),
            "target_tokens": int(tlen)}


def _stats_steps(model, mesh, shardings, params, batch, length):
    settings = ScoringSettings()
    t = row_length(length, settings.min_bucket, settings.bucket_step)  # as plan_batches pads an ``length`` text
    return token_stats_steps("stats", model, mesh, shardings, params, batch, t)


def _samia_steps(model, mesh, shardings, params, batch, length, *, samia_n: int = 10, top_k: int = 50):
    sh = samia_shapes(model.max_length, length)
    cfg = Sampling(max_new=sh["new"], n=samia_n, top_k=top_k)
    rows, rep = batch_sharding(mesh), replicated(mesh)
    scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    per_row = lambda dtype, n: jax.ShapeDtypeStruct((n,), dtype, sharding=rows)  # noqa: E731
    step = build_decode_step(model, mesh, shardings, cfg).lower(
        params, *row_args(batch, sh["prompt"], rows), per_row(jnp.uint32, batch), scalar(jnp.uint32),
        per_row(jnp.int32, batch * samia_n), scalar(jnp.float32), scalar(jnp.int32, (1,)), scalar(jnp.int32))
    return [("samia", (batch * samia_n, sh["prompt"] + sh["new"]), step)]


def _conditional_steps(attack: str):
    def lower(model, mesh, shardings, params, batch, length, *, prefix_len=None, group=None):
        sh = conditional_shapes(attack, model.max_length, length, prefix_len, group)
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        cache_sh = prefix_shardings(model, mesh, params=shapes)
        g, s, t = sh["group"], sh["prefix"], sh["target"]
        rep = replicated(mesh)
        prefix = build_prefix_step(model, mesh, shardings, cache_sh).lower(params, *row_args(g, s, rep))
        cache = jax.tree_util.tree_map(lambda x, sd: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd),
                                       prefix.out_info, cache_sh)
        p_idx = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        cond = build_cond_step(model, mesh, shardings, cache_sh, attack == "recall").lower(
            params, cache, p_idx, *row_args(batch, t, batch_sharding(mesh)))
        return [("prefix", (g, s), prefix), ("conditional", (batch, t), cond)]
    return lower


register_planned_attack("stats", _stats_steps, describe=lambda o: "token stats")
register_planned_attack("recall", _conditional_steps("recall"), options={"prefix_len": ("prefix_len", None)},
                        describe=lambda o: "ReCaLL conditional LL", per_step=True)
register_planned_attack("em_mia", _conditional_steps("em_mia"), options={"group": ("group", None)},
                        describe=lambda o: "EM-MIA conditional LL", per_step=True)
register_planned_attack("samia", _samia_steps, options={"n": ("samia_n", 10), "top_k": ("top_k", 50)},
                        describe=lambda o: f"SaMIA generation (n={o.get('samia_n', 10)}, top_k={o.get('top_k', 50)})",
                        per_step=True)


def lowered_steps(hf: dict, *, dtype: str = "bfloat16", batch: int = 8, length: int = 2048,
                  mesh_axes: Optional[dict] = None, devices=None, fsdp: Optional[bool] = None, attack: str = "stats",
                  source: str = "config", **options):
    """(model, shapes, shardings, mesh, [(step name, shape, jax ``Lowered``)]): the jitted steps ``mia score`` runs
    for ``attack``, built by the engine's own builders (or the attack's, ``register_planned_attack``) and lowered on
    abstract parameters. Arguments as ``plan_scoring``."""
    spec = planned_attack(attack)
    known = {kw for kw, _ in spec.options.values()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise PlanError(f"--attack {attack}: no option {', '.join(unknown)} (it takes {spec.help()})")
    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(mesh_axes, devices)
    fsdp = (mesh_axes is not None) if fsdp is None else fsdp
    n_data = dict(mesh.shape)["data"]
    if batch % n_data:
        raise PlanError(f"--batch {batch} must be a multiple of the mesh's data axis ({n_data})")
    model, shapes = abstract_model(hf, dtype, source)
    if length > model.max_length + 1:
        raise PlanError(f"--length {length} is beyond the model's context: {source} has max_position_embeddings "
                        f"{model.max_length} (a text may hold one token more, predicted only)")
    shardings = param_shardings(shapes, mesh, fsdp=fsdp)
    params = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    given = {kw: options[kw] for kw in known if options.get(kw) is not None}
    steps = spec.lower(model, mesh, shardings, params, batch, length, **given)
    return model, shapes, shardings, mesh, steps


def plan_scoring(hf: dict, *, dtype: str = "bfloat16", batch: int = 8, length: int = 2048,
                 mesh_axes: Optional[dict] = None, devices=None, fsdp: Optional[bool] = None,
                 device_bytes: Optional[int] = None, attack: str = "stats", source: str = "config",
                 platform: Optional[str] = None, **options) -> PlanResult:
    """Compile a scoring step ahead of time and read its memory.

    ``attack``: a registered planned attack (``PLANNED``; ``mia.attacks`` registers its own on import): "stats"
    (the token-statistics pass every attack shares), "mope" (MoPe's step with ``mope_n`` perturbed models,
    ``mope_chunk`` of them vmapped at a time), "camia" (the token-stats pass over the repeated text), "recall" /
    "em_mia" (the prefix pass and the conditional-LL call, shapes from ``conditional_shapes``; ``batch`` target rows),
    "samia" (``generate``'s decode loop, ``samia_n`` samples, ``top_k``). ``options``: the attack's keywords. With
    several steps the figures are those of the step with the larger peak, every step's in ``steps``.

    ``devices``: the devices to compile for (default: the local ones; a TPU topology's abstract devices work).
    ``mesh_axes``: {"data": n, "model": m} (default: all devices on data). ``fsdp`` defaults to True when a mesh is
    given and False without one, as ``mia score`` does. ``source`` names the config in errors; ``length`` may not
    exceed the model's context (``max_position_embeddings``).

    ``platform``: the backend whose attention kernels the step uses ("cpu", "gpu", "tpu"; default: the devices'
    platform). Planning "gpu" on a host without a GPU lowers the blocked kernel where a GPU would run cuDNN's flash
    attention (``mia.models.attention.planning_for``; ``PlanResult.attention`` says so).
    """
    spec = planned_attack(attack)
    devices = list(jax.devices() if devices is None else devices)
    platform = platform or devices[0].platform
    with A.planning_for(platform, devices[0].platform) as chosen:
        model, shapes, shardings, mesh, steps = lowered_steps(
            hf, dtype=dtype, batch=batch, length=length, mesh_axes=mesh_axes, devices=devices, fsdp=fsdp,
            attack=attack, source=source, **options)
    figures = {name: (shape, memory_figures(lowered.compile())) for name, shape, lowered in steps}
    worst = max(figures, key=lambda n: figures[n][1][0])
    peak, arg, tmp, out, peak_source = figures[worst][1]
    detail = None
    if spec.per_step:
        detail = {n: {"shape": list(sh), "peak_bytes": f[0], "argument_bytes": f[1], "temp_bytes": f[2],
                      "output_bytes": f[3]} for n, (sh, f) in figures.items()}
    return PlanResult(params_bytes=sharded_bytes(shapes, shardings), peak_bytes=peak,
                      device_bytes=device_memory(devices[0], device_bytes), argument_bytes=arg, temp_bytes=tmp,
                      output_bytes=out, devices=len(devices), device_kind=str(devices[0].device_kind),
                      mesh={k: int(v) for k, v in dict(mesh.shape).items()}, peak_source=peak_source,
                      group_bytes=spec.group_bytes(model, shapes, shardings) if spec.group_bytes else None,
                      steps=detail, platform=platform, attention=tuple(sorted(set(chosen))))


# ----------------------------------------------------------------------------------------------- command line
def parse_plan_attack(text: str) -> tuple[str, dict]:
    """'stats' | 'camia' | 'mope:n=10,chunk=2' | 'recall:prefix_len=512' | 'em_mia:group=8' -> (name, plan_scoring
    keyword arguments); every option an integer >= 1."""
    name, _, rest = text.partition(":")
    if name not in PLANNED:
        raise PlanError(f"--attack {text[:80]!r}: expected {attack_help()}")
    known = PLANNED[name].options
    opts = {kw: default for kw, default in known.values()}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in known or not (value.isascii() and value.isdigit()) or len(value) > 9 or int(value) < 1:
            allowed = ",".join(f"{k}=INT" for k in known) or "no options"
            raise PlanError(f"--attack {text[:80]!r}: {name} takes {allowed} (integers in [1, 999999999])")
        opts[known[key][0]] = int(value)
    return name, opts


def local_device_count() -> int:
    return len(jax.devices())
