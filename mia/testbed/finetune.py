"""Fine-tuning a trained testbed (the base) on a private set that holds canaries: full-parameter or LoRA, ordinary or
DP-SGD, with exact membership and the accountant's epsilon of what the trainer did.

``build_finetune(base, out_dir, config)`` starts from the base's last checkpoint and trains ``steps`` steps on the
**private set**:

- ``n_private`` natural rows: the first rows of the base's order that the base never trained (rows
  [base records, base records + n_private)); the rows after them are the natural non-members;
- the **canary pool** (``canary_groups``: (kind, reps, count) triples, kinds of ``mia.testbed.canaries``): each
  canary is included with probability 1/2 (seeded) and then is ``reps`` records of the private set. Canaries are
  ``canary_len`` tokens long and train on their **secret** only (the whole row, or a new-token canary's reserved
  token: as in supervised fine-tuning, where the prompt is not trained on); natural rows train on every token.

Each step draws its batch by **Poisson sampling**: every record joins independently with probability
``sample_rate`` (seeded per step). Then, ordinary: the sum of the records' gradients; DP-SGD: the sum of their
gradients each clipped to L2 norm ``dp_clip`` (``jax.vmap`` of the per-example gradient, optax's
``per_example_global_norm_clip``) plus Gaussian noise of standard deviation ``dp_noise * dp_clip`` on every
trainable coordinate (``mia.testbed.dp.make_noisy_update``). The sum is divided by the expected batch size,
``sample_rate * (n_private + expected copies)``, a function of the config (never of the data), and handed to the
optimiser (SGD or Adam: post-processing).

**What is trained** (``lora_rank``): 0, every parameter (full fine-tuning); r > 0, LoRA (Hu et al. 2021): each
kernel named in ``lora_targets`` becomes W + (lora_alpha / r) A B with A [in, r] random (seeded, std 1/sqrt(in))
and B [r, out] zero, W frozen; and, when the base reserves tokens, those tokens' input and output embedding rows
(as one trains a new token's embeddings when adding it to a vocabulary). The trainable leaves are picked by a mask
over one tree (``trainable_mask``): gradients, clipping and noise see only them.

**Accounting** (``finetune_epsilon``; neighbouring datasets differ by adding or removing one record):
``steps``-fold composition of the Poisson-subsampled Gaussian mechanism (sample_rate, dp_noise), by
``dp_accounting``'s PLD accountant (RDP beside it); with sample_rate 1 (every record in every step: full-batch
DP-GD) the subsampling is the identity and the run is ``steps`` Gaussian mechanisms. A canary of r records is a
group of r (group privacy). delta defaults to 1e-5 (``DEFAULT_DELTA``); a private run refuses a delta above
1 / ``max_records`` (natural rows and every canary copy: ``check_delta``).

Layout of ``out_dir``: ``model/`` (the fine-tuned model, LoRA merged into its kernels: an ordinary checkpoint every
attack loads) and ``lora.safetensors`` (the adapters): the release; ``finetune.json`` (config and hash, the base's
checkpoint sha256, the private set's rows in the base's order, the canaries' sha256, the privacy record) and
``data/canaries.json`` (the pool and its inclusion: the auditor's key); and ``private/`` (``PRIVATE_DIR``): what the
run measured on the private set without noise, ``train_log.jsonl`` (each step's loss, fraction clipped, records and
copies drawn) and ``private.json`` (the first and final loss, the copies and records, the canaries included, the
training time). Nothing outside ``private/`` holds an un-noised statistic of the private set; the audit reads
nothing inside it. A complete directory with the same config and base is reused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..files.atomic import write_text
from .canaries import (CANARY_FILE, Canaries, canary_source, check_distinct, draw_pool, kind_params, read_canaries,
                       write_canaries)
from .config import CANARY_KINDS, TestbedError
from ..privacy.one_run import group_privacy
from ..data.corpus import load_corpus
from ..files.hashing import sha256_of_file
from ..models import from_config, save
from ..models import load
from ..models.hub import write_safetensors
from .dp import (ACCOUNTANTS, event_epsilon, make_noisy_update, noise_key, poisson_indices, smallest_noise,
                 subsampled_gaussian_event)
from .tokenizer import reserved_ids

FT_FORMAT = "mia-finetune/1"
MANIFEST = "finetune.json"
PRIVATE_DIR = "private"  # un-noised statistics of the private set: never beside the release, never read by the audit
PRIVATE_RECORD = "private.json"
DEFAULT_DELTA = 1e-5
LORA_TARGETS = ("attention_query_key_value", "attention_dense")
OPTIMIZERS = ("sgd", "adam")
_INCLUDE_STREAM, _BATCH_STREAM, _LORA_STREAM = 0xF1, 0xF7A, 0x10A


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Everything that determines a fine-tune of a given base (and so enters ``config_hash``)."""

    preset: str = "custom"
    n_private: int = 512  # natural rows of the private set
    canary_groups: tuple = (("new", 1, 1000),)  # (kind, reps, count) triples, in canary-id order
    canary_len: int = 0  # tokens per canary row; 0 = the base's row length
    steps: int = 8
    sample_rate: float = 1.0  # Poisson sampling probability of every record at every step
    optimizer: str = "sgd"
    lr: float = 1.0
    lora_rank: int = 0  # 0 = full-parameter fine-tuning
    lora_alpha: Optional[float] = None  # default: lora_rank (scale 1)
    lora_targets: tuple = LORA_TARGETS
    dp_noise: Optional[float] = None  # DP-SGD noise multiplier; None = ordinary training
    dp_clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        groups = tuple((str(k), int(r), int(n)) for k, r, n in self.canary_groups)
        object.__setattr__(self, "canary_groups", groups)
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        problems = []
        for k, r, n in groups:
            if k not in CANARY_KINDS or r < 1 or n < 0:
                problems.append(f"canary group ({k}, {r}, {n}): kind one of {', '.join(CANARY_KINDS)}, reps >= 1, "
                                "count >= 0")
        for name, lo in (("n_private", 1), ("steps", 1), ("canary_len", 0), ("lora_rank", 0), ("seed", 0)):
            if int(getattr(self, name)) < lo:
                problems.append(f"{name} must be >= {lo}, got {getattr(self, name)}")
        if not 0 < self.sample_rate <= 1:
            problems.append(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not self.lr > 0 or not self.dp_clip > 0:
            problems.append("lr and dp_clip must be positive")
        if self.dp_noise is not None and not self.dp_noise >= 0:
            problems.append(f"dp_noise must be >= 0, got {self.dp_noise}")
        if problems:
            raise TestbedError("fine-tune config: " + "; ".join(problems))

    @property
    def private(self) -> bool:
        return self.dp_noise is not None

    @property
    def lora_scale(self) -> float:
        return (self.lora_alpha if self.lora_alpha is not None else self.lora_rank) / max(self.lora_rank, 1)

    @property
    def kind_spec(self) -> str:
        """The pool's kinds, comma-separated, in order of first appearance."""
        return ",".join(dict.fromkeys(k for k, _, n in self.canary_groups if n))

    @property
    def m(self) -> int:
        return sum(n for _, _, n in self.canary_groups)

    @property
    def expected_records(self) -> float:
        """n_private plus the expected number of canary copies (half the reps): the divisor's base."""
        return self.n_private + sum(r * n for _, r, n in self.canary_groups) / 2

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["canary_groups"] = [list(g) for g in self.canary_groups]
        d["lora_targets"] = list(self.lora_targets)
        return d

    @property
    def config_hash(self) -> str:
        d = self.to_dict()
        d.pop("preset")
        d["format"] = FT_FORMAT
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **kw) -> "FinetuneConfig":
        return dataclasses.replace(self, **kw)


