"""Build (or reuse, or resume) a testbed directory and open it as a :class:`Testbed`.

Layout of ``out_dir``::

    testbed.json               manifest: config + config_hash, corpus / tokenizer / order / checkpoint hashes, stages
    corpus.json                every corpus document's path and sha256
    tokenizer.json, tokenizer_config.json    (AutoTokenizer.from_pretrained(out_dir) loads it; id 0 = EOD)
    data/order.bin, .idx       the training order (Megatron indexed, uint16 rows of seq_len + 1 tokens)
    data/order.perm.npy        order[i] = packed row at training position i
    data/canaries.json         with canaries: every canary's tokens, reps, inclusion and (step, slot) positions
    checkpoints/step{N}/       HF directories (transformers loads them) + train_state.safetensors; step0 = init
    checkpoints/step{c}-mem{E}-{h}/   the memorization dial's checkpoints (see Testbed.memorize)
    train_log.jsonl, loss.png  per-step loss / lr / grad norm, and its plot
    resume/                    the latest training state between checkpoints

Every stage records itself in ``testbed.json`` when done, so an interrupted build resumes where it stopped;
a complete testbed with the same config hash is reused without retraining.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..files.atomic import temporary_sibling, write_json
from ..data.corpus import load_corpus
from ..data.indexed import IndexedDataset
from ..data.splits import file_record, short_repr
from ..files import hashing
from ..files.hashing import sha256_of_file
from ..validate import integer
from ..models import from_config, load, save
from ..models.gpt_neox import GPTNeoXConfig
from ..models.hub import family
from .canaries import CANARY_FILE, make_canaries, read_canaries, write_canaries
from .config import (DATA_FIELDS, FORMAT, MEMORIZE_EPOCHS_MAX, TESTBED_FIELDS, TestbedConfig, TestbedError,
                     canary_kinds, config_of_manifest, preset as get_preset, read_manifest)
from .dp import accountant_epsilon, privacy_record
from .init import init_params
from .packing import dedup_rows, pack_rows, row_permutation, write_order
from .tokenizer import EOD_ID, encode_documents, load_tokenizer, reserved_ids, save_tokenizer, train_tokenizer
from .train import checkpoint_dir, memorize as run_memorize, place_dir, plot_losses, saved_steps, train

MANIFEST = "testbed.json"
DEFAULT_ROOT = "testbeds"


def _sha_file(path) -> str:

    return sha256_of_file(path)


def model_config(cfg: TestbedConfig, vocab_size: int):
    """The GPT-NeoX config of a testbed model. Its context (``max_position_embeddings``) is the context it is trained
    at, ``seq_len`` (rows of seq_len + 1 tokens: inputs row[:-1]), as Pythia's 2048 for rows of 2049, so attacks
    that add prefixes or repetitions know where the trained positions end (``Model.max_length``)."""

    return GPTNeoXConfig(vocab_size=int(vocab_size), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn_size, rotary_pct=cfg.rotary_pct,
                         max_position_embeddings=cfg.seq_len, bos_token_id=EOD_ID, eos_token_id=EOD_ID)


def zero_reserved_rows(params, first: int):
    """``params`` with the input embedding rows and output (unembedding) columns of the reserved tokens (ids
    >= ``first``) set to zero. Equal rows get equal updates from a corpus that never uses them (the softmax pushes
    every unused token alike), so after training the reserved tokens are still interchangeable: a new-token canary's
    row differs from an unused reserved token's only by what its own training did (``mia.testbed.canaries``)."""
    params = dict(params)
    params["embed_in"] = {"embedding": params["embed_in"]["embedding"].at[first:].set(0.0)}
    params["embed_out"] = {**params["embed_out"], "kernel": params["embed_out"]["kernel"].at[:, first:].set(0.0)}
    return params


