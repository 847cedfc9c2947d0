"""What an OLMo checkpoint directory says about where its step sits in the data order, read without OLMo or torch.

The OLMo data-order mode (``mia.data.olmo_order``) puts step ``s`` at global positions ``[s·B, (s+1)·B)`` of
``global_indices``: batch size ``B``, the first step at position 0. Neither is in the weights. Where a checkpoint
carries its trainer's record, this module reads it so the experiments can compare it with the ``B`` and step they
were given (``check_order``):

``config.yaml``      allenai/OLMo's trainer writes its ``TrainConfig`` next to every checkpoint it saves (and its
                     ``hf_olmo`` conversion writes config.json, pytorch_model.bin and the tokenizer into that same
                     directory, leaving config.yaml in place unless asked to delete it). Read here:
                     ``global_train_batch_size`` (instances per step) and ``model.max_sequence_length`` (tokens per
                     instance), two plain ``key: integer`` lines of the block YAML OmegaConf writes.
``train.pt``         the trainer state of an unsharded save (``train/rank0.pt`` in a sharded one): a ``torch.save``
                     zip whose pickle holds ``global_step``, ``global_train_examples_seen_this_epoch`` (older saves:
                     ``global_train_examples_seen``) and ``epoch`` (0 = the first). The trainer adds ``B`` to the
                     examples seen at every step, so in the first epoch they are ``s·B`` exactly when the run started
                     at position 0 and never fast-forwarded. The pickle is read by an unpickler that resolves no
                     global at all (every class or function it names becomes an inert placeholder, nothing is
                     imported or called); only those top-level integers are kept.
the directory name   the Hugging Face revisions of allenai's repositories carry none of these files, but their names
                     do: ``step400000-tokens1769B`` is ``s·B·L`` tokens rounded to billions (2160 · 2048 per step for
                     OLMo-7B; 2048 · 2048 would make it 1678B).

Nothing else of the directory (weights, optimizer state) is read.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import re
import zipfile
from pathlib import Path
from typing import Optional

from .splits import SplitError


class OlmoStateError(SplitError):
    """A checkpoint's trainer record that disagrees with the order settings, or cannot be read (names the file)."""