# ----------------------------------------------------------------------------------------------- the pool
def plan_pool(cfg: FinetuneConfig) -> tuple:
    """(kinds [m], reps [m], included [m] bool) of the canary pool: groups in order, each canary included with
    probability 1/2 (numpy default_rng([seed, 0xF1])); a function of the config alone."""
    kinds = tuple(k for k, _, n in cfg.canary_groups for _ in range(n))
    reps = np.array([r for _, r, n in cfg.canary_groups for _ in range(n)], np.int64)
    included = np.random.default_rng([int(cfg.seed), _INCLUDE_STREAM]).random(len(kinds)) < 0.5
    return kinds, reps, included


def make_pool(cfg: FinetuneConfig, base, sampler=None) -> Canaries:
    """The fine-tune's canary pool in the base's tokenization, drawn from the base's corpus and order (sampled
    canaries: from ``sampler``, default the base model)."""
    kinds, reps, included = plan_pool(cfg)
    spec = cfg.kind_spec
    row_len = cfg.canary_len or base.row_len
    tok = base.tokenizer()
    texts = ()
    if "words" in kinds:

        bc = base.config
        texts = load_corpus(bc.corpus, bc.text_column, bc.max_corpus_bytes).texts
    rows = base.dataset().get_rows(np.arange(base.n_rows)) if {"unigram", "bigram"} & set(kinds) else None
    if "sampled" in kinds and sampler is None:
        sampler = base.load_model()
    source = canary_source(tok, kinds, texts=texts, rows=rows, sampler=sampler)
    tokens, secret, spare = draw_pool(kinds, spec, row_len, source, cfg.seed)
    check_distinct(tokens, spec)
    empty = tuple(np.zeros(0, np.int64) for _ in kinds)
    return Canaries(tokens=tokens, reps=reps, included=included, steps=empty, batch_size=0, kind=spec,
                    words=source.words, seed=int(cfg.seed), vocab_size=len(tok), kinds=kinds, secret_start=secret,
                    params={k: kind_params(k) for k in dict.fromkeys(kinds)}, corpus_vocab=source.corpus_vocab,
                    spare_ids=spare, copies=np.where(included, reps, 0))