@dataclasses.dataclass
class Testbed:
    """A built testbed directory. ``load_model(step)`` gives a ``mia.models.Model`` of checkpoint ``step``."""

    root: Path
    config: TestbedConfig
    manifest: dict
    memorized: Optional[Path] = None  # the dial's checkpoint made by build_testbed(memorize_epochs=E)

    # -- data
    @property
    def data_prefix(self) -> Path:
        return self.root / "data" / "order"

    def dataset(self):

        return IndexedDataset(self.data_prefix)

    @property
    def n_rows(self) -> int:
        return int(self.manifest["data"]["n_rows"])

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def row_len(self) -> int:
        return self.config.row_len

    @property
    def epoch_steps(self) -> int:
        """Whole steps in one pass over the order: the first epoch is steps [0, epoch_steps)."""
        return self.n_rows // self.batch_size

    @property
    def train_steps(self) -> int:
        return self.config.train_steps

    # -- checkpoints
    @property
    def steps(self) -> list:

        return saved_steps(self.root)

    def checkpoint_dir(self, step: Optional[int] = None, create: bool = True) -> Path:
        """Directory of checkpoint ``step`` (default: the last). A step <= train_steps that was not saved is
        re-created by training from the nearest earlier saved state (the order is fixed, so it is exact)."""

        step = self.train_steps if step is None else int(step)
        if step < 0 or step > self.train_steps:
            raise TestbedError(f"checkpoint step {step} is beyond the run: it trained {self.train_steps} steps "
                               f"(checkpoints: {', '.join(map(str, self.steps))})")
        path = checkpoint_dir(self.root, step)
        if not path.is_dir():
            if not create:
                raise TestbedError(f"no checkpoint at step {step}; saved: {', '.join(map(str, self.steps))}")
            self._train(until=step, extra_saves=(step,), progress=True)
        return path

    # -- canaries and privacy
    def canaries(self):
        """The :class:`~mia.testbed.canaries.Canaries` pool (None without canaries), checked against its sha256."""
        if not self.config.canaries:
            return None

        path = self.root / CANARY_FILE
        rec = self.manifest.get("canaries")
        if rec is None or not path.exists():
            raise TestbedError(f"{self.root}: canaries are configured but {CANARY_FILE} is not built")
        if _sha_file(path) != rec["sha256"]:
            raise TestbedError(f"{path}: changed since the testbed was built (sha256 differs from the manifest)")
        return read_canaries(path)

    @property
    def private(self) -> bool:
        return self.config.private

    @property
    def poisson(self) -> bool:
        """True for DP-SGD with Poisson sampling, whose batches are drawn from all records at every step."""
        return self.config.private and self.config.dp_sampling == "poisson"

    def natural_membership(self, step: Optional[int] = None) -> tuple:
        """(members_end, nonmembers_start) of checkpoint ``step`` (default: the last) over the order's natural rows:
        rows [0, members_end) are members, rows from nonmembers_start on are not. Ordinary training and DP with
        fixed batches: both are step * batch_size. DP with Poisson sampling: the run's records are all of
        [0, train_steps * batch_size) from the first step on (any of them may be sampled at any step), so both are
        train_steps * batch_size for every step > 0 (and 0 at step 0)."""
        step = self.train_steps if step is None else int(step)
        end = (self.train_steps if (self.poisson and step > 0) else step) * self.batch_size
        return end, end

    def canary_membership(self, step: Optional[int] = None) -> np.ndarray:
        """[m] bool: canaries that are members of checkpoint ``step`` (default: the last): trained at least once
        before it (ordinary training, DP with fixed batches), or included at all (Poisson DP, step > 0)."""
        c = self.canaries()
        if c is None:
            raise TestbedError(f"{self.root}: this testbed has no canaries")
        step = self.train_steps if step is None else int(step)
        if self.poisson:
            return c.included & (step > 0)
        return c.seen_before(step) > 0

    def dp_epsilon(self, step: Optional[int] = None, *, delta: Optional[float] = None,
                   accountant: str = "pld") -> float:
        """Accountant epsilon of one record at checkpoint ``step`` (default: the last), at ``delta`` (default
        ``dp.default_delta``: 1 / (natural records + every canary copy)); see :mod:`mia.testbed.dp`. A testbed
        trained without DP raises."""

        step = self.train_steps if step is None else int(step)
        return accountant_epsilon(self.config, delta=delta, steps=step, accountant=accountant)

    def load_model(self, step: Optional[int] = None, dtype: str = "auto"):

        return load(self.checkpoint_dir(step), dtype=dtype)

    def tokenizer(self):

        return load_tokenizer(self.root)

    def checkpoint_hash(self, step: Optional[int] = None) -> str:
        return _sha_file(self.checkpoint_dir(step) / "model.safetensors")

    @property
    def n_params(self) -> int:
        """Parameters of the trained model (at the tokenizer's real vocabulary)."""
        return self.config.n_params(self.manifest["tokenizer"]["vocab_size"])

    def _train(self, until=None, extra_saves=(), progress=True, save_every=50, stop_after=None):
        import jax.numpy as jnp

        tok = self.tokenizer()
        mcfg = model_config(self.config, len(tok))
        params = init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32, param_dtype=jnp.float32),
                             self.config.seed)
        if self.config.reserved_tokens:
            params = zero_reserved_rows(params, reserved_ids(tok).start)
        model = from_config(mcfg, params=params, tokenizer=tok)
        return train(model, self.config, self.dataset(), self.root, until=until, save_every=save_every,
                     progress=progress, stop_after=stop_after, extra_saves=extra_saves, canaries=self.canaries())

    # -- memorization dial
    def memorize(self, rows, epochs: int, step: Optional[int] = None, seed: int = 0, progress: bool = True) -> Path:
        """Checkpoint ``step`` (default: last) trained ``epochs`` more passes over training rows ``rows`` only.

        ``rows``: row indices of the order, all < step * batch_size (rows the checkpoint has already seen, so they
        stay members; every other row stays unseen). Saved as ``checkpoints/step{c}-mem{E}-{hash}/`` with
        ``memorize.json`` (rows, epochs, seed, lr, per-epoch loss, the weights' sha256) and reused when asked again
        (``mia.checkpoints.memorized_checkpoint`` builds or reuses it and checks it before it is scored).
        """

        if self.private:
            raise TestbedError(f"{self.root} is trained with DP-SGD; the memorization dial trains without privacy "
                               "and would void its guarantee")
        step = self.train_steps if step is None else int(step)
        idx = np.asarray(sorted({int(r) for r in rows}), np.int64)
        epochs = integer(epochs, "memorization epochs", hi=MEMORIZE_EPOCHS_MAX, error=TestbedError)
        if epochs <= 0:
            return self.checkpoint_dir(step)
        if idx.size == 0:
            raise TestbedError("the memorization dial needs at least one member row")
        hi = step * self.batch_size
        if idx.min() < 0 or idx.max() >= hi:
            raise TestbedError(f"memorized rows must be members of checkpoint step{step}: indices in [0, {hi}), "
                               f"got [{idx.min()}, {idx.max()}]")
        lr = self.config.memorize_lr or self.config.lr
        h = hashlib.sha256(idx.tobytes() + f"|{epochs}|{seed}|{lr}".encode()).hexdigest()[:10]
        out = self.root / "checkpoints" / f"step{step}-mem{epochs}-{h}"
        if (out / "memorize.json").exists():
            return out

        base = load(self.checkpoint_dir(step))
        params, log = run_memorize(base, base.params, self.config, self.dataset().get_rows(idx), epochs, seed=seed,
                                   progress=progress, lr=lr)
        tmp = temporary_sibling(out)
        save(dataclasses.replace(base, params=params), tmp)
        write_json(tmp / "memorize.json", {"base_step": step, "epochs": int(epochs), "seed": int(seed), "lr": lr,
                                           "n_rows": int(idx.size), "rows": idx.tolist(), "log": log,
                                           "weights_sha256": sha256_of_file(tmp / "model.safetensors")}, indent=1)
        place_dir(tmp, out)
        return out

    def default_memorize_rows(self, n: int, step: Optional[int] = None, seed: int = 0) -> np.ndarray:
        """``n`` seeded member rows of checkpoint ``step`` (the fixed subset of ``python -m mia.testbed``)."""
        step = self.train_steps if step is None else int(step)
        hi = step * self.batch_size
        if n > hi:
            raise TestbedError(f"asked to memorize {n} rows but step{step} has seen only {hi}")
        return np.sort(np.random.default_rng([int(seed), 0x3E3]).choice(hi, size=n, replace=False))

    def summary(self) -> str:
        m = self.manifest
        out = (f"testbed {self.root} (preset {self.config.preset}, config {self.config.config_hash}): "
               f"{m['corpus']['n_documents']} documents, {m['data']['n_rows']} rows of {self.row_len} tokens "
               f"({self.epoch_steps} steps/epoch at batch {self.batch_size}), trained {self.train_steps} steps, "
               f"checkpoints {', '.join(map(str, self.steps))}")
        if "canaries" in m:
            c = m["canaries"]
            out += (f"; {c['m']} {c['kind']} canaries ({c['n_included']} included, {c['n_copies']} rows, reps "
                    f"{', '.join(map(str, c['reps']))})")
        if "privacy" in m:
            p = m["privacy"]
            eps = p["epsilon_pld"]
            eps = eps if isinstance(eps, str) else format(eps, ".4g")
            out += (f"; DP-SGD ({p['sampling']}, noise {p['noise_multiplier']:g}, clip {p['clip']:g}): epsilon "
                    f"{eps} at delta {p['delta']:.3g} (PLD)")
        return out


