"""CAMIA (Chang et al., "Context-Aware Membership Inference Attacks against Pre-trained LLMs").
docs/algorithms.md#camia.

75 signals in 11 groups per example (``FEATURE_NAMES``, ``FEATURE_GROUPS``; definitions in ``camia_signals``):
  7 keys {loss, ppl, count_above, lz, count_mean, cal_loss, cal_ppl} x 3 variants x {base, Rep1, Rep2}  = 63
  token_diversity, slope, ApEn, count_above_pre (CBPM), 3 variants each                                = 12
Rep1 = key(copy_0) - key(copy_1), Rep2 = key(copy_0) - key(copy_2), where the copies are located in one pass over the
6x repeated text ``X + (" " + X) * 5`` (``locate_copies``); slope and ApEn use that pass's whole log-prob series.
Repeated texts longer than the context the model was trained at (``Model.max_length``, or a smaller --max-length) are
scored with mimir's sliding window (window = context, stride = half), so no position beyond it is used (noted).

Orientation (label-free, the paper's hypotheses; smaller = member after it): negate loss, cal_loss, slope (code values
are log-probs; the paper's units are losses) and CB, CBM, CBPM (higher = member); keep ppl, cal_ppl, LZ, ApEn. Rep
differences take their base key's sign. token_diversity is UNCONFIRMED in the sources; we default to LOWER diversity =
member (``diversity="low"``): repetitive texts have low loss (the paper's reason for f_Cal), so low diversity points
the same way as the loss signals; ``diversity="high"`` flips it. (The official code orients every key with the
ground-truth labels of the whole dataset; we do not, as that leaks labels.)

``orient=train`` (``camia`` and ``camia_lr``) learns the orientation instead from a labelled ``train`` partition
(--train-data), disjoint from the evaluated examples, with the official code's rule applied to those training rows
only (``train_orientation``): the 75 signals form 25 blocks of 3 (each base key, its Rep1 and Rep2 differences,
token_diversity, slope, ApEn, CBPM: ``FEATURE_BLOCKS``); a block is negated when the mean of its raw values over the
training members is above that over the training non-members (``run_ours_different_agg.py``: ``if f.T[y == 1].mean()
> f.T[y == 0].mean(): f = -f``), rows with an undefined signal left out. ``diversity`` then does not apply.

``camia``: each signal's empirical p-value against a calibration set of non-members (partition "calib" /
--calib-data), p = percentileofscore(calib, f, kind='rank')/100 (the code's form; the paper's is #<= / M, equal
without ties), combined over the 75 signals by ``method``:
  edgington  mean p (the code's "agg"; the sum p_E ranks identically)
  fisher / pearson / george  scipy.stats.combine_pvalues (george = 'mudholkar_george'), after replacing exact p = 0
             by 1e-10 and p = 1 by 1 - 1e-10.
Score = -p_combined: HIGHER = MEMBER. The calibration set must hold at least ``min_calib`` (default 10, never less
than 10) examples whose 75 signals are all defined: p-values then live on a grid of 1/(2M) <= 1/20. (The official
protocol calibrates on 30% of the non-members, 18 on a 60-non-member set; a default of 20 refused that.)

``camia_lr``: logistic regression on group-PCA features (App. B), trained on the labelled "train" partition
(--train-data): per group PCA(components) fitted on the training columns (centred, not scaled), concatenated;
LogisticRegression(solver='liblinear', max_iter=5000); score = predict_proba[:, 1] (higher = member). The paper's best
is components = 2 (Table 14); the released script uses 1.

On precomputed signals the same math is ``pvalue_scores`` and ``group_pca_lr_scores`` (pure; the registered
attacks call them, and ``experiments/camia.py`` calls them once per calibration draw on signals computed once).

Examples whose signals cannot all be computed (fewer than 4 tokens, or copies not found in the repeated text) get a
NaN score and a note. sklearn and scipy are imported lazily (host-side statistics only).
"""
from __future__ import annotations

import numpy as np

from ..engine.batching import ScoringSettings, row_length
from ..engine.cache import example_key
from ..engine.loop import compute_token_stats
from ..engine.plan import register_planned_attack, token_stats_steps
from . import camia_signals as cs
from .fit import add_note
from .registry import AttackError, register
from ..validate import Range