# ----------------------------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class Records:
    """The private set: ``natural`` [n_private, L] rows (every token trained), ``canary_rows`` [c, Lc] (one per
    copy, secret only: ``canary_masks`` [c, Lc - 1]) and ``copy_of`` [c] (the canary id of each copy). Record i <
    n_private is natural row i; the rest are the copies in (canary id, copy) order."""

    natural: np.ndarray
    canary_rows: np.ndarray
    canary_masks: np.ndarray
    copy_of: np.ndarray

    @property
    def n(self) -> int:
        return len(self.natural) + len(self.canary_rows)


def private_rows(base, cfg: FinetuneConfig) -> tuple:
    """(start, stop): the order's rows of the private set, the first ``n_private`` rows after the base's trained
    ones; ``TestbedError`` when the order has no room for them and for non-members after them."""
    start = base.train_steps * base.batch_size
    stop = start + cfg.n_private
    if stop >= base.n_rows:
        raise TestbedError(f"the base's order has {base.n_rows} rows: {cfg.n_private} private rows after its "
                           f"{start} trained ones leave no natural non-members; lower n_private")
    return start, stop


def make_records(base, cfg: FinetuneConfig, canaries: Canaries) -> Records:
    start, stop = private_rows(base, cfg)
    natural = np.asarray(base.dataset().get_rows(np.arange(start, stop)), np.int32).reshape(cfg.n_private, -1)
    copy_of = np.repeat(np.arange(canaries.m), canaries.copies)
    return Records(natural, canaries.tokens[copy_of].astype(np.int32), canaries.secret_mask()[copy_of], copy_of)


def max_records(cfg: FinetuneConfig) -> int:
    """The most records the private set can hold: ``n_private`` plus every copy of every canary (all included); a
    function of the config alone. A delta at most 1 / this is at most 1 / records whatever the inclusion."""
    return int(cfg.n_private + sum(r * n for _, r, n in cfg.canary_groups))


def check_delta(cfg: FinetuneConfig, delta: float) -> float:
    """``delta``, refused (``TestbedError``) unless 0 < delta <= 1 / ``max_records``: a larger delta allows
    releasing a record outright with probability delta for each of the records."""
    d = float(delta)
    if not 0 < d <= 1 / max_records(cfg):
        raise TestbedError(f"delta {d:g} must be in (0, 1 / records] = (0, {1 / max_records(cfg):.3g}] "
                           f"({max_records(cfg)} records: {cfg.n_private} natural rows and every canary copy)")
    return d


def poisson_batch(cfg: FinetuneConfig, step: int, n: int) -> np.ndarray:
    """Sorted record indices sampled at ``step``: each of ``n`` records independently with probability
    ``sample_rate`` (numpy default_rng([seed, 0xF7A, step]))."""
    return poisson_indices(cfg.seed, _BATCH_STREAM, step, n, cfg.sample_rate)