def _recorded_digests(m: dict) -> list:
    """[(file relative to the testbed, sha256 the manifest records)] of the data files: tokenizer, training order
    (.bin, .idx, row permutation) and canaries; records absent from ``m`` (or hashed over part of a file) are left
    out."""
    data, tok, can = m.get("data"), m.get("tokenizer"), m.get("canaries")
    out = []
    if isinstance(tok, dict):
        out.append(("tokenizer.json", tok.get("sha256")))
    if isinstance(data, dict):
        for ext in ("bin", "idx"):
            rec = data.get(ext)
            if isinstance(rec, dict) and rec.get("hash_scope", "full") == "full":
                out.append((f"data/order.{ext}", rec.get("sha256")))
        out.append(("data/order.perm.npy", data.get("perm_sha256")))
    if isinstance(can, dict):
        out.append((CANARY_FILE, can.get("sha256")))
    return [(rel, h) for rel, h in out if isinstance(h, str)]


def verify_data(root, m: dict, missing_ok: bool = False) -> Optional[str]:
    """None when every data file whose sha256 ``m`` records is there with that digest, else one line naming the
    first damaged (or, unless ``missing_ok``, missing) file with the expected and actual digest prefixes. Hashed
    through ``mia.files.hashing.file_sha256`` (memoised by path, size, mtime, ctime and inode), so reopening an
    unchanged testbed does not rehash it."""
    root = Path(root)
    for rel, want in _recorded_digests(m):
        path = root / rel
        if not path.is_file():
            if missing_ok:
                continue
            return f"{path}: missing (testbed.json records sha256 {want[:12]})"
        got = hashing.file_sha256(path)
        if got != want:
            return f"{path}: damaged: sha256 {got[:12]}, testbed.json records {want[:12]}"
    return None


