"""Drawing member / non-member splits from a training order: the testbed's, Pythia's and OLMo's.

``draw_testbed_split``, ``draw_pythia_split`` and ``draw_olmo_split`` are the ``mia split`` samplers
(``mia.data.pythia`` / ``mia.data.olmo_order``: members from the rows a checkpoint has seen, non-members from the
rows of the same first epoch it has not) followed by one seeded partition plan (``SplitSizes``: eval / train per class,
calib and prefix non-members). Each returns ``(header, examples, note)``: the split file's header and rows (dicts:
``id``, ``tokens``, ``label``, ``partition``, ``index``, ...; ``mia.data.splits.write_split`` writes them) and a
note when the partitions were shrunk to what the ranges hold (``allow_fewer``), else None.

Clean-up before scoring, recorded in the header so ``mia split check`` still re-draws the file from its seed:
``drop_learned_duplicates`` (a scored row equal to a learned-from row), ``drop_label_conflicts`` (a non-member equal
to a member: real orders hold exact duplicates). ``check_token_ids``: data against the model's vocabulary.
Errors are one line (``SplitError``, a ``ValueError``). Same seed: the same split, row for row.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from . import olmo_order, pythia
from .examples import LEARNED_PARTITIONS, disjointness_keys
from .splits import DROPPED_ROWS, SplitError, assign_partitions, partition_counts


# ============================================================================================ splits
@dataclasses.dataclass(frozen=True)
class SplitSizes:
    """Examples per partition: ``eval`` and ``train`` per class; ``calib`` (CAMIA) and ``prefix`` (ReCaLL)
    non-members only. ``eval_nonmembers`` defaults to ``eval``."""

    eval: int
    train: int = 0
    calib: int = 0
    prefix: int = 0
    eval_nonmembers: Optional[int] = None

    def __post_init__(self):
        for k in ("eval", "train", "calib", "prefix"):
            if getattr(self, k) < 0:
                raise SplitError(f"partition {k} must be >= 0, got {getattr(self, k)}")
        if self.eval < 1 or self.n_eval_nonmembers < 1:
            raise SplitError("the eval partition needs at least one member and one non-member")

    @property
    def n_eval_nonmembers(self) -> int:
        return self.eval if self.eval_nonmembers is None else int(self.eval_nonmembers)

    @property
    def members(self) -> int:
        return self.eval + self.train

    @property
    def nonmembers(self) -> int:
        return self.n_eval_nonmembers + self.train + self.calib + self.prefix

    def plan(self) -> dict:
        """{label: ((partition, count), ...)} in assignment order."""
        return {1: (("train", self.train), ("eval", self.eval)),
                0: (("prefix", self.prefix), ("calib", self.calib), ("train", self.train),
                    ("eval", self.n_eval_nonmembers))}

    def replace(self, **kw) -> "SplitSizes":
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


PARTITION_STREAM = 0x5B1  # the experiments' partition stream (``mia.data.splits.assign_partitions``)
PARTITION_SAMPLER = ("numpy.random.default_rng([seed, 0x5B1]) permutation per class: members -> train, eval; "
                     "non-members -> prefix, calib, train, eval")


def finish_split(header: dict, examples: list, sizes: SplitSizes, seed: int) -> tuple:
    assign_partitions(examples, sizes.plan(), seed, stream=PARTITION_STREAM)
    header["params"]["sampler_partitions"] = PARTITION_SAMPLER
    header.update(partition_counts(examples))
    return header, examples


def drop_learned_duplicates(header: dict, examples: list, scored: Sequence[str] = ("eval",)) -> tuple:
    """(header, examples, dropped ids): every scored row (partition in ``scored``) that is the same as a learned-from
    row (``mia.data.examples.LEARNED_PARTITIONS``) by mia's disjointness rule (``disjointness_keys``: id, token ids
    or text; ``mia.score`` refuses such a pair) left out, the learned-from copy kept. Real orders hold exact
    duplicate rows, so a draw may pair two. The header's counts and partitions are the kept rows'; the dropped
    positions go to ``params.dropped_rows`` (``mia.data.splits.DROPPED_ROWS``), so ``mia split check`` still
    re-draws the file from its seed. Nothing dropped: the inputs unchanged."""
    learned = {k for e in examples if e.get("partition") in LEARNED_PARTITIONS for k in disjointness_keys(e)}
    gone = [e for e in examples if e.get("partition", "eval") in scored
            and any(k in learned for k in disjointness_keys(e))]
    return drop_rows(header, examples, gone)


def drop_rows(header: dict, examples: list, gone: list) -> tuple:
    """(header, kept examples, dropped ids): ``gone`` left out, the header's counts and partitions the kept rows',
    the dropped positions appended to ``params.dropped_rows`` (``mia.data.splits.DROPPED_ROWS``)."""
    if not gone:
        return header, examples, []
    ids = {id(e) for e in gone}
    kept = [e for e in examples if id(e) not in ids]
    header = {**header, **partition_counts(kept), "params": dict(header.get("params") or {})}
    header["params"][DROPPED_ROWS] = list(header["params"].get(DROPPED_ROWS) or []) + [
        {"label": e["label"], "index": e["index"],
         **({"segment": e["segment"]} if e.get("segment") is not None else {})}
        for e in gone if e.get("index") is not None]
    return header, kept, [str(e["id"]) for e in gone]


def label_conflicts(examples: list, scored: Sequence[str] = ("eval",)) -> list:
    """The scored non-member rows (label 0, partition in ``scored``) with the same token ids or text as a scored
    member row (label 1): what ``mia.score`` refuses as one input labelled both. Rows are dicts; no partition is
    ``eval``."""
    content = lambda e: [k for k in disjointness_keys(e) if k[0] != "id"]  # noqa: E731
    members = {k for e in examples if e.get("partition", "eval") in scored and e.get("label") == 1
               for k in content(e)}
    return [e for e in examples if e.get("partition", "eval") in scored and e.get("label") == 0
            and any(k in members for k in content(e))]


def drop_label_conflicts(header: dict, examples: list, scored: Sequence[str] = ("eval",)) -> tuple:
    """(header, examples, dropped ids): every ``label_conflicts`` row left out, the member kept (``mia.score``
    refuses one input labelled both; a real order's exact duplicate rows can put one copy before the checkpoint and
    one after, and the model has seen it). Recorded in ``params.dropped_rows`` as ``drop_learned_duplicates`` does,
    so ``mia split check`` still re-draws the file."""
    return drop_rows(header, examples, label_conflicts(examples, scored))


def without_label_conflicts(examples: list) -> tuple:
    """(examples, number dropped): ``label_conflicts`` left out, the member kept, for data that is no split file
    (no header to record the positions in)."""
    gone = {id(e) for e in label_conflicts(examples)}
    return [e for e in examples if id(e) not in gone], len(gone)


def draw_testbed_split(tb, step: int, sizes: SplitSizes, seed: int, end_step: Optional[int] = None, *,
                       allow_fewer: bool = False):
    """(header, examples, note) of the checkpoint split of testbed ``tb`` at checkpoint ``step``.

    Members: rows [0, step*B); non-members: rows [step*B, end_step*B), end_step = the first epoch's end by default.
    Drawn without replacement by ``mia.data.pythia.draw_checkpoint_split`` with the model's vocabulary
    (``testbed_vocab_size``: an id outside it stops, naming the row); partitions by
    ``mia.data.splits.assign_partitions``.
    ``allow_fewer`` shrinks the partitions to what the ranges hold (with a note) instead of stopping.
    """
    B, epoch_end = tb.batch_size, tb.epoch_steps
    end_step = epoch_end if end_step is None else int(end_step)
    if step <= 0:
        raise SplitError(f"checkpoint step {step} has seen no rows, so it has no members; use a step in "
                              f"(0, {tb.train_steps}]")
    if step > tb.train_steps:
        raise SplitError(f"checkpoint step {step} is beyond the run: the testbed trained {tb.train_steps} steps "
                              f"(checkpoints: {', '.join(map(str, tb.steps))})")
    sizes, note = fit_sizes(f"step{step} split", sizes, allow_fewer, step * B, max(0, (end_step - step) * B))
    if sizes.members > step * B:
        raise SplitError(f"the split asks for {sizes.members} members (eval {sizes.eval} + train {sizes.train}) "
                              f"but checkpoint step{step} has seen only {step * B} rows (steps [0, {step}) x batch "
                              f"{B}); lower --n-members/--n-train")
    if sizes.nonmembers > (end_step - step) * B:
        raise SplitError(f"the split asks for {sizes.nonmembers} non-members (eval {sizes.n_eval_nonmembers} + "
                              f"train {sizes.train} + calib {sizes.calib} + prefix {sizes.prefix}) but steps [{step}, "
                              f"{end_step}) of the first epoch hold only {max(0, (end_step - step) * B)} rows; lower "
                              "the counts or use an earlier --steps")
    header, examples = pythia.draw_checkpoint_split(tb.dataset(), step, sizes.members, sizes.nonmembers, seed, gap=0,
                                             end_step=end_step, batch_size=B, vocab_size=testbed_vocab_size(tb))
    for e in examples:  # ids of the testbed's rows; kind "testbed" in the header
        e["id"] = f"row{e['index']}"
    header["source"].update(kind="testbed", testbed=str(tb.root.resolve()), tokenizer=str(tb.root.resolve()),
                            config_hash=tb.config.config_hash, corpus_sha256=tb.manifest["corpus"]["sha256"],
                            checkpoint=str(tb.checkpoint_dir(step).resolve()))
    header["params"].update(epoch_end_step=epoch_end)
    return (*finish_split(header, examples, sizes, seed), note)


def testbed_vocab_size(tb) -> int:
    """The vocabulary of the testbed's model (its tokenizer's size, recorded in the manifest): every drawn token id
    must lie in ``[0, vocab_size)``."""
    return int(tb.manifest["tokenizer"]["vocab_size"])


def fit_sizes(what: str, sizes: SplitSizes, allow_fewer: bool, available_members: int, available_nonmembers: int):
    """``sizes`` shrunk to what the ranges hold when ``allow_fewer`` (the paper preset's 'where the data allow')."""
    if not allow_fewer:
        return sizes, None
    m_scale = min(1.0, available_members / max(sizes.members, 1))
    n_scale = min(1.0, available_nonmembers / max(sizes.nonmembers, 1))
    s = min(m_scale, n_scale)
    if s >= 1.0:
        return sizes, None
    fit = SplitSizes(max(1, int(sizes.eval * s)), int(sizes.train * s), int(sizes.calib * s), int(sizes.prefix * s),
                     None if sizes.eval_nonmembers is None else max(1, int(sizes.n_eval_nonmembers * s)))
    return fit, (f"{what}: the ranges hold {available_members} member and {available_nonmembers} non-member rows, "
                 f"fewer than asked; partitions scaled by {s:.3f} (eval {fit.eval}, train {fit.train}, calib "
                 f"{fit.calib}, prefix {fit.prefix})")


def require_order(what: str, given: Mapping[str, object]) -> None:
    """One ``SplitError`` naming the parts of a training order ``given`` lacks ({part: value})."""
    missing = [k for k, v in given.items() if not v]
    if missing:
        raise SplitError(f"{what} needs the training order: {' and '.join(missing)} missing")


def draw_pythia_split(data: Sequence, idx, step: int, sizes: SplitSizes, seed: int, *, gap: int = 0,
                      end_step: int = 98_500, batch_size: int = 1024, allow_fewer: bool = False,
                      vocab_size: Optional[int] = None):
    """(header, examples, note) of a Pythia checkpoint split: ``mia split pythia`` (members from steps
    [0, step-gap), non-members from [step+gap, end_step)) on the .bin shards ``data`` with the single ``idx``.
    ``vocab_size`` (the models' config.json): a drawn token id outside it stops, naming shard, row and token."""
    require_order("a Pythia split", {"the .bin shard(s) (data)": data, "the document.idx (idx)": idx})
    for p in list(data) + [idx]:
        if not Path(p).exists():
            raise SplitError(f"{p}: data file not found")
    ds = pythia.open_dataset([str(p) for p in data], str(idx))
    n_mem = max(0, step - gap) * batch_size
    n_non = max(0, min(end_step, len(ds) // batch_size) - (step + gap)) * batch_size
    sizes, note = fit_sizes("pythia split", sizes, allow_fewer, n_mem, n_non)
    header, examples = pythia.draw_checkpoint_split(ds, step, sizes.members, sizes.nonmembers, seed, gap=gap,
                                             end_step=end_step, batch_size=batch_size, vocab_size=vocab_size)
    header, examples = finish_split(header, examples, sizes, seed)
    return header, examples, note


def draw_olmo_split(global_indices, data_paths, step: int, sizes: SplitSizes, seed: int, *,
                    nonmember_start: Optional[int] = None, end_step: Optional[int] = None, batch_size: int = 2160,
                    seq_len: int = 2048, allow_fewer: bool = False):
    """(header, examples, note) of an OLMo checkpoint split: ``mia split olmo`` (members from positions of steps
    [0, step), non-members from [nonmember_start, end_step)) on ``global_indices`` + the ``data_paths`` list."""
    require_order("an OLMo split", {"global_indices": global_indices, "data_paths": data_paths})
    order = olmo_order.OlmoOrder(global_indices, data_paths, seq_len=seq_len, batch_size=batch_size)
    s2 = step if nonmember_start is None else int(nonmember_start)
    e = order.steps if end_step is None else int(end_step)
    sizes, note = fit_sizes("olmo split", sizes, allow_fewer, step * batch_size, max(0, e - s2) * batch_size)
    header, examples = olmo_order.draw_checkpoint_split(order, step, sizes.members, sizes.nonmembers, seed,
                                             nonmember_start=s2, end_step=e, batch_size=batch_size)
    header, examples = finish_split(header, examples, sizes, seed)
    return header, examples, note


def check_token_ids(examples: Sequence[dict], vocab_size: int, data_desc: str, model_desc: str) -> None:
    """Refuse data whose token ids do not exist in the model's vocabulary (data made with another tokenizer)."""
    worst = None
    for e in examples:
        t = np.asarray(e["tokens"])
        if t.size and int(t.max()) >= vocab_size and (worst is None or int(t.max()) > worst[1]):
            worst = (e, int(t.max()))
    if worst is not None:
        e, tok = worst
        where = f"row {e['index']}" if e.get("index") is not None else f"example {e['id']}"
        raise SplitError(f"{data_desc}: {where} holds token id {tok} >= the vocabulary size {vocab_size} of "
                              f"{model_desc}: the data files do not match the model's tokenizer")