# ----------------------------------------------------------------------------------------------- what is trained
def lora_init(params, cfg: FinetuneConfig) -> dict:
    """{target: {"A": [L, in, r] normal(0, 1/in) seeded, "B": [L, r, out] zeros}} for every ``lora_targets`` kernel of
    the stacked layers."""
    import jax.numpy as jnp

    rng = np.random.default_rng([int(cfg.seed), _LORA_STREAM])
    out = {}
    for name in cfg.lora_targets:
        if name not in params["layers"]:
            raise TestbedError(f"LoRA target {name!r} is not a layer of the model ({', '.join(params['layers'])})")
        L, i, o = params["layers"][name]["kernel"].shape
        out[name] = {"A": jnp.asarray(rng.standard_normal((L, i, cfg.lora_rank)) / math.sqrt(i), jnp.float32),
                     "B": jnp.zeros((L, cfg.lora_rank, o), jnp.float32)}
    return out


def start_tree(params, cfg: FinetuneConfig, first_reserved: Optional[int]) -> dict:
    """The tree the fine-tune works on: {"base": the base's params} and, for LoRA, {"lora": adapters} and (with
    reserved tokens) {"new_in": [R, D], "new_out": [D, R]} (the reserved tokens' embedding rows)."""
    tree = {"base": params}
    if cfg.lora_rank:
        tree["lora"] = lora_init(params, cfg)
        if first_reserved is not None:
            tree["new_in"] = params["embed_in"]["embedding"][first_reserved:]
            tree["new_out"] = params["embed_out"]["kernel"][:, first_reserved:]
    return tree


def trainable_mask(tree: dict, cfg: FinetuneConfig) -> dict:
    """{top-level key: bool} over ``start_tree``: full fine-tuning trains "base"; LoRA trains everything else."""
    return {k: (k == "base") == (not cfg.lora_rank) for k in tree}


def split(tree: dict, mask: dict) -> tuple:
    """(trainable subtree, frozen subtree) of ``tree`` by ``mask``."""
    return {k: v for k, v in tree.items() if mask[k]}, {k: v for k, v in tree.items() if not mask[k]}


def merged_params(tree: dict, cfg: FinetuneConfig, first_reserved: Optional[int]):
    """The model's params: the base's, with W + scale A B for each LoRA target and the reserved tokens' rows
    replaced by the trained ones."""
    import jax.numpy as jnp

    if "lora" not in tree:
        return tree["base"]
    p = dict(tree["base"])
    layers = dict(p["layers"])
    for name, ab in tree["lora"].items():
        layers[name] = {**layers[name], "kernel": layers[name]["kernel"]
                        + cfg.lora_scale * jnp.einsum("lir,lro->lio", ab["A"], ab["B"])}
    p["layers"] = layers
    if "new_in" in tree:
        p["embed_in"] = {"embedding": jnp.concatenate([p["embed_in"]["embedding"][:first_reserved], tree["new_in"]])}
        p["embed_out"] = {**p["embed_out"], "kernel": jnp.concatenate(
            [p["embed_out"]["kernel"][:, :first_reserved], tree["new_out"]], axis=1)}
    return p


# ----------------------------------------------------------------------------------------------- accounting
def finetune_epsilon(cfg: FinetuneConfig, *, delta: float = DEFAULT_DELTA, accountant: str = "pld",
                     group: int = 1) -> tuple:
    """(epsilon, delta) of one record (``group`` = 1) or of a canary of ``group`` records after the whole run: the
    ``steps``-fold composition of the Poisson-subsampled Gaussian (sample_rate, dp_noise), by ``dp_accounting``;
    groups by group privacy, (k eps, k e^((k-1) eps) delta). inf for an ordinary run or dp_noise 0."""
    if accountant not in ACCOUNTANTS:
        raise TestbedError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    if not cfg.private or cfg.dp_noise == 0:
        return math.inf, float(delta)
    eps = event_epsilon(subsampled_gaussian_event(cfg.dp_noise, cfg.sample_rate, cfg.steps), delta, accountant)
    return group_privacy(eps, delta, group) if group > 1 else (eps, float(delta))


def noise_for_epsilon(cfg: FinetuneConfig, epsilon: float, *, delta: float = DEFAULT_DELTA, tol: float = 1e-3
                      ) -> float:
    """The smallest noise multiplier (to ``tol``, relative) whose accountant epsilon is at most ``epsilon``."""
    if not epsilon > 0:
        raise TestbedError(f"target epsilon must be positive, got {epsilon!r}")

    return smallest_noise(lambda sigma: finetune_epsilon(cfg.replace(dp_noise=sigma), delta=delta)[0], epsilon, tol)