def open_testbed(path) -> Testbed:
    """Open a complete testbed directory (no building). Its data files (tokenizer, training order, canaries) are
    verified against the sha256 digests its manifest records (``verify_data``): a damaged testbed is one
    ``TestbedError`` line naming the file."""
    root = Path(path)
    mf = root / MANIFEST
    if not mf.exists():
        raise TestbedError(f"{root}: not a testbed (no {MANIFEST}); build one with python -m mia.testbed")
    m = read_manifest(mf, TESTBED_FIELDS)
    if not m.get("complete"):
        raise TestbedError(f"{root}: testbed build is incomplete; rerun python -m mia.testbed --out {root} to finish "
                           "it")
    if m.get("format") != FORMAT:
        raise TestbedError(f"{root} holds a testbed built by another version of mia.testbed "
                           f"({str(m.get('format'))[:40]!r}, now {FORMAT}); rebuild it (delete the directory, or build "
                           "into another --out)")
    cfg = config_of_manifest(m, mf)
    check_recorded_fields(m, mf)
    damaged = verify_data(root, m)
    if damaged:
        raise TestbedError(f"{damaged}; the testbed at {root} is damaged: delete it and build it again")
    return Testbed(root, cfg, m)


# the fields of a complete testbed's manifest that its users read: (path of keys, type, minimum or None)
RECORDED_FIELDS = ((("tokenizer", "sha256"), str, None), (("tokenizer", "vocab_size"), int, 1),
                   (("data", "n_rows"), int, 0), (("data", "bin", "sha256"), str, None),
                   (("data", "idx", "sha256"), str, None), (("data", "perm_sha256"), str, None),
                   (("corpus", "sha256"), str, None))


def check_recorded_fields(m: dict, path) -> None:
    """Every ``RECORDED_FIELDS`` entry of a complete manifest ``m`` present with its type (an integer not below its
    minimum; canaries' sha256 too when the testbed has canaries), else one ``TestbedError`` naming ``path`` and the
    field: a digest of another type would otherwise leave its file unverified."""
    fields = RECORDED_FIELDS + (((("canaries", "sha256"), str, None),) if "canaries" in m else ())
    for keys, typ, lo in fields:
        v = m
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        ok = isinstance(v, typ) and not isinstance(v, bool) and (lo is None or v >= lo)
        if not ok:
            want = "a string" if typ is str else f"an integer >= {lo}"
            raise TestbedError(f"{path}: field {'.'.join(keys)} must be {want}, got {short_repr(v, 40)}; delete the "
                               "directory to rebuild")


