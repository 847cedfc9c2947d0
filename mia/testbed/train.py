"""Training of the testbed model: AdamW with warmup + cosine, rows in order, jit-compiled step, exact resume.

Step ``s`` (0-based) trains on rows ``[s*B, (s+1)*B)`` of the order file: input ``row[:-1]``, labels ``row[1:]``,
mean cross-entropy over every position. Checkpoint ``step{N}`` is the model after N steps (step0 = init), so it
has seen rows ``[0, N*B)``. The training state (params + optimizer state) is stored as safetensors next to each
checkpoint and in ``resume/``; resuming from it replays exactly the same computation, so an interrupted run ends
with the same parameters as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..files.atomic import atomic_write, save_figure, temporary_sibling
from ..models.hub import read_safetensors, save, write_safetensors
from ..sharding import loop_compiler_options
from . import dp
from .config import TestbedConfig, TestbedError
from .dp import poisson_batch

STATE_FILE = "train_state.safetensors"
# 2: decoder layers stacked ([L, ...] leaves under one "layers" subtree): tensor names changed, so a state file
# of format 1 is never read (load refuses it, and the testbed FORMAT bump makes a build start afresh).
STATE_FORMAT = "mia-train-state/2"


# --------------------------------------------------------------------------------------------- optimisation
def lr_schedule(cfg: TestbedConfig) -> Callable:
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps <= 0:
        return optax.cosine_decay_schedule(cfg.lr, max(cfg.train_steps, 1), alpha=cfg.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(cfg.train_steps, cfg.warmup_steps + 1),
                                              end_value=end)


DECAYED_LEAVES = ("kernel", "embedding")  # flax Dense / Embed matrices


def _decay_mask(params):
    """Weight decay on matrices (Dense kernels, embeddings) only, not on biases and norm scales.

    Decided by leaf name, not ndim: stacked layer leaves carry a leading [L] axis, so a norm scale is [L, D].
    """
    def is_matrix(path, _):
        last = path[-1]
        return getattr(last, "key", getattr(last, "name", None)) in DECAYED_LEAVES

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: TestbedConfig, learning_rate=None, weight_decay: Optional[float] = None):
    lr = lr_schedule(cfg) if learning_rate is None else learning_rate
    wd = cfg.weight_decay if weight_decay is None else weight_decay
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=wd, mask=_decay_mask))


def row_loss(model, params, rows_bt: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of rows [B, T+1]: inputs row[:-1], labels row[1:]."""
    logits = model.logits(params, rows_bt[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, rows_bt[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)


def row_losses(model, params, rows_bt: jax.Array) -> jax.Array:
    """[B] mean next-token cross-entropy (float32) of each row [B, T+1]."""
    logits = model.logits(params, rows_bt[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, rows_bt[:, 1:, None], axis=-1)[..., 0], axis=-1)


# steps x batch x seq_len x hidden_size^2 (about a run's FLOPs) at or under which a CPU training run compiles at
# level 0 (see compiler_options)
SMALL_RUN_WORK = 1 << 26


def compiler_options(cfg: TestbedConfig, steps: int) -> dict:
    """XLA options of a training run of ``steps`` steps. On CPU the backend optimisation level is pinned, whatever
    ``XLA_FLAGS`` say, so that a run always compiles the same program: level 0 when the run is small (``steps x
    batch_size x seq_len x hidden_size^2 <= SMALL_RUN_WORK``: the tests' tiny testbeds and the smoke suite's
    16-wide member), where compile time dominates; otherwise XLA's default level 3, whose step runs 1.4-3x faster
    (``python -m experiments.bench_train_step``: the smoke suite's 64- and 96-wide members take 27-33 and 44-50 ms
    a step at level 3, 79-93 and 113-126 ms at level 0, for about 1 s more compile time, so level 3 pays after
    about 20 steps of the 64-wide model and about 200 of the 16-wide one: the same work). Other platforms keep XLA's
    defaults."""
    if jax.default_backend() != "cpu":
        return {}
    work = int(steps) * cfg.batch_size * cfg.seq_len * cfg.hidden_size ** 2
    return {"xla_backend_optimization_level": 0} if work <= SMALL_RUN_WORK else loop_compiler_options()


def make_train_step(model, optimizer, options: Optional[dict] = None):
    """jit((params, opt_state, rows [B, T+1] int32) -> (params, opt_state, {"loss", "grad_norm"})); ``options``:
    XLA compiler options (:func:`compiler_options`)."""

    def step(params, opt_state, rows):
        loss, grads = jax.value_and_grad(lambda p: row_loss(model, p, rows))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return jax.jit(step, compiler_options=options or None)


def make_masked_train_step(model, optimizer, options: Optional[dict] = None):
    """jit((params, opt_state, rows [P, T+1] int32, mask [P] float32) -> (params, opt_state, metrics)): the mean loss
    over the rows with mask 1 (a batch of natural rows and canary copies, padded to a fixed P rows)."""

    def step(params, opt_state, rows, mask):
        def loss_fn(p):
            return jnp.sum(row_losses(model, p, rows) * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    return jax.jit(step, compiler_options=options or None)


# --------------------------------------------------------------------------------------------- batches
class BatchRows:
    """The rows each step trains on. Ordinary training and DP with fixed batches: natural rows
    [s*B, (s+1)*B) of the order, then the canary copies recorded for step s (ascending canary id). DP with Poisson
    sampling: the records sampled at step s (``mia.testbed.dp.poisson_batch``), natural rows then canary copies."""

    def __init__(self, cfg: TestbedConfig, dataset, canaries=None):
        self.cfg, self.dataset, self.canaries = cfg, dataset, canaries
        self.by_step = canaries.copies_by_step(cfg.train_steps) if canaries is not None else None
        self.poisson = cfg.private and cfg.dp_sampling == "poisson"
        if self.poisson:
            self.n_natural = cfg.train_steps * cfg.batch_size
            self.copy_ids = (np.array([i for i, st in enumerate(canaries.steps) for _ in st], np.int64)
                             if canaries is not None else np.zeros(0, np.int64))

    @property
    def slots(self) -> int:
        """Most canary copies in one step's batch (0 without canaries)."""
        return self.canaries.slots if self.canaries is not None else 0

    def __call__(self, s: int) -> np.ndarray:
        B = self.cfg.batch_size
        if self.poisson:

            idx = poisson_batch(self.cfg, s, self.n_natural + len(self.copy_ids))
            nat, cop = idx[idx < self.n_natural], idx[idx >= self.n_natural] - self.n_natural
            parts = [np.asarray(self.dataset.get_rows(nat), np.int32).reshape(len(nat), -1)] if len(nat) else []
            if len(cop):
                parts.append(self.canaries.tokens[self.copy_ids[cop]].astype(np.int32))
            return np.concatenate(parts) if parts else np.zeros((0, self.cfg.row_len), np.int32)
        rows = np.asarray(self.dataset[s * B:(s + 1) * B], dtype=np.int32)
        if self.by_step is not None and len(self.by_step[s]):
            rows = np.concatenate([rows, self.canaries.tokens[self.by_step[s]].astype(np.int32)])
        return rows


def _padded(rows: np.ndarray, n: int) -> tuple:
    """(rows padded with zero rows to ``n``, mask [n] float32 with 1 on the real rows)."""
    mask = np.zeros(n, np.float32)
    mask[:len(rows)] = 1.0
    if len(rows) < n:
        rows = np.concatenate([rows, np.zeros((n - len(rows), rows.shape[1]), rows.dtype)])
    return rows, mask


def make_step_runner(model, cfg: TestbedConfig, optimizer, batches: BatchRows) -> Callable:
    """(params, opt_state, s) -> (params, opt_state, metrics) for step s: ordinary training on the order's rows
    (exactly the step of a testbed without canaries), the masked step when canary copies extend the batches, or a
    DP-SGD step (``mia.testbed.dp``). Metrics: loss, grad_norm, and rows (plus clipped) where batches vary."""
    options = compiler_options(cfg, cfg.train_steps)
    if cfg.private:

        clipped_sum = dp.make_clipped_sum(model, cfg.dp_clip, options)
        update = dp.make_noisy_update(optimizer, cfg.dp_noise, cfg.dp_clip, cfg.batch_size)
        chunk = dp.chunk_rows(cfg, batches.slots)

        def run_dp(params, opt_state, s):
            return dp.dp_step(params, opt_state, batches(s), s, clipped_sum=clipped_sum, update=update, chunk=chunk,
                              seed=cfg.seed)

        return run_dp
    if batches.canaries is not None:
        step_fn = make_masked_train_step(model, optimizer, options)
        width = cfg.batch_size + batches.slots

        def run_masked(params, opt_state, s):
            rows = batches(s)
            params, opt_state, m = step_fn(params, opt_state, *_padded(rows, width))
            return params, opt_state, {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                                       "rows": int(len(rows))}

        return run_masked
    step_fn = make_train_step(model, optimizer, options)

    def run(params, opt_state, s):
        params, opt_state, m = step_fn(params, opt_state, batches(s))
        return params, opt_state, {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}

    return run


# --------------------------------------------------------------------------------------------- state I/O (no pickle)
def _flat(tree, prefix: str) -> dict:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in leaves}


def _unflat(tensors: dict, template, prefix: str, source: str):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        name = prefix + jax.tree_util.keystr(path)
        if name not in tensors:
            raise TestbedError(f"{source}: training state lacks {name!r} (written by another version or config)")
        arr = np.asarray(tensors[name])
        if arr.size == np.size(leaf):  # scalars come back as [1] (the writer stores contiguous >= 1-d arrays)
            arr = arr.reshape(np.shape(leaf))
        if arr.shape != tuple(np.shape(leaf)) or arr.dtype != np.asarray(leaf).dtype:
            raise TestbedError(f"{source}: {name!r} is {arr.dtype}{list(arr.shape)}, "
                               f"expected {np.asarray(leaf).dtype}{list(np.shape(leaf))}")
        out.append(jnp.asarray(arr))
    return jax.tree_util.tree_unflatten(treedef, out)


def save_train_state(path, params, opt_state, step: int, config_hash: str) -> Path:
    tensors = _flat(params, "params") | _flat(opt_state, "opt")
    write_safetensors(tensors, Path(path), metadata={"format": STATE_FORMAT, "step": str(int(step)),
                                                     "config_hash": config_hash})
    return Path(path)


def read_state_meta(path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)).get("__metadata__", {})


def load_train_state(path, params_like, opt_like, config_hash: str):
    """(params, opt_state, step) from a state file written by ``save_train_state`` for the same config."""
    meta = read_state_meta(path)
    if meta.get("format") != STATE_FORMAT:
        raise TestbedError(f"{path}: training state of format {meta.get('format')!r}, this mia reads {STATE_FORMAT!r} "
                           "(layers are stacked now); rebuild the testbed in a new directory")
    if meta.get("config_hash") != config_hash:
        raise TestbedError(f"{path}: training state of another config ({meta.get('config_hash')} != {config_hash})")
    tensors = {k: np.array(v) for k, v in read_safetensors(Path(path)).items()}
    params = _unflat(tensors, params_like, "params", str(path))
    opt_state = _unflat(tensors, opt_like, "opt", str(path))
    return params, opt_state, int(meta["step"])


# --------------------------------------------------------------------------------------------- checkpoints
def checkpoint_dir(root, step) -> Path:
    return Path(root) / "checkpoints" / f"step{step}"


def saved_steps(root) -> list:
    """Steps of complete checkpoints (directories are renamed into place only when complete)."""
    base = Path(root) / "checkpoints"
    if not base.is_dir():
        return []
    out = []
    for p in base.iterdir():
        if p.is_dir() and p.name.startswith("step") and p.name[4:].isdigit():
            out.append(int(p.name[4:]))
    return sorted(out)


def save_checkpoint(model, params, opt_state, step: int, root, config_hash: str) -> Path:
    """checkpoints/step{N}/: HF directory (config.json, model.safetensors, tokenizer) + train_state.safetensors."""
    final = checkpoint_dir(root, step)
    tmp = temporary_sibling(final)
    save(dataclasses.replace(model, params=params), tmp)
    save_train_state(tmp / STATE_FILE, params, opt_state, step, config_hash)
    if final.exists() and not _same_state(final / STATE_FILE, step, config_hash):
        shutil.rmtree(final)  # a stale or partial directory of another run
    place_dir(tmp, final)
    return final


def _same_state(path: Path, step: int, config_hash: str) -> bool:
    """Whether ``path`` is a training state of step ``step`` of the run of ``config_hash``."""
    try:
        meta = read_state_meta(path)
    except (OSError, ValueError, KeyError):
        return False
    return meta.get("format") == STATE_FORMAT and meta.get("config_hash") == config_hash and \
        str(meta.get("step")) == str(step)


def place_dir(tmp: Path, final: Path) -> None:
    """Rename the finished directory ``tmp`` to ``final``; when ``final`` is already there (another process, e.g. a
    second reader of the same testbed re-creating the same checkpoint, placed it first), keep that one and remove
    ``tmp``. Both hold the same result: training is deterministic, so the one already in place is never swapped
    under a reader."""
    try:
        os.replace(tmp, final)  # atomic: final is absent (or an empty directory)
    except OSError:
        if not final.is_dir() or not any(final.iterdir()):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def latest_state(root, config_hash: str, upto: int) -> Optional[tuple]:
    """(step, path) of the most advanced training state at or before ``upto`` (checkpoints and resume/)."""
    cands = []
    for s in saved_steps(root):
        p = checkpoint_dir(root, s) / STATE_FILE
        if s <= upto and p.exists():
            cands.append((s, p))
    r = Path(root) / "resume" / STATE_FILE
    if r.exists():
        try:
            meta = read_state_meta(r)
            if (
                meta.get("format") == STATE_FORMAT
                and meta.get("config_hash") == config_hash
                and int(meta["step"]) <= upto
            ):
                cands.append((int(meta["step"]), r))
        except (OSError, ValueError, KeyError):
            pass
    return max(cands, key=lambda c: c[0]) if cands else None


# --------------------------------------------------------------------------------------------- the loop
def _read_log(path: Path, upto: int) -> list:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("step", 0) <= upto:
                out.append(rec)
    return out


def train(model, cfg: TestbedConfig, dataset, root, *, until: Optional[int] = None, save_every: int = 50,
          progress: bool = True, stop_after: Optional[int] = None, extra_saves: tuple = (), canaries=None) -> tuple:
    """Train (or resume) up to step ``until`` (default ``cfg.train_steps``), saving ``cfg.checkpoint_steps``.

    ``canaries``: the testbed's ``mia.testbed.canaries.Canaries`` (required when ``cfg.canaries``); DP-SGD when
    ``cfg.dp_noise`` is set (``mia.testbed.dp``). ``stop_after``: stop once this step is done (simulates an
    interruption; used by tests). Returns (params, opt_state, step reached).
    """
    from tqdm.auto import tqdm

    root = Path(root)
    until = cfg.train_steps if until is None else int(until)
    B = cfg.batch_size
    if until * B > len(dataset):
        raise TestbedError(f"corpus too small: {len(dataset)} rows made, {until} steps x batch {B} need {until * B}")
    if bool(cfg.canaries) != (canaries is not None):
        raise TestbedError(f"config asks for {cfg.canaries} canaries but the trainer was given "
                           f"{'none' if canaries is None else canaries.m}")
    optimizer = make_optimizer(cfg)
    params = model.params
    opt_state = optimizer.init(params)
    start = 0
    found = latest_state(root, cfg.config_hash, until)
    if found is not None:
        params, opt_state, start = load_train_state(found[1], params, opt_state, cfg.config_hash)
    save_at = set(cfg.checkpoint_steps) | {int(s) for s in extra_saves}
    if 0 in save_at and 0 not in saved_steps(root) and start == 0:
        save_checkpoint(model, params, opt_state, 0, root, cfg.config_hash)
    log_path = root / "train_log.jsonl"
    logged = _read_log(log_path, 1 << 62)
    # re-creating an intermediate checkpoint of a finished run must not rewrite the run's log
    write_log = not logged or until >= logged[-1]["step"]
    if write_log:
        log = [r for r in logged if r["step"] <= start]
        with atomic_write(log_path) as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    if start >= until:
        return params, opt_state, start

    run_step = make_step_runner(model, cfg, optimizer, BatchRows(cfg, dataset, canaries))
    lrs = np.asarray(lr_schedule(cfg)(np.arange(until)), np.float64)  # for the log: one call, not one per step
    t0 = time.perf_counter()
    with (
        open(log_path if write_log else os.devnull, "a") as logf,
        tqdm(total=until, initial=start, desc="training", unit="step", disable=not progress, leave=False) as bar,
    ):
        for s in range(start, until):
            params, opt_state, m = run_step(params, opt_state, s)
            done = s + 1
            loss = m["loss"]
            if not np.isfinite(loss):
                raise TestbedError(f"training diverged at step {done} (loss {loss}); lower --lr")
            rec = {"step": done, "loss": loss, "lr": float(lrs[s]), "grad_norm": m["grad_norm"],
                   "tokens": done * B * cfg.seq_len, "elapsed_s": round(time.perf_counter() - t0, 3)}
            rec.update({k: m[k] for k in ("rows", "clipped") if k in m})
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if done in save_at:
                save_checkpoint(model, params, opt_state, done, root, cfg.config_hash)
            elif save_every and done % save_every == 0:
                (root / "resume").mkdir(exist_ok=True)
                save_train_state(root / "resume" / STATE_FILE, params, opt_state, done, cfg.config_hash)
            if stop_after is not None and done >= stop_after:
                return params, opt_state, done
    return params, opt_state, until


# --------------------------------------------------------------------------------------------- memorization dial
def memorize(model, params, cfg: TestbedConfig, rows: np.ndarray, epochs: int, seed: int = 0,
             progress: bool = True, lr: Optional[float] = None) -> tuple:
    """Continue training for ``epochs`` passes over ``rows`` [n, T+1] only (fresh AdamW at a constant lr).

    Each epoch visits the rows in a seeded random order in batches of ``cfg.batch_size`` (the last batch is
    topped up from the start of the epoch's order). Returns (params, log records).
    """
    from tqdm.auto import tqdm

    rows = np.asarray(rows, np.int32)
    n, B = len(rows), cfg.batch_size
    if n == 0 or epochs <= 0:
        return params, []
    lr = (cfg.memorize_lr or cfg.lr) if lr is None else lr
    optimizer = make_optimizer(cfg, learning_rate=lr, weight_decay=0.0)
    # params on one device, as the step's outputs will be: a loaded model's params are placed on the scoring
    # engine's mesh, whose sharding spec differs from that of the step's outputs, and the step was compiled a second
    # time at its second call (2-2.5 s for the smoke suite's 64-wide model)
    params = jax.device_put(jax.device_get(params), jax.devices()[0])
    opt_state = optimizer.init(params)
    per_epoch = -(-n // B)
    step_fn = make_train_step(model, optimizer, compiler_options(cfg, epochs * per_epoch))
    rng = np.random.default_rng([int(seed), 0x3E3])
    log = []
    with tqdm(total=epochs * per_epoch, desc="memorizing", unit="step", disable=not progress, leave=False) as bar:
        for ep in range(epochs):
            order = rng.permutation(n)
            order = np.concatenate([order, order[: per_epoch * B - n]])
            losses = []
            for k in range(per_epoch):
                params, opt_state, m = step_fn(params, opt_state, rows[order[k * B:(k + 1) * B]])
                losses.append(float(m["loss"]))
                bar.update(1)
            log.append({"epoch": ep + 1, "loss": float(np.mean(losses)), "lr": float(lr)})
            bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")
    return params, log


# --------------------------------------------------------------------------------------------- plot
def plot_losses(log_path, png_path, checkpoints=(), title: str = "testbed training loss") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = _read_log(Path(log_path), 1 << 62)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if recs:
        steps = np.array([r["step"] for r in recs])
        loss = np.array([r["loss"] for r in recs])
        ax.plot(steps, loss, lw=0.8, alpha=0.5, label="batch loss")
        w = max(1, len(loss) // 40)
        if w > 1:
            smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
            ax.plot(steps[w - 1:], smooth, lw=1.5, label=f"mean of {w}")
    for c in checkpoints:
        ax.axvline(c, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    png_path = Path(png_path)
    save_figure(fig, png_path, dpi=120)
    plt.close(fig)
    return png_path