KEYS = ("loss", "ppl", "count_above", "lz", "count_mean", "cal_loss", "cal_ppl")
GROUPS = KEYS + ("token_diversity", "slope", "apen", "count_above_pre")
_CUT_NAMES = ("T*", "200", "300")
_VARIANTS = {
    "loss": _CUT_NAMES, "ppl": _CUT_NAMES, "count_above": tuple(f"tau{t}" for t in cs.TAUS),
    "lz": tuple(f"bins{b}" for b in cs.LZ_BINS), "count_mean": _CUT_NAMES, "cal_loss": _CUT_NAMES,
    "cal_ppl": _CUT_NAMES, "token_diversity": _CUT_NAMES, "slope": tuple(str(c) for c in cs.REP_CUTS),
    "apen": tuple(str(c) for c in cs.REP_CUTS), "count_above_pre": ("inf", "200", "300"),
}
# +1: smaller = member already; -1: negate. token_diversity is set by the `diversity` parameter.
_SIGN = {"loss": -1, "ppl": 1, "count_above": -1, "lz": 1, "count_mean": -1, "cal_loss": -1, "cal_ppl": 1,
         "token_diversity": 1, "slope": -1, "apen": 1, "count_above_pre": -1}


def _feature_blocks() -> np.ndarray:
    """[75] block id (0..24) of each signal: consecutive triples of FEATURE_NAMES (one key, one part)."""
    return np.repeat(np.arange(25), 3)


def _feature_table():
    names, groups = [], []
    for g, key in enumerate(GROUPS):
        parts = ("", "rep1_", "rep2_") if key in KEYS else ("",)
        for part in parts:
            for v in _VARIANTS[key]:
                names.append(f"{part}{key}@{v}")
                groups.append(g)
    return tuple(names), np.array(groups)


FEATURE_NAMES, FEATURE_GROUPS = _feature_table()
FEATURE_BLOCKS = _feature_blocks()
assert len(FEATURE_NAMES) == 75 and len(GROUPS) == 11
assert all(len({n.split("@")[0] for n, b in zip(FEATURE_NAMES, FEATURE_BLOCKS) if b == k}) == 1 for k in range(25))
ORIENTS = ("label_free", "train")
METHODS = ("edgington", "fisher", "pearson", "george")
MIN_CALIB_FLOOR = 10
REPEATS = 6


def _planned_camia(model, mesh, shardings, params, batch, length):
    """``mia plan --attack camia``: the token-stats pass over the repeated text, ``REPEATS`` copies of a
    ``length``-token text (about REPEATS x length tokens), scored in windows of the model context (+ 1 token, only
    predicted) when longer, padded to the engine's bucket."""
    settings = ScoringSettings()
    t = row_length(min(REPEATS * length, model.max_tokens), settings.min_bucket, settings.bucket_step)
    return token_stats_steps("camia", model, mesh, shardings, params, batch, t, stats=("logprob",))


register_planned_attack("camia", _planned_camia, describe=lambda o: "CAMIA repeated-text token stats", per_step=True)


def repeated_text(text: str) -> str:
    """X + (" " + X) * 5: six copies."""
    return text + (" " + text) * (REPEATS - 1)


def orientation(diversity: str = "low") -> np.ndarray:
    """[75] signs that make every raw signal smaller = member."""
    if diversity not in ("low", "high"):
        raise AttackError(f"attack camia: diversity must be 'low' or 'high' (the member-like token diversity), "
                          f"got {diversity!r}")
    sign = dict(_SIGN, token_diversity=1 if diversity == "low" else -1)
    return np.array([sign[GROUPS[g]] for g in FEATURE_GROUPS], np.float64)