def _check_complete(root: Path, m: dict) -> Optional[str]:
    """None when every file a complete testbed needs is there, else what is missing."""
    canary_file = ("data/canaries.json",) if "canaries" in m else ()
    for rel in ("tokenizer.json", "data/order.bin", "data/order.idx") + canary_file:
        if not (root / rel).exists():
            return rel
    if os.path.getsize(root / "data/order.bin") != m["data"]["bin"]["bytes"]:
        return "data/order.bin (size changed)"
    for s in m.get("checkpoints", {}):
        if not (root / "checkpoints" / f"step{s}" / "model.safetensors").exists():
            return f"checkpoints/step{s}"
    return None


# files of the data stages (corpus manifest, tokenizer, training order) and the manifest records describing them;
# a testbed with canaries also shares its canary file (and record)
DATA_FILES = ("corpus.json", "tokenizer.json", "tokenizer_config.json", "data/order.bin", "data/order.idx",
              "data/order.perm.npy")
DATA_RECORDS = ("corpus", "tokenizer", "data")
CANARY_RECORD = "canaries"


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(dst)
    try:
        os.link(src, tmp)  # a hard link: the suite's members hold one copy of the data on disk
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def share_data(src_root, cfg: TestbedConfig, root) -> None:
    """Start the testbed of ``cfg`` in ``root`` with the corpus, tokenizer and order already built in ``src_root``
    (hard links, or copies), so that ``build_from_config(cfg, root)`` only trains. ``cfg`` must have the same
    :data:`~mia.testbed.config.DATA_FIELDS` as the source's config. A ``root`` that already has its data is left as
    it is (the build checks it)."""
    src_root, root = Path(src_root), Path(root)
    src = read_manifest(src_root / MANIFEST, TESTBED_FIELDS)
    if any(k not in src for k in DATA_RECORDS):
        raise TestbedError(f"{src_root}: its data stages are not built yet")
    src_cfg = config_of_manifest(src, src_root / MANIFEST)
    diff = [k for k in DATA_FIELDS if getattr(src_cfg, k) != getattr(cfg, k)]
    if diff:
        raise TestbedError(f"cannot share {src_root}'s data: the configs differ in {', '.join(diff)}")

    files, records = DATA_FILES, DATA_RECORDS
    if cfg.canaries:
        if CANARY_RECORD not in src:
            raise TestbedError(f"{src_root}: its canaries are not built yet")
        files, records = files + (CANARY_FILE,), records + (CANARY_RECORD,)
    mf = root / MANIFEST
    if mf.exists() and all(k in read_manifest(mf, TESTBED_FIELDS) for k in records):
        return
    for rel in files:
        _link_or_copy(src_root / rel, root / rel)
    m = {"format": FORMAT, "preset": cfg.preset, "config": cfg.to_dict(), "config_hash": cfg.config_hash,
         "complete": False, **{k: src[k] for k in records},
         "shared_data": {"from": os.path.relpath(src_root, root), "files": list(files)}}
    write_json(mf, m, indent=1)


def build_twin(src, out_dir, *, progress: bool = True, save_every: int = 50, stop_after: Optional[int] = None,
               **overrides) -> Testbed:
    """A testbed trained on ``src``'s data (its corpus, tokenizer, training order and canaries, shared by hard links
    or copies) with ``overrides`` of the fields that do not touch the data: the model, the optimiser, or privacy
    (``dp_noise``, ``dp_clip``, ``dp_sampling``). ``src``: a :class:`Testbed` or its directory (its data stages must
    be built). Runs that differ only by privacy: ``build_twin(tb, out, dp_noise=1.0)``. ``stop_after``: as for
    :func:`build_testbed`."""
    src_root = Path(src.root if isinstance(src, Testbed) else src)
    src_m = read_manifest(src_root / MANIFEST, TESTBED_FIELDS) if (src_root / MANIFEST).exists() else None
    if src_m is None:
        raise TestbedError(f"{src_root}: not a testbed (no {MANIFEST})")
    base = config_of_manifest(src_m, src_root / MANIFEST)
    bad = sorted(set(overrides) & set(DATA_FIELDS))
    if bad:
        raise TestbedError(f"a twin shares its source's data; it cannot change {', '.join(bad)}")
    suffix = "-dp" if overrides.get("dp_noise") is not None else "-twin"
    cfg = base.replace(**{"preset": base.preset + suffix, **overrides})
    share_data(src_root, cfg, out_dir)
    return build_from_config(cfg, out_dir, progress=progress, save_every=save_every, stop_after=stop_after)


