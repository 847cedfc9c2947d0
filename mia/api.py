"""mia's Python API: load a model, score examples with attacks, read the result.

    import mia
    model = mia.load("path/to/model")                        # a local Hugging Face-layout directory
    run = mia.score(model, "data.jsonl", attacks="loss,mink:k=0.2,zlib")
    print(run.metrics())                                      # AUC ± SE, TPR@1%/0.1%FPR per attack
    run.write("scores.jsonl")                                 # one line per example (docs/formats.md)

``mia score`` (the CLI), the experiments and the notebooks all go through ``score``. Every score: higher = more
likely member; labels: 1 member, 0 non-member.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from .attacks.context import AttackContext, assert_disjoint
from .attacks.registry import (AttackError, AttackInputs, check_attack_inputs, check_params, get, parse_attacks,
                               stats_read_by)
from .data import sources
from .data.examples import (LEARNED_PARTITIONS, DataError, Example, check_document_conflicts, check_label_conflicts,
                            tokenize_examples)
from .data.freq_corpus import read_corpus
from .documents import chunk_examples
from .engine.batching import ScoringSettings
from .sharding import make_mesh, parse_mesh
from .files import cache_limit
from .doctor import CHECKS as DOCTOR_CHECKS, doctor as run_doctor
from .files.hashing import check_cache_dir
from .models.hub import Model
from .models.hub import load as load_checkpoint
from .results import ScoreRun



def load(path, *, dtype: str = "auto", param_dtype: Optional[str] = None, mesh=None, fsdp: Optional[bool] = None,
         tokenizer: bool = True, adapter=None) -> Model:
    """A local checkpoint directory (config.json, safetensors, tokenizer.json) as a ``Model``.

    ``adapter``: a PEFT LoRA adapter directory fine-tuned from this base, merged into its weights at load
    (docs/models.md#adapters); the base is then the default reference model of ``ref``, ``ez_mia`` and ``wbc``.

    ``dtype``: "auto" (float32 on a CPU, bfloat16 on a GPU/TPU), "float32", "bfloat16" or "float16"
    (docs/models.md#precision; log-probs are float32 whatever it is);
    ``mesh``: None (every device on ``data``, parameters replicated), a ``jax.sharding.Mesh``, or a string such as
    ``"data=2,model=4"``; ``fsdp``: shard parameters over ``data`` too (default: with an explicit mesh).
    """
    if isinstance(mesh, str):
        mesh = make_mesh(parse_mesh(mesh, len(jax.devices())))
    return load_checkpoint(path, dtype=dtype, param_dtype=param_dtype, tokenizer=tokenizer, mesh=mesh, fsdp=fsdp,
                           adapter=adapter)


def resolve_attacks(attacks) -> list[tuple[str, str, dict]]:
    """``"loss,mink:k=0.2"``, a list of such strings, or ``[(label, name, params)]`` -> checked (label, name,
    params) triples with defaults filled in (``AttackError`` on an unknown name, parameter or value)."""
    if isinstance(attacks, str):
        return parse_attacks(attacks)
    out: list = []
    for item in attacks:
        if isinstance(item, str):
            out += parse_attacks(item)
        else:
            label, name, params = item
            out.append((label, name, check_params(name, params)))
    labels = [label for label, _, _ in out]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise AttackError(f"attacks: {', '.join(twice)} given twice")
    if not out:
        raise AttackError("attacks: no attack named; `mia attacks` lists them")
    return out


def read_data(data, what: str = "data", partitions: Optional[Sequence[str]] = None, *,
              column_map: Optional[dict] = None, id_prefix: str = "", require_columns: bool = True) -> list[Example]:
    """Checked ``Example``s (copies: the caller's objects are never modified) from data in any common form: a JSONL,
    JSON (an array of rows), CSV, TSV or Parquet file (any other suffix is refused), a directory saved by
    ``datasets``, a list of dicts ``{id?, text|tokens, label?, partition?, doc_id?}`` or ``Example``s, a pandas
    DataFrame, a ``datasets.Dataset``, a pyarrow Table, any iterable
    of dicts (``mia.data.sources``, docs/score.md#inputs). ``partitions``: the partition names allowed (None: any),
    so a misspelt one is an error, not a line left out; ``column_map``: field -> column (``{"text": "body"}``;
    ``require_columns``: every mapped column present); ``id_prefix``: before the positions that are the ids of data
    that give none."""
    return sources.read_data(data, what, partitions, column_map=column_map, id_prefix=id_prefix,
                             require_columns=require_columns)


def check_data(examples: list[Example], scored: Sequence[str] = ("eval",), skip_invalid: bool = False) -> None:
    """The label-conflict check (``check_label_conflicts``) on what is known before any model is loaded: the texts
    and the token ids as given of the ``scored`` examples. A line that may yet be set aside as unusable
    (``skip_invalid``: a text, which could tokenize to fewer than 2 tokens; always: an empty text or fewer than 2
    token ids) is left to the check after tokenizing. Raises ``DataError`` naming both lines."""
    def sure(e: Example) -> bool:
        if e.tokens is not None:
            return len(e.tokens) >= 2
        return not skip_invalid and e.text is not None and e.text != ""

    check_label_conflicts([e for e in examples if e.partition in scored and sure(e)])
    check_document_conflicts([e for e in examples if e.partition in scored and sure(e)])


def check_request(attacks, *, ref_model=None, mlm=None, freq_corpus=None, on_error: str = "raise") -> tuple:
    """(attacks to run, {label: reason} skipped) from what is known before any data are read or any model is
    loaded: names, parameters, and the model inputs (``ref_model``, ``mlm``) each attack needs."""
    chosen = resolve_attacks(attacks)
    return _check_inputs(chosen, AttackInputs(None, ref_model, mlm, freq_corpus), on_error)


def _check_inputs(chosen, inputs: AttackInputs, on_error: str) -> tuple:
    run, skipped = [], {}
    for label, name, params in chosen:
        try:
            check_attack_inputs(label, name, params, inputs)
        except AttackError as e:
            if on_error != "skip":
                raise
            skipped[label] = str(e).splitlines()[0]
            continue
        run.append((label, name, params))
    return run, skipped


def _learned(partitions: dict, given: dict, model: Model, max_length: int, notes: list,
             column_map: Optional[dict] = None) -> dict:
    """The learned-from partitions: those in the data, plus the ones given separately (in any form of
    ``read_data``), tokenized; lines unusable for scoring (fewer than 2 tokens) are left out of a partition given
    separately. Ids of a partition given without any are ``NAME:0``, ``NAME:1``, ... (so they never equal the
    evaluated examples' positions)."""
    out = {k: list(v) for k, v in partitions.items()}
    for name, source in given.items():
        if source is None:
            continue
        extra = read_data(source, what=f"--{name.replace('_', '-')}-data", column_map=column_map,
                          id_prefix=f"{name}:", require_columns=False)  # e.g. prefixes without the label column
        tokenize_examples(extra, model.tokenizer, max_length, True, model.vocab_size, notes=notes)
        out.setdefault(name, []).extend(e for e in extra if e.invalid is None)
    return out


def score(model, data, attacks="loss", *, prefix=None, member_prefix=None, calib=None, train=None,
          max_length: Optional[int] = None, skip_invalid: bool = False, seq_tokens: Optional[int] = None,
          scored: Sequence[str] = ("eval",), seed: int = 0, batch_tokens: int = 16384, cache: bool = True,
          cache_dir: Optional[str] = None, progress: bool = True, ref_model=None, mlm=None, freq_corpus=None,
          on_error: str = "raise", options: Optional[dict] = None, cache_max_gb: Optional[float] = None,
          pack: Optional[bool] = None, bucket_step: int = 128, column_map: Optional[dict] = None) -> ScoreRun:
    """Score the examples of ``data`` with ``attacks``; higher = more likely member.

    ``model``      a ``Model`` (``mia.load``) or a checkpoint directory
    ``data``       the examples, in any form of ``read_data``: a JSONL (or split), JSON, CSV, TSV or Parquet file,
                   a directory saved by ``datasets``, a list of dicts or ``Example``s, a pandas DataFrame, a
                   ``datasets.Dataset``, a pyarrow Table;
                   examples of the ``scored`` partitions (default ``eval``; a row without ``partition`` is ``eval``)
                   are scored, the others (``prefix``, ``member_prefix``, ``calib``, ``train``) are what attacks
                   learn from
    ``column_map`` field -> column of ``data`` (and of the learned-from data, where a mapped column may be
                   absent), e.g. ``{"text": "body", "label": "is_member"}``
    ``attacks``    ``"loss,mink:k=0.2,zlib"``, a list of such strings, or ``[(label, name, params)]``
    ``prefix`` ``member_prefix`` ``calib`` ``train``   more learned-from examples (any form of ``data``)
    ``max_length`` tokens kept per example (default and maximum: the model's context C + 1: a text's last token is
                   only predicted, so C + 1 tokens make C predictions at positions 0 .. C-1)
    ``skip_invalid``  set aside (and record) lines with fewer than 2 tokens instead of stopping
    ``seq_tokens`` cut each scored line into sequences of this many tokens (document-level inference)
    ``batch_tokens``  padded tokens per batch per data-parallel device (speed and memory only)
    ``pack``       several texts per row in the token-stats pass: None (auto: when it is estimated >= 5% cheaper,
                   not on a GPU; ``mia.engine.batching.packs_rows``), True or False (speed only: scores equal)
    ``bucket_step`` rows above this length are padded to multiples of it (0: powers of two; speed only)
    ``cache`` / ``cache_dir``  the on-disk score cache (default ``$MIA_CACHE_DIR`` or ``~/.cache/mia``)
    ``cache_max_gb``  the cache's size limit for this process (default ``$MIA_CACHE_MAX_GB`` or 5; least recently
                   used entries are evicted, ``mia.files.cache_limit``)
    ``ref_model`` / ``mlm`` / ``freq_corpus``  the extra inputs of ``ref``, ``neighbor``, ``dcpdd``
    ``on_error``   "raise" (default): a missing input or failing attack stops the run; "skip": it is recorded
                   in ``ScoreRun.skipped`` with its reason and the others go on

    Every learned-from example is checked disjoint from the scored ones (same id, tokens or text) before any
    attack runs. With several processes (``jax.distributed``), every process calls this with the same arguments.
    """
    if cache_max_gb is not None:
        cache_limit.set_max_gb(cache_max_gb)
    if ref_model is None and getattr(model, "adapter", None):  # a fine-tune's base is its default reference
        ref_model = model.path
    chosen, skipped = check_request(attacks, ref_model=ref_model, mlm=mlm, freq_corpus=freq_corpus,
                                    on_error=on_error)
    scored = tuple(scored)
    examples = read_data(data, partitions=scored + LEARNED_PARTITIONS, column_map=column_map)
    check_data(examples, scored, skip_invalid)  # cheap data checks before the model is loaded
    if not isinstance(model, Model):
        model = load(model)
    max_length = model.max_tokens if max_length is None else int(max_length)
    if not 2 <= max_length <= model.max_tokens:
        raise ValueError(f"--max-length {max_length}: must be in [2, {model.max_tokens}] (the model's context "
                         f"{model.max_length} + the last token, only predicted)")
    if seq_tokens is not None and not 2 <= seq_tokens <= model.max_tokens:
        raise ValueError(f"--seq-tokens {seq_tokens}: must be in [2, {model.max_tokens}] (the model's context "
                         f"{model.max_length} + the last token, only predicted)")
    notes: list = []
    if model.compute_dtype != "float32":
        notes.append(f"the model computes in {model.compute_dtype} (float32 log-probs from {model.compute_dtype} "
                     "layers; load it with dtype='float32' / --dtype float32 for float32 throughout)")
    if seq_tokens:  # whole lines first, then the pieces
        whole = [e for e in examples if e.partition in scored]
        for e in whole:
            e.doc_id = e.id if e.doc_id is None else e.doc_id
        tokenize_examples(whole, model.tokenizer, None, skip_invalid, model.vocab_size, notes=notes)
        check_label_conflicts(whole, notes)
        rest = [e for e in examples if e.partition not in scored]
        tokenize_examples(rest, model.tokenizer, max_length, skip_invalid, model.vocab_size, notes=notes)
        examples = chunk_examples(examples, seq_tokens, scored)
    else:
        tokenize_examples(examples, model.tokenizer, max_length, skip_invalid, model.vocab_size, notes=notes)
        check_label_conflicts([e for e in examples if e.partition in scored], notes)
        check_document_conflicts([e for e in examples if e.partition in scored])
    rows = [e for e in examples if e.partition in scored]
    evaluated = [e for e in rows if e.invalid is None]
    if not evaluated:
        raise DataError(f"{_describe(data)}: no valid examples in the scored partition(s) {', '.join(scored)}")
    in_data: dict = {}
    for e in examples:
        if e.partition not in scored and e.invalid is None:
            in_data.setdefault(e.partition, []).append(e)
    partitions = _learned(in_data, {"prefix": prefix, "member_prefix": member_prefix, "calib": calib,
                                    "train": train}, model, max_length, notes, column_map)
    chosen, late = _check_inputs(chosen, AttackInputs(partitions, ref_model, mlm, freq_corpus), on_error)
    skipped.update(late)
    for name, part in partitions.items():
        assert_disjoint(evaluated, part, f"partition {name!r}")
    settings = ScoringSettings(token_budget=batch_tokens, progress=progress, pack=pack, bucket_step=bucket_step,
                               cache_dir=str(check_cache_dir(cache_dir, "cache_dir" if cache_dir else None))
                               if cache else None)
    opts = {"seed": seed, "ref_model": ref_model, "mlm": mlm, "max_length": max_length, **(options or {})}
    if isinstance(freq_corpus, (str, Path)):
        opts["freq_corpus"] = read_corpus(freq_corpus, model.tokenizer, model.vocab_size)
    elif freq_corpus is not None:
        opts["freq_corpus"] = freq_corpus
    ctx = AttackContext(model, evaluated, settings, partitions, opts)
    scores, seconds = run_attacks(ctx, chosen, skipped, on_error, progress)
    return ScoreRun(evaluated, scores, seconds, skipped, notes + ctx.notes, rows, ctx)


def run_attacks(ctx: AttackContext, chosen, skipped: dict, on_error: str = "raise",
                progress: bool = True) -> tuple[dict, dict]:
    """({label: [N] float64 scores}, {label: seconds}) of each attack on ``ctx``; with ``on_error="skip"`` an
    attack that raises ``AttackError`` is recorded in ``skipped`` instead."""
    scores, seconds = {}, {}
    if ctx.stat_names is None and ctx._stats is None:  # the one scoring pass computes what these attacks read
        ctx.stat_names = stats_read_by([name for _, name, _ in chosen]) or None
    bar = tqdm(chosen, desc="attacks", unit="attack", leave=False,
               disable=not progress or len(chosen) < 2 or jax.process_index() != 0)
    for label, name, params in bar:
        bar.set_postfix(attack=label)
        t0 = time.perf_counter()
        try:
            s = np.asarray(get(name).fn(ctx, **params), dtype=np.float64)
        except AttackError as e:
            if on_error != "skip":
                raise
            skipped[label] = str(e).splitlines()[0]
            continue
        if s.shape != (len(ctx.examples),):
            raise AssertionError(f"attack {name} returned shape {s.shape}, expected ({len(ctx.examples)},)")
        scores[label] = s
        seconds[label] = round(time.perf_counter() - t0, 3)
    return scores, seconds


def _describe(data) -> str:
    return str(data) if isinstance(data, (str, Path)) else "data"


def doctor(*, checks=None, families=None, progress=None):
    """``mia doctor`` as data: run the checks (``mia.doctor.CHECKS``: platform, attention, mesh, cache, speed,
    precision; a subset by name) on the registered model families (or ``families``) and return the
    ``mia.doctor.DoctorReport``: ``report.ok``, ``report.first_failure``, ``report.rows`` (check, result, value,
    tolerance, ok), ``report.table()``, ``report.to_json()``. docs/doctor.md."""
    return run_doctor(checks=DOCTOR_CHECKS if checks is None else checks, families=families, progress=progress)


__all__ = ["load", "score", "doctor", "resolve_attacks", "read_data", "check_data", "check_request", "run_attacks",
           "ScoreRun", "Model", "LEARNED_PARTITIONS"]