def privacy_record(cfg: FinetuneConfig, delta: float = DEFAULT_DELTA) -> dict:
    rec = {"mechanism": "DP-SGD (per-example clipping, Gaussian noise)" if cfg.private else "none",
           "noise_multiplier": cfg.dp_noise, "clip": cfg.dp_clip if cfg.private else None,
           "sampling": "poisson", "sample_rate": cfg.sample_rate, "steps": cfg.steps, "delta": delta,
           "neighbouring": "add or remove one record (row)",
           "divisor": cfg.sample_rate * cfg.expected_records}
    for acc in ACCOUNTANTS:
        eps = finetune_epsilon(cfg, delta=delta, accountant=acc)[0]
        rec[f"epsilon_{acc}"] = eps if math.isfinite(eps) else "inf"
    return rec


# ----------------------------------------------------------------------------------------------- training
def _example_loss(model, cfg, first_reserved):
    import jax
    import jax.numpy as jnp

    def loss(trainable, frozen, row, mask):
        p = merged_params({**frozen, **trainable}, cfg, first_reserved)
        logp = jax.nn.log_softmax(model.logits(p, row[None, :-1]).astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, row[None, 1:, None], axis=-1)[0, :, 0]
        return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


def make_gradient_sum(model, cfg: FinetuneConfig, first_reserved):
    """jit((trainable, frozen, rows [P, L], masks [P, L-1], weights [P]) -> (sum of the weighted per-example
    gradients, each clipped to dp_clip when private; number clipped; sum of the losses)). Weight 0 = padding."""
    import jax
    import jax.numpy as jnp
    import optax

    loss = _example_loss(model, cfg, first_reserved)

    def private_sum(trainable, frozen, rows, masks, weights):
        losses, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, None, 0, 0))(trainable, frozen, rows, masks)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves = [g * weights.reshape((-1,) + (1,) * (g.ndim - 1)) for g in leaves]
        summed, n_clipped = optax.transforms.per_example_global_norm_clip(leaves, cfg.dp_clip)
        return jax.tree_util.tree_unflatten(treedef, summed), n_clipped, jnp.sum(losses * weights)

    def plain_sum(trainable, frozen, rows, masks, weights):
        def total(t):
            losses = jax.vmap(loss, in_axes=(None, None, 0, 0))(t, frozen, rows, masks)
            return jnp.sum(losses * weights)

        value, grads = jax.value_and_grad(total)(trainable)
        return grads, jnp.zeros((), jnp.int32), value

    return jax.jit(private_sum if cfg.private else plain_sum)


def make_optimizer(cfg: FinetuneConfig):
    import optax

    return optax.sgd(cfg.lr) if cfg.optimizer == "sgd" else optax.adam(cfg.lr)


def chunk_size(n_trainable: int, expected_rows: float, private: bool) -> int:
    """Rows per gradient chunk of one part of a batch (natural rows or canary copies) whose expected size is
    ``expected_rows``: the expected size plus four standard deviations, rounded up to 16, so a Poisson batch nearly
    always takes one chunk; at most 256 rows, and for per-example gradients (``private``) at most about 64M
    gradient floats at a time."""
    want = expected_rows + 4 * math.sqrt(max(expected_rows, 1.0))
    cap = int(max(8, min(256, 2 ** 26 // max(n_trainable, 1)))) if private else 256
    return int(min(cap, 16 * math.ceil(want / 16)))


def _padded(rows: np.ndarray, masks: np.ndarray, size: int) -> tuple:
    w = np.zeros(size, np.float32)
    w[:len(rows)] = 1.0
    pad = size - len(rows)
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, rows.shape[1]), rows.dtype)])
        masks = np.concatenate([masks, np.zeros((pad, masks.shape[1]), masks.dtype)])
    return rows, masks, w