def build_testbed(preset: str = "smoke", out_dir=None, *, progress: bool = True, save_every: int = 50,
                  stop_after: Optional[int] = None, memorize_epochs: int = 0, memorize_rows: int = 256,
                  **overrides) -> Testbed:
    """Build the testbed of ``preset`` (with ``overrides`` of :class:`TestbedConfig` fields) in ``out_dir``
    (default ``testbeds/<preset>``, or ``testbeds/<preset>-<config hash>`` with overrides), or reuse / resume the
    one already there.

    ``memorize_epochs`` > 0 also makes the memorization dial's checkpoint over ``memorize_rows`` seeded member
    rows of the last checkpoint (``Testbed.memorized`` holds its path). ``stop_after`` stops training after that
    step (an interruption, for tests); the next call resumes.
    """
    cfg = get_preset(preset, **overrides)
    if out_dir is not None:
        root = Path(out_dir)
    else:  # testbeds/<preset>, or testbeds/<preset>-<hash> when options were overridden
        root = Path(DEFAULT_ROOT) / (preset if cfg == get_preset(preset) else f"{preset}-{cfg.config_hash[:8]}")
    return build_from_config(cfg, root, progress=progress, save_every=save_every, stop_after=stop_after,
                             memorize_epochs=memorize_epochs, memorize_rows=memorize_rows)