CONFIG_FILE = "config.yaml"
STATE_FILES = ("train.pt", "train/rank0.pt")
_TOKENS = re.compile(r"^step(\d+)-tokens(\d+)([MBT])$")
_UNITS = {"M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
STATE_KEYS = ("global_step", "global_train_examples_seen_this_epoch", "global_train_examples_seen", "epoch")


@dataclasses.dataclass(frozen=True)
class Fact:
    """One value a checkpoint states: ``value`` of ``field`` read from ``source`` (a file path or the directory)."""

    field: str
    value: int
    source: str


def read_config_yaml(path) -> dict:
    """``{"global_train_batch_size": int, "max_sequence_length": int}`` (those present) of OLMo's config.yaml: the
    top-level ``global_train_batch_size`` and ``model:``'s ``max_sequence_length``. A value that is not an integer
    is one ``OlmoStateError`` naming the file, line and field."""
    path = Path(path)
    out: dict = {}
    block = None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OlmoStateError(f"{path}: cannot read the trainer config ({type(e).__name__})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        if indent == 0:
            block = key if not value.strip() else None
        field = key if indent == 0 else f"{block}.{key}" if block and indent == 2 else None
        want = {"global_train_batch_size": "global_train_batch_size", "model.max_sequence_length":
                "max_sequence_length"}.get(field or "")
        if want is None:
            continue
        v = value.split("#")[0].strip().strip("'\"")
        if not re.fullmatch(r"\d+", v):
            raise OlmoStateError(f"{path}:{lineno}: {field} is {v!r}, not a positive integer")
        out[want] = int(v)
    return out


class _Inert:
    """What every global a trainer-state pickle names becomes: accepts any construction and state, does nothing."""

    def __new__(cls, *args, **kw):
        return object.__new__(cls)

    def __init__(self, *args, **kw):
        pass

    def __setstate__(self, state):
        pass

    def __call__(self, *args, **kw):  # a placeholder called in turn (``getattr(cls, name)(...)``) stays inert
        return _Inert()


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # never imports: a placeholder class per named global
        return type(f"{module}.{name}", (_Inert,), {})

    def persistent_load(self, pid):  # tensor storages: not read
        return None


def read_trainer_state(path) -> dict:
    """The top-level integer fields (``STATE_KEYS``) of an OLMo trainer state saved by ``torch.save`` (a zip holding
    ``<prefix>/data.pkl``), read by ``_InertUnpickler``. A file that is not such a zip, or whose pickle is not a dict,
    is one ``OlmoStateError`` naming it."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not pkl:
                raise OlmoStateError(f"{path}: a zip without data.pkl, not a torch.save trainer state")
            data = zf.read(pkl[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise OlmoStateError(f"{path}: not a readable torch.save trainer state ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    try:
        state = _InertUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a truncated or damaged pickle
        raise OlmoStateError(f"{path}: the trainer state's pickle is damaged ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise OlmoStateError(f"{path}: the trainer state is a {type(state).__name__}, not a dict")
    return {k: int(v) for k, v in state.items() if k in STATE_KEYS and isinstance(v, int) and not isinstance(v, bool)}


def tokens_in_name(name: str) -> Optional[tuple]:
    """``(step, tokens, unit)`` of a revision name ``stepN-tokensX[MBT]`` (tokens = X · unit), else None."""
    m = _TOKENS.match(name)
    return (int(m.group(1)), int(m.group(2)) * _UNITS[m.group(3)], _UNITS[m.group(3)]) if m else None


def checkpoint_facts(ckpt_dir) -> list:
    """Every ``Fact`` the checkpoint directory states about the order: config.yaml's batch size and instance length,
    the trainer state's step, examples seen and epoch, and the token count of its name."""
    d = Path(ckpt_dir)
    facts: list = []
    cfg = d / CONFIG_FILE
    if cfg.is_file():
        facts += [Fact(k, v, str(cfg)) for k, v in read_config_yaml(cfg).items()]
    for rel in STATE_FILES:
        f = d / rel
        if f.is_file():
            facts += [Fact(k, v, str(f)) for k, v in read_trainer_state(f).items()]
            break
    named = tokens_in_name(d.name)
    if named:
        facts.append(Fact("name_step", named[0], str(d)))
        facts.append(Fact("name_tokens", named[1], str(d)))
        facts.append(Fact("name_token_unit", named[2], str(d)))
    return facts


def check_order(facts: list, step: int, batch_size: int, seq_len: int, *, batch_flag: str = "--batch-size",
                seq_flag: str = "--seq-len", step_flag: str = "--steps") -> list:
    """The names of what ``facts`` confirmed about step ``step`` at ``batch_size`` instances of ``seq_len`` tokens
    (empty: nothing to check against); a disagreement is one ``OlmoStateError`` naming both values and the file."""
    by = {f.field: f for f in facts}
    checked = []
    # (recorded field, its name in the message, the flag, the value given, what a match confirms)
    for field, shown, flag, given, what in (
            ("global_train_batch_size", "global_train_batch_size", batch_flag, batch_size, "batch size (config.yaml)"),
            ("max_sequence_length", "model.max_sequence_length", seq_flag, seq_len, "instance length (config.yaml)"),
            ("global_step", "global_step", step_flag, step, "step (trainer state)")):
        if field in by:
            f = by[field]
            if f.value != given:
                raise OlmoStateError(f"{flag} {given} does not match {shown} {f.value} in {f.source}")
            checked.append(what)
    seen = by.get("global_train_examples_seen_this_epoch") or by.get("global_train_examples_seen")
    if seen is not None:
        epoch = by["epoch"].value if "epoch" in by else 0
        if epoch != 0:
            raise OlmoStateError(f"{seen.source}: the trainer state is in epoch {epoch}; the order file "
                                 "(global_indices) is the first epoch's, so its positions do not apply")
        if seen.value != step * batch_size:
            implied = f"; {seen.value} / {step} = batch {seen.value // step}" if step and seen.value % step == 0 \
                else ""
            raise OlmoStateError(f"{seen.source}: {seen.field} {seen.value} is not step {step} x {batch_flag} "
                                 f"{batch_size} = {step * batch_size}: the first step does not start at position 0 "
                                 f"or the batch size differs{implied}")
        checked.append("first-step position (trainer state)")
    if "name_tokens" in by:
        f, unit = by["name_tokens"], by["name_token_unit"].value
        if by["name_step"].value == step:
            want = step * batch_size * seq_len
            if abs(want - f.value) > unit:
                u = _unit_letter(unit)
                raise OlmoStateError(f"{f.source}: the name says {f.value // unit}{u} tokens, but step {step} x "
                                     f"{batch_flag} {batch_size} x {seq_flag} {seq_len} = {want / unit:.1f}{u}")
            checked.append("tokens in the name")
    return checked


def _unit_letter(unit: int) -> str:
    return {v: k for k, v in _UNITS.items()}[unit]