def train_finetune(model, cfg: FinetuneConfig, records: Records, first_reserved: Optional[int],
                   progress: bool = True) -> tuple:
    """Run the fine-tune: (final tree, log records, seconds). The tree is ``start_tree`` of the base model."""
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm.auto import tqdm


    tree = start_tree(model.params, cfg, first_reserved)
    mask = trainable_mask(tree, cfg)
    trainable, frozen = split(tree, mask)
    n_train = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(trainable))
    n_nat = len(records.natural)
    chunks = [chunk_size(n_train, cfg.sample_rate * n, cfg.private) for n in (n_nat, len(records.canary_rows))]
    grad_sum = make_gradient_sum(model, cfg, first_reserved)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(trainable)
    divisor = cfg.sample_rate * cfg.expected_records
    if cfg.private:
        update = make_noisy_update(optimizer, cfg.dp_noise, cfg.dp_clip, divisor)
    else:
        @jax.jit
        def update(params, state, summed, key):
            grads = jax.tree_util.tree_map(lambda g: g / divisor, summed)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, optax.global_norm(grads)
    nat_mask = np.ones((1, records.natural.shape[1] - 1), np.float32)
    log = []
    t0 = time.perf_counter()
    for s in tqdm(range(cfg.steps), desc="fine-tuning", unit="step", disable=not progress, leave=False):
        idx = poisson_batch(cfg, s, records.n)
        nat, cop = idx[idx < n_nat], idx[idx >= n_nat] - n_nat
        total, n_clipped, loss_sum = None, 0, 0.0
        parts = [(records.natural[nat], np.repeat(nat_mask, len(nat), axis=0)),
                 (records.canary_rows[cop], records.canary_masks[cop])]
        for (rows, masks), chunk in zip(parts, chunks):
            for lo in range(0, len(rows), chunk):
                r, mk, w = _padded(rows[lo:lo + chunk], masks[lo:lo + chunk], chunk)
                g, c, lsum = grad_sum(trainable, frozen, jnp.asarray(r), jnp.asarray(mk), jnp.asarray(w))
                total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
                n_clipped += int(c)
                loss_sum += float(lsum)
        if total is None:  # an empty batch: the noise alone (or nothing)
            total = jax.tree_util.tree_map(jnp.zeros_like, trainable)
        trainable, opt_state, norm = update(trainable, opt_state, total, noise_key(cfg.seed, s))
        log.append({"step": s + 1, "rows": int(len(idx)), "natural": int(len(nat)), "copies": int(len(cop)),
                    "loss": loss_sum / max(len(idx), 1), "grad_norm": float(norm),
                    "clipped": n_clipped / max(len(idx), 1) if cfg.private else None,
                    "elapsed_s": round(time.perf_counter() - t0, 3)})
        if not np.isfinite(log[-1]["loss"]):
            raise TestbedError(f"fine-tuning diverged at step {s + 1} (loss {log[-1]['loss']}); lower lr")
    return {**frozen, **trainable}, log, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------- the directory
@dataclasses.dataclass
class Finetune:
    """A built fine-tune: ``root``, ``config``, ``manifest`` and its ``base`` testbed."""

    root: Path
    config: FinetuneConfig
    manifest: dict
    base: object

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def load_model(self):

        return load(self.model_dir)

    def canaries(self) -> Canaries:
        path = self.root / CANARY_FILE

        if sha256_of_file(path) != self.manifest["canaries"]["sha256"]:
            raise TestbedError(f"{path}: changed since the fine-tune was built (sha256 differs from {MANIFEST})")
        return read_canaries(path)

    def canary_membership(self) -> np.ndarray:
        """[m] bool: canaries in the private set (included); Poisson sampling may draw any record at any step."""
        return self.canaries().included.copy()

    def natural_rows(self) -> tuple:
        """(start, stop) of the private set's natural rows in the base's order: members; the rows from ``stop`` on
        are non-members (the base never trained them either)."""
        return tuple(self.manifest["private_set"]["rows"])

    @property
    def private_dir(self) -> Path:
        """``private/``: the run's un-noised statistics of the private set (the training log and ``private.json``);
        for whoever trained the model, never for the audit."""
        return self.root / PRIVATE_DIR

    def private_record(self) -> dict:
        """``private/private.json`` (losses, copies, records, canaries included, training time)."""
        return json.loads((self.private_dir / PRIVATE_RECORD).read_text())

    def dp_epsilon(self, *, delta: float = DEFAULT_DELTA, accountant: str = "pld", group: int = 1) -> float:
        return finetune_epsilon(self.config, delta=delta, accountant=accountant, group=group)[0]

    @property
    def private(self) -> bool:
        return self.config.private


def base_record(base) -> dict:
    return {"root": str(base.root), "config_hash": base.config.config_hash, "step": base.train_steps,
            "sha256": base.checkpoint_hash()}