def train_orientation(f_raw: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[75] signs learned from labelled RAW signals ``f_raw`` [M, 75] and labels ``y`` [M] (1 = member): per block of
    3 (``FEATURE_BLOCKS``), -1 when the members' mean over the block's values exceeds the non-members', else +1 (the
    official code's rule, here on training rows only). Rows with an undefined signal are left out."""
    f = np.asarray(f_raw, np.float64)
    keep = np.isfinite(f).all(axis=1)
    f, y = f[keep], np.asarray(y)[keep]
    if not ((y == 1).any() and (y == 0).any()):
        raise AttackError(f"attack camia: orient=train needs training members and non-members with all 75 signals; "
                          f"got {int((y == 1).sum())} member(s), {int((y == 0).sum())} non-member(s)")
    sign = np.ones(f.shape[1])
    for b in np.unique(FEATURE_BLOCKS):
        cols = FEATURE_BLOCKS == b
        if f[y == 1][:, cols].mean() > f[y == 0][:, cols].mean():
            sign[cols] = -1.0
    return sign


def labelled_train(ctx, attack: str) -> list:
    """The 'train' partition's examples labelled 0/1; an error unless both classes are there."""
    train = [e for e in (ctx.partitions.get("train") or []) if e.label in (0, 1)]
    counts = [sum(e.label == c for e in train) for c in (0, 1)]
    if min(counts) == 0:
        raise AttackError(f"attack {attack} needs a labelled 'train' partition with both members and non-members "
                          f"(give --train-data FILE with label 0/1); got {counts[1]} member(s), "
                          f"{counts[0]} non-member(s)")
    return train


def signal_orientation(ctx, attack: str, orient: str, diversity: str) -> np.ndarray:
    """[75] signs: the label-free default (``orientation(diversity)``) or learned from the train partition."""
    if orient not in ORIENTS:
        raise AttackError(f"attack {attack}: orient must be one of {', '.join(ORIENTS)}; got {orient!r}")
    if orient == "label_free":
        return orientation(diversity)
    train = labelled_train(ctx, f"{attack}:orient=train")
    f_tr = features(ctx, train, ctx.stats_for(train, desc="camia: training"), "training")
    add_note(ctx, f"{attack}: signal orientation learned from {len(train)} labelled 'train' example(s) "
                  f"(the official per-block mean rule); diversity={diversity} not used")
    return train_orientation(f_tr, np.array([e.label for e in train]))


# ------------------------------------------------------------------------------------------------ signals
def repeated_logprobs(model, rep_id_lists, settings, max_length: int) -> list:
    """Log-prob series of each repeated text (mimir's sliding window when longer than ``max_length``)."""
    plans = [cs.window_plan(len(r), max_length) for r in rep_id_lists]
    windows = [np.asarray(r[b:e], np.int32) for r, plan in zip(rep_id_lists, plans) for b, e, _ in plan]
    stats = compute_token_stats(model, windows, settings, desc="camia: repeated texts", stats=("logprob",))
    out, j = [], 0
    for plan in plans:
        parts = []
        for _, _, keep in plan:
            lp = stats[j]["logprob"]
            parts.append(lp[len(lp) - keep:])
            j += 1
        out.append(np.concatenate(parts).astype(np.float32))
    return out


def raw_features(x_list, ids_list, xrep_list, copies_list) -> np.ndarray:
    """[N, 75] signals in the code's units (not yet oriented), in the order of FEATURE_NAMES.

    x_list: original log-prob series (T-1); ids_list: original token ids (T); xrep_list: the repeated text's series;
    copies_list: per example a list of three copy series (copy_0, copy_1, copy_2), or None (row becomes NaN).
    """
    n = len(x_list)
    ok = np.array([c is not None for c in copies_list])
    copies = [c if c is not None else [x, x, x] for c, x in zip(copies_list, x_list)]
    series = list(x_list) + [c[k] for k in range(3) for c in copies]  # 4N rows: base, copy_0, copy_1, copy_2
    f32, i32 = np.float32, np.int32
    keys = cs.map_rows(cs.series_keys, (series, f32)).astype(np.float64).reshape(4, n, 12)
    lz = np.array([[cs.lempel_ziv(s[:200], b) for b in cs.LZ_BINS] for s in series], np.float64).reshape(4, n, 3)
    orig = cs.map_rows(cs.original_keys, (x_list, f32), (ids_list, i32)).astype(np.float64)
    d, cbpm = orig[:, 0:3], orig[:, 3:6]
    rep = cs.map_rows(cs.repeat_keys, ([r[: max(cs.REP_CUTS)] for r in xrep_list], f32)).astype(np.float64)

    def key_block(s):  # s in 0..3 (base, copies) -> dict key -> [N, 3]
        k = keys[s]
        blk = {"loss": k[:, 0:3], "ppl": k[:, 3:6], "count_above": k[:, 6:9], "lz": lz[s], "count_mean": k[:, 9:12]}
        blk["cal_loss"] = blk["loss"] / d
        blk["cal_ppl"] = blk["ppl"] / d
        return blk

    base, c0, c1, c2 = (key_block(s) for s in range(4))
    cols = []
    for key in KEYS:
        cols += [base[key], c0[key] - c1[key], c0[key] - c2[key]]
    cols += [d, rep[:, 0:3], rep[:, 3:6], cbpm]
    out = np.concatenate(cols, axis=1)
    out[~ok] = np.nan
    return out


def features(ctx, examples, stats, what: str) -> np.ndarray:
    """[N, 75] raw signals of ``examples`` (memoized on the context by token content)."""
    memo = ctx.options.setdefault("_camia_features", {})
    key = tuple(example_key(e.tokens) for e in examples)
    if key in memo:
        return memo[key]
    tok = ctx.model.tokenizer
    if tok is None:
        raise AttackError("attack camia: the model directory has no tokenizer (needed to tokenize the repeated text)")
    texts = ctx.texts(examples)
    rep_ids = [np.asarray(tok(repeated_text(t))["input_ids"], np.int32) for t in texts]
    max_length = int(ctx.options.get("max_length") or ctx.model.max_tokens)
    xrep = repeated_logprobs(ctx.model, rep_ids, ctx.settings, max_length)
    windowed = sum(len(r) > max_length for r in rep_ids)
    if windowed:
        add_note(ctx, f"camia: {windowed} {what} repeated text(s) (6 copies) longer than the {max_length}-token "
                      f"context the model was trained at were scored with mimir's sliding window (window "
                      f"{max_length}, stride {max_length // 2}): no position beyond the context")
    x_list = [np.asarray(s["logprob"], np.float32) for s in stats]
    copies, failed = [], 0
    for e, r, xr in zip(examples, rep_ids, xrep):
        found = cs.locate_copies(e.tokens, r) if len(e.tokens) >= 4 else None
        if found is None:
            copies.append(None)
            failed += 1
            continue
        starts, length = found
        copies.append([xr[s - 1 : s - 1 + length] for s in starts])
    if failed:
        ctx.notes.append(f"camia: {failed} {what} example(s) have fewer than 4 tokens or their copies were not found "
                         f"in the repeated text; their signals are undefined (NaN)")
    out = raw_features(x_list, [np.asarray(e.tokens) for e in examples], xrep, copies)
    memo[key] = out
    return out


# ------------------------------------------------------------------------------------------------ combination
def combine(p_nf: np.ndarray, method: str) -> np.ndarray:
    """[N, F] p-values -> [N] combined p (small = member). edgington: mean p; others: scipy after clipping."""
    p = np.asarray(p_nf, np.float64)
    if method == "edgington":
        return p.mean(axis=1)
    from scipy.stats import combine_pvalues

    p = np.where(p == 0.0, 1e-10, np.where(p == 1.0, 1 - 1e-10, p))
    scipy_name = {"fisher": "fisher", "pearson": "pearson", "george": "mudholkar_george"}[method]
    return np.asarray(combine_pvalues(p, method=scipy_name, axis=1).pvalue, np.float64)


def _finite_rows(f: np.ndarray) -> np.ndarray:
    return np.isfinite(f).all(axis=1)


def pvalue_scores(f_eval: np.ndarray, f_cal: np.ndarray, method: str = "edgington") -> np.ndarray:
    """[N] CAMIA scores -p_combined (higher = member) of ORIENTED signals ``f_eval`` [N, 75] against the calibration
    non-members' oriented signals ``f_cal`` [M, 75] (rows with an undefined signal are left out of the calibration;
    an evaluated row with one gets NaN)."""
    if method not in METHODS:
        raise AttackError(f"attack camia: unknown method {method!r}; valid: {', '.join(METHODS)}")
    f_cal = f_cal[_finite_rows(f_cal)]
    ok = _finite_rows(f_eval)
    p = cs.empirical_pvalues(np.where(ok[:, None], f_eval, 0.0), f_cal)
    score = -combine(p, method)
    score[~ok] = np.nan
    return score


def group_pca_lr_scores(
    f_train: np.ndarray, y_train: np.ndarray, f_eval: np.ndarray, components: int = 2
) -> np.ndarray:
    """[N] P(member) of ``f_eval`` [N, 75] (oriented signals) from per-group PCA(components) + LogisticRegression
    (liblinear, max_iter 5000) trained on ``f_train`` [M, 75] with labels ``y_train`` [M] (App. B). Training rows
    with an undefined signal are dropped; an evaluated row with one gets NaN."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    if not 1 <= components <= 3:
        raise AttackError(f"attack camia_lr: components must be 1, 2 or 3 (the smallest group has 3 signals), "
                          f"got {components}")
    keep = _finite_rows(f_train)
    f_tr, y = f_train[keep], np.asarray(y_train)[keep]
    if len(set(y.tolist())) < 2 or len(y) < max(2, components):
        raise AttackError(f"attack camia_lr: after dropping examples with undefined signals, {len(y)} training "
                          f"example(s) remain ({int(y.sum())} member(s)); need both classes and at least "
                          f"{max(2, components)}")
    ok = _finite_rows(f_eval)
    with np.errstate(divide="ignore", invalid="ignore"):  # a constant group (zero variance) is harmless here
        pcas = [PCA(n_components=components).fit(f_tr[:, FEATURE_GROUPS == g]) for g in range(len(GROUPS))]

    def project(f):
        return np.concatenate([pca.transform(f[:, FEATURE_GROUPS == g]) for g, pca in enumerate(pcas)], axis=1)

    clf = LogisticRegression(solver="liblinear", max_iter=5000).fit(project(f_tr), y)
    score = np.full(len(f_eval), np.nan)
    if ok.any():
        score[ok] = clf.predict_proba(project(f_eval[ok]))[:, 1]
    return score


@register("camia", needs=("stats", "model", "text", "calib"), stats=("logprob",), cost="heavy",
          cost_note="~0.2 s per example on 2 CPU cores (75 context-aware signals incl. repeated-text passes)",
          method="edgington", min_calib=MIN_CALIB_FLOOR,
          diversity="low", orient="label_free",
          limits={"method": METHODS, "min_calib": Range(MIN_CALIB_FLOOR), "diversity": ("low", "high"),
                  "orient": ORIENTS})
def _camia(ctx, *, method: str, min_calib: int, diversity: str, orient: str = "label_free") -> np.ndarray:
    """CAMIA: 75 context-aware signals, p-values vs calibration non-members, combined; -p (higher = member).
    ``orient=train``: signal orientation learned from the labelled train partition (needs --train-data)."""
    if method not in METHODS:
        raise AttackError(f"attack camia: unknown method {method!r}; valid: {', '.join(METHODS)}")
    if min_calib < MIN_CALIB_FLOOR:
        raise AttackError(f"attack camia: min_calib must be at least {MIN_CALIB_FLOOR}, got {min_calib}")
    if orient not in ORIENTS:
        raise AttackError(f"attack camia: orient must be one of {', '.join(ORIENTS)}; got {orient!r}")
    calib = ctx.partition("calib", min_calib, flag="--calib-data")
    sign = signal_orientation(ctx, "camia", orient, diversity)
    f_eval = features(ctx, ctx.examples, ctx.stats(), "evaluated") * sign
    f_cal = features(ctx, calib, ctx.stats_for(calib, desc="camia: calibration"), "calibration") * sign
    n_cal = int(_finite_rows(f_cal).sum())
    if n_cal < min_calib:
        raise AttackError(f"attack camia: only {n_cal} of {len(calib)} calibration examples have all 75 signals; "
                          f"needs at least min_calib={min_calib}")
    return pvalue_scores(f_eval, f_cal, method)


@register(
    "camia_lr",
    needs=("stats", "model", "text", "train"), stats=("logprob",),
    cost="heavy",
    cost_note="CAMIA signals of the train partition too, ~0.2 s per example on 2 CPU cores",
    components=2,
    diversity="low",
    orient="label_free",
    limits={"components": Range(1, 3), "diversity": ("low", "high"), "orient": ORIENTS},
)
def _camia_lr(ctx, *, components: int, diversity: str, orient: str = "label_free") -> np.ndarray:
    """CAMIA signals -> per-group PCA -> logistic regression trained on labelled --train-data (higher = member)."""
    if not 1 <= components <= 3:
        raise AttackError(f"attack camia_lr: components must be 1, 2 or 3 (the smallest group has 3 signals), "
                          f"got {components}")
    train = labelled_train(ctx, "camia_lr")
    sign = signal_orientation(ctx, "camia_lr", orient, diversity)
    f_tr = features(ctx, train, ctx.stats_for(train, desc="camia: training"), "training") * sign
    f_ev = features(ctx, ctx.examples, ctx.stats(), "evaluated") * sign
    return group_pca_lr_scores(f_tr, np.array([e.label for e in train]), f_ev, components)
