"""Testbed configuration: a frozen dataclass, named presets, and the hash that identifies a built testbed."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

from ..validate import INT32_MAX, Range, integer, number

FORMAT = "mia-testbed/3"  # 2: duplicate documents and rows dropped;
# 3: model context = the trained seq_len, fast NumPy init, stacked layers (state names [L, ...])

# The fields that determine the training data (corpus, tokenizer, packing, row order, batches, checkpoint steps).
# Members of a suite (``mia.testbed.suite``) share all of them and differ only in the model and its learning rate.
DATA_FIELDS = ("corpus", "text_column", "max_corpus_bytes", "vocab_size", "reserved_tokens", "seq_len", "batch_size",
               "train_steps", "checkpoints", "seed", "canaries", "canary_reps", "canary_kind")

# Optional feature groups: a group's fields enter the manifest and the config hash only when the feature is on, so a
# testbed without canaries, reserved tokens or privacy has exactly the config (and hash) it had before these options
# existed.
RESERVED_FIELDS = ("reserved_tokens",)
CANARY_FIELDS = ("canaries", "canary_reps", "canary_kind")
DP_FIELDS = ("dp_noise", "dp_clip", "dp_sampling")
# canary kinds (mia.testbed.canaries): random token ids and random corpus words (the baselines), new tokens (reserved
# ids the corpus never uses), the corpus's rarest tokens (unigram) and rarest token pairs (bigram), and rows sampled at
# high temperature from a model trained on the same order (sampled)
CANARY_KINDS = ("tokens", "words", "new", "unigram", "bigram", "sampled")
DP_SAMPLINGS = ("poisson", "fixed")


# Upper bounds of the counts that set how long a build trains (docs/testbed.md#bounds), checked when the options are
# parsed, before anything is built: far above every preset (the default suite trains 400 steps; the memorization dial
# is used with E = 4 or 8), and below what could never finish (a mistyped 10**12 used to train until killed).
TRAIN_STEPS_MAX = 1_000_000
MEMORIZE_EPOCHS_MAX = 1_000

# Type and range of each numeric field (``mia.validate``): checked when a config is made, and by the CLI's options.
FIELD_LIMITS = {
    "max_corpus_bytes": (int, Range(1)), "vocab_size": (int, Range(258, 65535)),
    "reserved_tokens": (int, Range(0, 65277)), "seq_len": (int, Range(2)),
    "hidden_size": (int, Range(1)), "num_layers": (int, Range(1)), "num_heads": (int, Range(1)),
    "intermediate_size": (int, Range(1)), "rotary_pct": (float, Range(0, 1, lo_open=True)),
    "batch_size": (int, Range(1)), "train_steps": (int, Range(1, TRAIN_STEPS_MAX)),
    "lr": (float, Range(0, lo_open=True)), "min_lr_ratio": (float, Range(0, 1)),
    "warmup_steps": (int, Range(0, TRAIN_STEPS_MAX)), "weight_decay": (float, Range(0)),
    "beta1": (float, Range(0, 1, hi_open=True)), "beta2": (float, Range(0, 1, hi_open=True)),
    "grad_clip": (float, Range(0, lo_open=True)), "seed": (int, Range(0, INT32_MAX)),
    "memorize_lr": (float, Range(0, lo_open=True)),
    "canaries": (int, Range(0, INT32_MAX)), "dp_noise": (float, Range(0)), "dp_clip": (float, Range(0, lo_open=True)),
}


def check_field(name: str, value, where: str, error=ValueError):
    """``value`` of TestbedConfig field ``name`` in its type and range (``FIELD_LIMITS``), or ``error``."""
    typ, limit = FIELD_LIMITS[name]
    if typ is int:
        return integer(value, where, lo=limit.lo, hi=limit.hi, error=error)
    return number(value, where, lo=limit.lo, hi=limit.hi, lo_open=limit.lo_open, hi_open=limit.hi_open, error=error)


class TestbedError(ValueError):
    """A testbed that cannot be built or used as asked; the message is one line meant for the user."""

    __test__ = False  # not a pytest class


def canary_kinds(spec) -> tuple:
    """The kinds of a ``canary_kind`` spec ("tokens", or several comma-separated: "new,unigram,tokens"), each one of
    :data:`CANARY_KINDS`, without repeats; else ``TestbedError``."""
    if not isinstance(spec, str):
        raise TestbedError(f"testbed config field 'canary_kind' must be a string, got {spec!r}")
    kinds = tuple(k.strip() for k in spec.split(","))
    bad = [k for k in kinds if k not in CANARY_KINDS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise TestbedError(f"testbed config field 'canary_kind' must be one of {', '.join(CANARY_KINDS)}, or several "
                           f"of them comma-separated without repeats; got {spec!r}")
    return kinds


# the fields of testbed.json / suite.json that are read, and their JSON types (a field may be absent)
TESTBED_FIELDS = {"format": str, "complete": bool, "config": dict, "config_hash": str, "checkpoints": dict,
                  "data": dict, "corpus": dict, "tokenizer": dict, "timings": dict}
SUITE_FIELDS = {"format": str, "name": str, "complete": bool, "members": list, "data": dict}


def read_manifest(path, fields: dict) -> dict:
    """The JSON object in the manifest ``path`` (``testbed.json`` or ``suite.json``), each of ``fields``
    ({name: type}) that is present of that type; otherwise one ``TestbedError`` line naming the file."""
    try:
        m = json.loads(open(path, "rb").read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TestbedError(f"{path}: not valid JSON ({str(e)[:120]}); delete the directory to rebuild") from None
    except OSError as e:
        raise TestbedError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(m, dict):
        raise TestbedError(f"{path}: expected a JSON object, got {type(m).__name__}")
    for k, typ in fields.items():
        if k in m and not isinstance(m[k], typ):
            raise TestbedError(f"{path}: field {k!r} must be a JSON {typ.__name__.replace('dict', 'object')}, "
                               f"got {type(m[k]).__name__}")
    return m


def config_of_manifest(m: dict, path) -> "TestbedConfig":
    """The TestbedConfig recorded in a testbed manifest ``m`` (read from ``path``), or one line naming the file."""
    try:
        c = m["config"]
        return TestbedConfig(**{**c, "checkpoints": tuple(c["checkpoints"])})
    except (KeyError, TypeError, ValueError) as e:
        raise TestbedError(f"{path}: field 'config' is not a testbed config ({type(e).__name__}: {str(e)[:120]})") \
            from None


@dataclasses.dataclass(frozen=True)
class TestbedConfig:
    """Everything that determines the trained checkpoints (and so enters ``config_hash``)."""

    preset: str = "custom"
    # corpus
    corpus: Optional[str] = None  # None = the Python standard library; or a directory / .jsonl / .parquet
    text_column: str = "text"
    max_corpus_bytes: Optional[int] = None  # first documents (path order) up to this many UTF-8 bytes
    # tokenizer and packing
    vocab_size: int = 2048
    # token ids reserved after the BPE vocabulary ("<|reserved_i|>", ids [bpe size, bpe size + reserved_tokens)), which
    # the corpus never uses: the new-token canaries' ids (mia.testbed.canaries); 0 = none
    reserved_tokens: int = 0
    seq_len: int = 128  # rows hold seq_len + 1 tokens (input row[:-1], labels row[1:]), as Pythia's 2049
    # model (GPT-NeoX / Pythia architecture)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: Optional[int] = None  # default 4 * hidden_size
    rotary_pct: float = 0.25
    # optimisation (AdamW, linear warmup then cosine decay to min_lr_ratio * lr)
    batch_size: int = 32
    train_steps: int = 400
    checkpoints: tuple = ()  # extra checkpoint steps; step 0 (init) and train_steps are always saved
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0  # model init and row permutation
    # memorization dial (continue after a checkpoint on a fixed member subset only; see Testbed.memorize)
    memorize_lr: Optional[float] = None  # constant learning rate of the dial (default: lr)
    # canaries (mia.testbed.canaries): a pool of random rows; canary i is included with probability 1/2 (seeded) and
    # then trained canary_reps[i % len(canary_reps)] times, as extra rows of recorded steps; 0 = no canaries
    canaries: int = 0
    canary_reps: tuple = (1, 4, 16, 64)
    canary_kind: str = "tokens"  # one kind of CANARY_KINDS, or several comma-separated (cycled over the canaries in
    # blocks of len(canary_reps), so that every (kind, reps) pair has the same number of canaries)
    # differentially private training (mia.testbed.dp): DP-SGD when dp_noise is set, ordinary training when None
    dp_noise: Optional[float] = None  # noise multiplier: Gaussian noise of std dp_noise * dp_clip on the clipped sum
    dp_clip: float = 1.0  # per-example gradient L2 norm bound
    dp_sampling: str = "poisson"  # "poisson": each record joins each step independently with probability
    # q = 1 / train_steps (dp.sample_rate: each record is expected once over the run; the natural rows give batches
    # of batch_size on average, the canary copies add their share); "fixed": the recorded batches of the ordinary
    # run (no amplification by sampling)

    def __post_init__(self):
        for name in FIELD_LIMITS:
            if getattr(self, name) is not None:
                check_field(name, getattr(self, name), f"testbed config field {name!r}", TestbedError)
        for s in self.checkpoints:
            integer(s, "testbed config field 'checkpoints'", lo=0, error=TestbedError)
        object.__setattr__(self, "checkpoints", tuple(sorted({int(s) for s in self.checkpoints})))
        self._check_options()
        problems = []
        for name in ("vocab_size", "seq_len", "hidden_size", "num_layers", "num_heads", "batch_size", "train_steps"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % max(self.num_heads, 1):
            problems.append(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.vocab_size < 258 or self.vocab_size > 65535:
            problems.append("vocab_size must be in [258, 65535] (byte alphabet + EOD; uint16 rows), got "
                            f"{self.vocab_size}")
        if self.vocab_size + self.reserved_tokens > 65535:
            problems.append(f"vocab_size {self.vocab_size} + reserved_tokens {self.reserved_tokens} must be at most "
                            "65535 (uint16 rows)")
        bad = [s for s in self.checkpoints if s < 0 or s > self.train_steps]
        if bad:
            problems.append(f"checkpoint step(s) {bad} outside [0, train_steps={self.train_steps}]")
        if self.warmup_steps < 0 or self.lr <= 0:
            problems.append("warmup_steps must be >= 0 and lr > 0")
        if problems:
            raise TestbedError("; ".join(problems))

    def _check_options(self) -> None:
        """The canary and privacy options that FIELD_LIMITS cannot express (lists and choices)."""
        if isinstance(self.canary_reps, (str, bytes)) or not hasattr(self.canary_reps, "__iter__"):
            raise TestbedError(f"testbed config field 'canary_reps' must be a list of integers, "
                               f"got {self.canary_reps!r}")
        hi = self.train_steps if self.canaries else None  # each copy of a canary goes to its own step
        reps = tuple(integer(r, "testbed config field 'canary_reps'", lo=1, hi=hi, error=TestbedError)
                     for r in self.canary_reps)
        if not reps:
            raise TestbedError("testbed config field 'canary_reps' must not be empty")
        object.__setattr__(self, "canary_reps", reps)
        kinds = canary_kinds(self.canary_kind)
        object.__setattr__(self, "canary_kind", ",".join(kinds))
        if self.canaries and "new" in kinds:
            n_new = sum(1 for i in range(self.canaries) if kinds[(i // len(reps)) % len(kinds)] == "new")
            if self.reserved_tokens < n_new + 1:
                raise TestbedError(f"{n_new} new-token canaries need reserved_tokens >= {n_new + 1} (one reserved id "
                                   f"each and at least one unused), got {self.reserved_tokens}")
        if self.dp_sampling not in DP_SAMPLINGS:
            raise TestbedError(f"testbed config field 'dp_sampling' must be one of {', '.join(DP_SAMPLINGS)}; "
                               f"got {self.dp_sampling!r}")

    @property
    def private(self) -> bool:
        """True when trained with DP-SGD (``dp_noise`` set)."""
        return self.dp_noise is not None

    @property
    def row_len(self) -> int:
        return self.seq_len + 1

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def n_params(self, vocab_size: Optional[int] = None) -> int:
        """Parameters of the GPT-NeoX model this config trains (untied embedding and head, biases, LayerNorms), at
        ``vocab_size`` (default: the configured one and the reserved tokens; the tokenizer may end up smaller)."""
        v, h, f = int(vocab_size or self.vocab_size + self.reserved_tokens), self.hidden_size, self.ffn_size
        layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
        return 2 * v * h + 2 * h + self.num_layers * layer

    @property
    def checkpoint_steps(self) -> tuple:
        return tuple(sorted({0, self.train_steps, *self.checkpoints}))

    def to_dict(self) -> dict:
        """The config as JSON-ready values; the canary / privacy fields only when that feature is on."""
        d = dataclasses.asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        d["canary_reps"] = list(self.canary_reps)
        if not self.reserved_tokens:
            for k in RESERVED_FIELDS:
                d.pop(k)
        if not self.canaries:
            for k in CANARY_FIELDS:
                d.pop(k)
        if not self.private:
            for k in DP_FIELDS:
                d.pop(k)
        return d

    def hash_dict(self) -> dict:
        """The fields that change what is trained (``preset`` is only a name)."""
        d = self.to_dict()
        d.pop("preset")
        d["format"] = FORMAT  # a change of how testbeds are built invalidates old ones
        return d

    @property
    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.hash_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **overrides) -> "TestbedConfig":
        valid = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(overrides) - valid)
        if bad:
            raise TestbedError(f"unknown testbed option(s) {', '.join(bad)}; valid: {', '.join(sorted(valid))}")
        return dataclasses.replace(self, **overrides)


PRESETS = {
    # < 60 s on 2 CPU cores from nothing: 0.4 MB of the stdlib, a 0.17M-parameter model (at the full 512-token
    # vocabulary)
    "smoke": TestbedConfig(preset="smoke", max_corpus_bytes=800_000, vocab_size=512, seq_len=64, hidden_size=64,
                           num_layers=2, num_heads=4, batch_size=16, train_steps=100, checkpoints=(50,), lr=3e-3,
                           warmup_steps=10),
    # the main job's default: the whole stdlib (~11 MB), a 0.9M-parameter model, ~6 minutes of training on 2 cores
    "default": TestbedConfig(preset="default", vocab_size=2048, seq_len=128, hidden_size=128, num_layers=2,
                             num_heads=4, batch_size=32, train_steps=400, checkpoints=(100, 200, 300), lr=2e-3,
                             warmup_steps=40),
    # privacy audits (experiments.audit): the smoke preset's data and model with 1,280 reserved tokens (new-token
    # canaries' ids): 0.33M parameters, trains in seconds on 2 cores; the base of the audit's fine-tunes, and with
    # canaries=2000, canary_reps=(1, 4) its pretraining audit (copies outnumber the 1,600 natural rows)
    "audit": TestbedConfig(preset="audit", max_corpus_bytes=800_000, vocab_size=512, reserved_tokens=1280, seq_len=64,
                           hidden_size=64, num_layers=2, num_heads=4, batch_size=16, train_steps=100, checkpoints=(50,),
                           lr=3e-3, warmup_steps=10),
    # for an accelerator: 27.3M parameters (at the full 8192-token vocabulary; config.n_params()); give a larger
    # corpus (--corpus) for more than one epoch's worth of steps
    "large": TestbedConfig(preset="large", vocab_size=8192, seq_len=256, hidden_size=512, num_layers=6, num_heads=8,
                           batch_size=32, train_steps=200, checkpoints=(50, 100, 150), lr=1e-3, warmup_steps=20),
}


def preset(name: str, **overrides) -> TestbedConfig:
    if name not in PRESETS:
        raise TestbedError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    base = PRESETS[name]
    if "train_steps" in overrides and "checkpoints" not in overrides:  # keep the preset's checkpoints that still fit
        overrides["checkpoints"] = tuple(s for s in base.checkpoints if s <= int(overrides["train_steps"]))
    return base.replace(**overrides) if overrides else base
