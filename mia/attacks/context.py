"""What an attack can ask for: the evaluated examples, their token stats, the model, learned-from partitions."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from ..engine.batching import ScoringSettings
from ..engine.loop import compute_token_stats
from ..engine.stats import STAT_NAMES, canonical_stats, pad_stats
from ..data.examples import disjointness_keys, example_field as _field
from .registry import HOST_FIELDS, AttackError


@dataclasses.dataclass
class AttackContext:
    """Shared state of one scoring run. Expensive results (token stats) are computed once and shared by attacks.

    ``partitions`` holds data that attacks *learn from* ("prefix", "calib", "train"); they are checked disjoint from
    ``examples`` (by id and by token content) before any attack runs.

    ``stat_names``: the model's token statistics the run computes (``mia.attacks.registry.stats_read_by`` of the
    run's attacks; None: all of ``STAT_NAMES``). An attack that reads one it did not declare gets a ``KeyError``
    saying so.
    """

    model: Any
    examples: list  # list[Example]: the evaluated examples (all valid, >= 2 tokens)
    settings: ScoringSettings = dataclasses.field(default_factory=ScoringSettings)
    partitions: dict = dataclasses.field(default_factory=dict)  # name -> list[Example]
    options: dict = dataclasses.field(default_factory=dict)  # ref_model, mlm, seed, ...
    notes: list = dataclasses.field(default_factory=list)  # said to the user with the results
    stat_names: Optional[tuple] = None
    _stats: Optional[list] = None
    _padded: Optional[dict] = None

    @property
    def seed(self) -> int:
        return int(self.options.get("seed", 0))

    def stats(self) -> list:
        """Per-example token stats (list of {stat: [T_i-1]} for each of ``stat_names``), computed once per run (and
        cached on disk)."""
        if self._stats is None:
            self._stats = compute_token_stats(self.model, [e.tokens for e in self.examples], self.settings,
                                              stats=canonical_stats(self.stat_names))
        return self._stats

    def padded(self, fields=()) -> dict:
        """Token stats stacked as [N, L] float32 arrays plus ``mask`` [N, L] bool, and the host fields among
        ``fields`` (``HOST_FIELDS``, made on first request)."""
        if self._padded is None:
            got = self.stats()
            self._padded = _Fields(pad_stats(got, [s for s in STAT_NAMES if got and s in got[0]] if got else ()))
        for f in fields:
            if f in HOST_FIELDS and f not in self._padded:
                self._padded[f] = target_is_eos([e.tokens for e in self.examples], self.eos_ids(required=False),
                                                self._padded["mask"].shape[1])
        return self._padded

    def eos_ids(self, required: bool = True) -> tuple:
        """The model's end-of-document token id(s) from its config (every id when it is a list); with ``required``,
        an ``AttackError`` when it has none, else ()."""
        eos = getattr(getattr(self.model, "config", None), "eos_token_id", None)
        ids = tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None)
        if not ids and required:
            raise AttackError("skip_eos=true: the model config has no eos_token_id")
        return ids

    def stats_for(self, examples: list, desc: str = "scoring", stats: tuple = ("logprob",)) -> list:
        """Token stats ``stats`` of other examples than the evaluated ones (prefixes, calibration texts)."""
        return compute_token_stats(self.model, [e.tokens for e in examples], self.settings, desc=desc, stats=stats)

    def texts(self, examples: Optional[list] = None) -> list:
        """Texts of examples; token-only examples are decoded once with the model's tokenizer (noted in the output)."""
        examples = self.examples if examples is None else examples
        out = []
        decoded = 0
        for e in examples:
            if e.text is not None and not e.truncated:
                out.append(e.text)
                continue
            if self.model.tokenizer is None:
                raise AttackError("this attack needs text, but the examples are token ids and the model has no "
                                  "tokenizer")
            out.append(self.model.tokenizer.decode(e.tokens.tolist()))
            decoded += 1
        if decoded:
            note = (f"{decoded} example(s) were token ids (or truncated) and were decoded with the target "
                    f"tokenizer for text-based steps")
            if note not in self.notes:
                self.notes.append(note)
        return out

    def partition(self, name: str, min_size: int = 1, flag: str = "") -> list:
        """Examples of a learned-from partition; a clear error when missing or too small."""
        part = self.partitions.get(name) or []
        if len(part) < min_size:
            how = f" (give {flag} FILE or a split with a '{name}' partition)" if flag else ""
            raise AttackError(f"needs at least {min_size} '{name}' example(s), got {len(part)}{how}")
        return part

    def labels(self) -> np.ndarray:
        return np.array([-1 if e.label is None else e.label for e in self.examples])


def eos_ids_if_skipping(ctx: AttackContext, *, skip_eos: bool = False, **_) -> None:
    """A ``register_stats`` check: ``skip_eos=true`` needs the model's end-of-document id (``AttackError`` else)."""
    if skip_eos:
        ctx.eos_ids()


class _Fields(dict):
    """The padded arrays; a missing one names what the attack should have declared."""

    def __missing__(self, key):
        raise KeyError(f"token field {key!r} was not computed in this run: the attack that reads it must name it in "
                       f"its registration's stats=")


def target_is_eos(tokens_list: list, ids: tuple, width: int) -> np.ndarray:
    """[N, width] bool: position j predicts token j + 1 and that token is one of ``ids`` (padded False)."""
    out = np.zeros((len(tokens_list), width), bool)
    for i, t in enumerate(tokens_list):
        tgt = np.asarray(t)[1 : width + 1]
        out[i, : len(tgt)] = np.isin(tgt, ids)
    return out


def assert_disjoint(evaluated: list, learned: list, what: str) -> None:
    """Refuse to evaluate examples that an attack learns from: the same id, the same token ids or the same text.
    The one disjointness rule of mia (``mia.score`` applies it to every learned-from partition, attacks to the
    prefixes they build). ``AttackError`` names the evaluated examples that clash."""
    learned_keys = {k for e in learned for k in disjointness_keys(e)}
    clash = sorted({str(_field(e, "id")) for e in evaluated if any(k in learned_keys for k in disjointness_keys(e))})
    if clash:
        shown = ", ".join(clash[:10]) + (" ..." if len(clash) > 10 else "")
        raise AttackError(f"{what} overlaps the evaluated examples ({len(clash)}): {shown}")