def build_finetune(base, out_dir, cfg: FinetuneConfig, *, progress: bool = True, delta: float = DEFAULT_DELTA,
                   canaries_from=None) -> Finetune:
    """Fine-tune ``base`` (a complete :class:`~mia.testbed.Testbed`) by ``cfg`` into ``out_dir``, or reuse the
    complete fine-tune of the same config and base there. ``canaries_from``: another fine-tune of the same base
    whose pool (same groups, seed and canary length) this one shares, so that runs differ only by how they
    train (its canary file is checked against the pool ``cfg`` draws' plan)."""

    root = Path(out_dir)
    mf = root / MANIFEST
    brec = base_record(base)
    if cfg.private:
        check_delta(cfg, delta)
    if mf.exists():
        m = json.loads(mf.read_text())
        if m.get("complete") and m.get("config_hash") == cfg.config_hash and m.get("base", {}).get("sha256") == \
                brec["sha256"] and (root / "model" / "model.safetensors").exists() and "private" in m:
            return Finetune(root, cfg, m, base)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = base.tokenizer()
    reserved = reserved_ids(tok)
    first_reserved = reserved.start if len(reserved) else None
    if "new" in cfg.kind_spec.split(",") and first_reserved is None:
        raise TestbedError(f"{base.root}: new-token canaries need a base with reserved tokens (reserved_tokens)")
    if canaries_from is not None:
        pool = canaries_from.canaries()
        kinds, reps, included = plan_pool(cfg)
        if (tuple(pool.kind_of) != kinds or not np.array_equal(pool.reps, reps)
                or not np.array_equal(pool.included, included)
                or pool.row_len != (cfg.canary_len or base.row_len)):
            raise TestbedError(f"{canaries_from.root}: its canary pool is not the one this config plans")
    else:
        pool = make_pool(cfg, base)
    t_pool = time.perf_counter() - t0
    write_canaries(root / CANARY_FILE, pool)
    records = make_records(base, cfg, pool)
    base_model = base.load_model()
    tree, log, train_s = train_finetune(base_model, cfg, records, first_reserved, progress)
    params = merged_params(tree, cfg, first_reserved)
    model = from_config(base_model.config, params=params, tokenizer=tok)
    save(model, root / "model")
    if "lora" in tree:
        flat = {f"{k}.{ab}": np.asarray(v[ab]) for k, v in tree["lora"].items() for ab in ("A", "B")}
        write_safetensors(flat, root / "lora.safetensors", metadata={"scale": str(cfg.lora_scale)})
    (root / PRIVATE_DIR).mkdir(exist_ok=True)
    write_text(root / PRIVATE_DIR / "train_log.jsonl", "".join(json.dumps(r) + "\n" for r in log))
    write_text(root / PRIVATE_DIR / PRIVATE_RECORD, json.dumps(
        {"what": "un-noised statistics of the private set: not for release, not read by the audit",
         "first_loss": log[0]["loss"], "final_loss": log[-1]["loss"], "n_copies": int(pool.n_copies),
         "records": int(records.n), "n_included": int(pool.included.sum()), "log": "train_log.jsonl",
         "train_s": round(train_s, 2)}, indent=1))
    for stale in ("train_log.jsonl",):  # a directory written before private/ existed
        (root / stale).unlink(missing_ok=True)
    start, stop = private_rows(base, cfg)
    m = {"format": FT_FORMAT, "preset": cfg.preset, "config": cfg.to_dict(), "config_hash": cfg.config_hash,
         "complete": True, "base": brec,
         "private_set": {"rows": [start, stop], "n_natural": cfg.n_private, "non_members": [stop, base.n_rows],
                         "max_records": max_records(cfg)},
         "canaries": {"path": CANARY_FILE, "sha256": sha256_of_file(root / CANARY_FILE), "m": pool.m,
                      "kind": pool.kind, "groups": [list(g) for g in cfg.canary_groups], "row_len": pool.row_len,
                      "inclusion": "independent, probability 1/2 (numpy default_rng([seed, 0xF1]))"},
         "privacy": privacy_record(cfg, delta),
         "trained": "LoRA" if cfg.lora_rank else "all parameters",
         "model": {"path": "model", "sha256": sha256_of_file(root / "model" / "model.safetensors")},
         "private": {"path": PRIVATE_DIR, "what": "the training log and un-noised statistics of the private set"},
         "timings": {"pool_s": round(t_pool, 2)}}
    write_text(mf, json.dumps(m, indent=1))
    return Finetune(root, cfg, m, base)