def build_from_config(cfg: TestbedConfig, root, *, progress: bool = True, save_every: int = 50,
                      stop_after: Optional[int] = None, memorize_epochs: int = 0, memorize_rows: int = 256) -> Testbed:
    """Build (or reuse / resume) the testbed of config ``cfg`` in directory ``root`` (see :func:`build_testbed`)."""
    from tqdm.auto import tqdm

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mf_path = root / MANIFEST
    m: dict = {}
    if mf_path.exists():
        m = read_manifest(mf_path, TESTBED_FIELDS)
        if m.get("format") != FORMAT:
            raise TestbedError(f"{root} holds a testbed built by another version of mia.testbed "
                               f"({str(m.get('format'))[:40]!r}, now {FORMAT}); delete it to rebuild, or use another "
                               "--out")
        if m.get("config_hash") != cfg.config_hash:
            old = m.get("config", {})
            diff = sorted(
                k for k in set(old) | set(cfg.hash_dict()) if old.get(k) != cfg.to_dict().get(k) and k != "preset"
            )
            raise TestbedError(f"{root} holds a testbed with another config (differs in: {', '.join(diff) or '?'}); "
                               f"use another --out or delete it")
        # once training has saved a checkpoint, the data it was trained on must be the recorded data: a damaged
        # file is refused (rebuilding its stage would silently give the checkpoints another tokenizer or order)
        damaged = verify_data(root, m, missing_ok=True) if saved_steps(root) else None
        if damaged:
            raise TestbedError(f"{damaged}; the testbed at {root} is damaged: delete it and build it again")
        if m.get("complete") and _check_complete(root, m) is None:
            tb = Testbed(root, cfg, m)
            return _with_memorized(tb, memorize_epochs, memorize_rows, progress)
    m = {"format": FORMAT, "preset": cfg.preset, "config": cfg.to_dict(), "config_hash": cfg.config_hash,
         "complete": False, **{k: v for k, v in m.items()
                               if k in ("corpus", "tokenizer", "data", "canaries", "timings", "shared_data")}}
    m.setdefault("timings", {})
    write_json(mf_path, m, indent=1)
    say = (lambda msg: tqdm.write(msg)) if progress else (lambda msg: None)

    # 1. corpus (cheap to re-read; it must not have changed since earlier stages used it)

    t0 = time.perf_counter()
    corpus = load_corpus(cfg.corpus, cfg.text_column, cfg.max_corpus_bytes)
    if "corpus" in m and m["corpus"]["sha256"] != corpus.sha256:
        raise TestbedError(f"{root}: the corpus changed since this testbed was started "
                           f"({m['corpus']['sha256'][:12]} -> {corpus.sha256[:12]}); use another --out")
    corpus.write_manifest(root / "corpus.json")
    m["corpus"] = corpus.manifest(with_documents=False) | {"manifest": "corpus.json"}
    m["timings"]["corpus_s"] = round(time.perf_counter() - t0, 2)
    say(f"corpus: {len(corpus)} documents, {corpus.n_bytes / 1e6:.1f} MB ({corpus.kind}: {corpus.root})")

    # 2. tokenizer

    if (
        "tokenizer" in m
        and (root / "tokenizer.json").exists()
        and _sha_file(root / "tokenizer.json") == m["tokenizer"]["sha256"]
    ):
        tok = load_tokenizer(root)
    else:
        t0 = time.perf_counter()
        say(f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) ...")
        tok = train_tokenizer(corpus.texts, cfg.vocab_size, cfg.reserved_tokens)
        save_tokenizer(tok, root)
        tok = load_tokenizer(root)
        m["tokenizer"] = {"path": "tokenizer.json", "sha256": _sha_file(root / "tokenizer.json"),
                          "vocab_size": len(tok), "eod_id": EOD_ID, "eod_token": "<|endoftext|>"}
        if cfg.reserved_tokens:
            ids = reserved_ids(tok)
            m["tokenizer"]["reserved"] = [ids.start, ids.stop]
        m["timings"]["tokenizer_s"] = round(time.perf_counter() - t0, 2)
        m.pop("data", None)  # a new tokenizer invalidates the order
        m.pop("canaries", None)  # and the canaries (drawn in its vocabulary)
        write_json(mf_path, m, indent=1)

    # 3. packing into the training order

    prefix = root / "data" / "order"
    if not ("data" in m and prefix.with_suffix(".bin").exists()
            and os.path.getsize(prefix.with_suffix(".bin")) == m["data"]["bin"]["bytes"]):
        t0 = time.perf_counter()
        say("tokenizing and packing the corpus ...")
        docs = encode_documents(tok, corpus.texts)
        rows, n_dup = dedup_rows(pack_rows(docs, cfg.row_len))
        if cfg.reserved_tokens and (rows >= reserved_ids(tok).start).any():
            raise TestbedError(f"the corpus uses a reserved token (id {int(rows.max())}, e.g. the text "
                               f"{tok.convert_ids_to_tokens(int(rows.max()))!r}); reserved tokens must be new")
        order = row_permutation(len(rows), cfg.seed)
        write_order(prefix, rows, order)
        n_tokens = sum(len(d) + 1 for d in docs)
        m["data"] = {
            "prefix": "data/order",
            "bin": file_record(prefix.with_suffix(".bin"), full_limit=None),
            "idx": file_record(prefix.with_suffix(".idx"), full_limit=None),
            "perm_sha256": _sha_file(str(prefix) + ".perm.npy"),
            "n_rows": int(len(rows)),
            "row_len": cfg.row_len,
            "batch_size": cfg.batch_size,
            "epoch_steps": int(len(rows) // cfg.batch_size),
            "n_tokens": int(n_tokens),
            "duplicate_rows_dropped": n_dup,
            "dtype": "uint16",
            "eod_id": EOD_ID,
            "permutation": "numpy.random.default_rng([seed, 0x7E57]).permutation(n_rows)",
        }
        for rec in (m["data"]["bin"], m["data"]["idx"]):
            rec["path"] = os.path.relpath(rec["path"], root)
        m["timings"]["packing_s"] = round(time.perf_counter() - t0, 2)
        write_json(mf_path, m, indent=1)
    n_rows, need = m["data"]["n_rows"], cfg.train_steps * cfg.batch_size
    if n_rows < need:
        raise TestbedError(f"corpus too small: {len(corpus)} documents made {n_rows} rows of {cfg.row_len} tokens, "
                           f"but {cfg.train_steps} steps x batch {cfg.batch_size} need {need} rows "
                           f"(lower train_steps/batch_size or give a larger corpus)")
    say(f"order: {n_rows} rows of {cfg.row_len} tokens = {n_rows // cfg.batch_size} steps/epoch at batch "
        f"{cfg.batch_size}; training {cfg.train_steps} steps")

    # 3b. canaries (drawn in the tokenizer's vocabulary; inclusion and steps follow from the config)
    if cfg.canaries:
        _build_canaries(root, cfg, tok, corpus.texts, m, say, progress)
        write_json(mf_path, m, indent=1)
    if cfg.private:

        m["privacy"] = privacy_record(cfg)
        say(f"DP-SGD: epsilon {m['privacy']['epsilon_pld']} at delta {m['privacy']['delta']:.3g} "
            f"({cfg.dp_sampling} sampling, noise {cfg.dp_noise:g}, clip {cfg.dp_clip:g})")

    # 4. training (resumes from the latest saved state)
    tb = Testbed(root, cfg, m)
    t0 = time.perf_counter()
    _, _, reached = tb._train(progress=progress, save_every=save_every, stop_after=stop_after)
    m["timings"]["train_s"] = round(m["timings"].get("train_s", 0.0) + time.perf_counter() - t0, 2)
    if reached < cfg.train_steps:
        write_json(mf_path, m, indent=1)
        return tb  # interrupted on purpose (stop_after); a later call resumes

    m["checkpoints"] = {str(s): {"path": f"checkpoints/step{s}",
                                 "sha256": _sha_file(checkpoint_dir(root, s) / "model.safetensors")}
                        for s in cfg.checkpoint_steps}
    recs = [json.loads(l) for l in (root / "train_log.jsonl").read_text().splitlines() if l.strip()]
    tail = [r["loss"] for r in recs[-max(1, len(recs) // 20):]]
    m["model"] = {"n_params": cfg.n_params(m["tokenizer"]["vocab_size"]), "context": cfg.seq_len}
    m["train"] = {"steps": cfg.train_steps, "final_loss": float(np.mean(tail)) if tail else None,
                  "first_loss": recs[0]["loss"] if recs else None, "log": "train_log.jsonl", "plot": "loss.png"}
    plot_losses(root / "train_log.jsonl", root / "loss.png", cfg.checkpoint_steps,
                title=f"testbed {cfg.preset} ({cfg.config_hash})")
    m["complete"] = True
    write_json(mf_path, m, indent=1)
    tb = Testbed(root, cfg, m)
    return _with_memorized(tb, memorize_epochs, memorize_rows, progress)


def _build_canaries(root: Path, cfg: TestbedConfig, tok, texts, m: dict, say, progress: bool = True) -> None:
    """Write ``data/canaries.json`` and its manifest record, unless the recorded file is already there intact.
    Sampled canaries come from the last checkpoint of the same config without canaries (the same order), built (or
    reused) in ``sampler/``."""

    path = root / CANARY_FILE
    rec = m.get("canaries")
    if rec is not None and path.exists() and _sha_file(path) == rec["sha256"]:
        return
    t0 = time.perf_counter()
    kinds = canary_kinds(cfg.canary_kind)
    rows = IndexedDataset(root / "data" / "order").get_rows(np.arange(m["data"]["n_rows"])) \
        if {"unigram", "bigram"} & set(kinds) else None
    sampler, sampler_rec = None, None
    if "sampled" in kinds:
        say("training the sampler of the sampled canaries (the same config without canaries) ...")
        plain = build_from_config(cfg.replace(canaries=0, preset=cfg.preset + "-sampler"), root / "sampler",
                                  progress=progress)
        sampler = plain.load_model()
        sampler_rec = {"path": "sampler", "config_hash": plain.config.config_hash, "step": plain.train_steps,
                       "sha256": plain.checkpoint_hash()}
    c = make_canaries(cfg, tok, texts, rows=rows, sampler=sampler)
    write_canaries(path, c)
    m["canaries"] = {"path": CANARY_FILE, "sha256": _sha_file(path), "m": c.m, "kind": c.kind,
                     "reps": list(cfg.canary_reps), "n_included": int(c.included.sum()), "n_copies": c.n_copies,
                     "slots": c.slots, "inclusion": "independent, probability 1/2 (numpy default_rng([seed, 0xCA7A]))"}
    if sampler_rec is not None:
        m["canaries"]["sampler"] = sampler_rec
    m["timings"]["canaries_s"] = round(time.perf_counter() - t0, 2)
    say(f"canaries: {c.m} {c.kind} rows, {int(c.included.sum())} included, {c.n_copies} extra training rows")


def _with_memorized(tb: Testbed, epochs: int, n_rows: int, progress: bool) -> Testbed:
    tb.memorized = None
    if epochs and epochs > 0:
        tb.memorized = tb.memorize(tb.default_memorize_rows(n_rows), epochs, progress=progress)
    return tb
