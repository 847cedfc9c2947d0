"""Blind classifiers (CheckMIABench App. A): logistic regression, random forest and a small MLP in JAX/optax.

``fit_predict(name, x_train, y_train, x_eval, seed=...)`` returns P(member) for each evaluation example
(HIGHER = MEMBER; the paper's code outputs −P(member) and negates it again in ``plot_ROC``, the same ranking).

- ``lr``: StandardScaler, then LogisticRegression(lbfgs, L2, C=1, max_iter=1000).
- ``rf``: RandomForestClassifier(100 trees, gini, no depth limit), seeded, one job (no scaler: trees ignore scale).
- ``mlp``: StandardScaler, then in → 250 → 100 → 10 → 1 with ReLU, sigmoid BCE loss, Adam(1e-3), 10 epochs,
  batch 128, shuffled each epoch from ``seed``. Sparse features (BoW, TF-IDF) enter the first layer as an embedding
  bag, never densified.
Sparse inputs are scaled without centring (``with_mean=False``), which keeps them sparse.
The paper's classifier module is not public: C = 1, the scaler and the NN loss are UNCONFIRMED
(docs/algorithms.md#blind).
"""
from __future__ import annotations

import functools
import warnings
from typing import Sequence

import numpy as np
import scipy.sparse as sp

CLASSIFIER_NAMES = ("lr", "rf", "mlp")
DISPLAY = {"lr": "LR", "rf": "RF", "mlp": "MLP"}


class ClassifierError(ValueError):
    pass


def _scale(x_train, x_eval):
    from sklearn.preprocessing import StandardScaler

    sc = StandardScaler(with_mean=not sp.issparse(x_train))
    return sc.fit_transform(x_train), sc.transform(x_eval)


def logistic_regression(x_train, y_train, x_eval, *, seed: int = 0) -> np.ndarray:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    xt, xe = _scale(x_train, x_eval)
    clf = LogisticRegression(solver="lbfgs", C=1.0, max_iter=1000, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(xt, y_train)
    return clf.predict_proba(xe)[:, list(clf.classes_).index(1)]


def random_forest(x_train, y_train, x_eval, *, seed: int = 0) -> np.ndarray:
    from sklearn.ensemble import RandomForestClassifier

    clf = RandomForestClassifier(n_estimators=100, criterion="gini", max_depth=None, random_state=seed, n_jobs=1)
    clf.fit(x_train, y_train)
    return clf.predict_proba(x_eval)[:, list(clf.classes_).index(1)]


@functools.lru_cache(maxsize=8)
def _mlp_fns(hidden: tuple, lr: float):
    """(model, optimizer, jitted dense step, jitted sparse step, jitted dense and sparse P(member) predictors, jitted
    init) shared by every call with these hyperparameters, so that jax reuses its compiled programs for shapes it has
    already seen.

    The sparse path is the same network: its first Dense layer is computed as an embedding bag,
    x @ W = sum_j x[c_j] W[c_j] over the row's non-zero columns c_j (padded with value 0), so a 50k-word
    vocabulary never gets densified.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from ..sharding import loop_compiler_options  # local, as jax: mia.blind loads without it

    class MLP(nn.Module):
        def setup(self):
            self.layers = [nn.Dense(h) for h in hidden] + [nn.Dense(1)]

        def __call__(self, x):
            return self.rest(self.layers[0](x))

        def rest(self, h):
            for layer in self.layers[1:]:
                h = layer(nn.relu(h))
            return h[..., 0]

    model, opt = MLP(), optax.adam(lr)

    def first_sparse(p, cols_bl, vals_bl):
        w = p["layers_0"]
        return jnp.einsum("bl,blh->bh", vals_bl, w["kernel"][cols_bl]) + w["bias"]

    def logits_dense(p, xb):
        return model.apply({"params": p}, xb)

    def logits_sparse(p, xb):
        return model.apply({"params": p}, first_sparse(p, *xb), method=MLP.rest)

    # a training loop runs its step many times (at level 0 the sparse step ran 8x slower: 0.6 vs 0.08 s a fit of
    # 300 BoW rows)
    options = loop_compiler_options()

    def make_step(logits_fn):
        @functools.partial(jax.jit, compiler_options=options)
        def step(params, state, xb, yb, wb):
            def loss_fn(p):
                return (optax.sigmoid_binary_cross_entropy(logits_fn(p, xb), yb) * wb).sum() / jnp.maximum(wb.sum(), 1)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    @jax.jit
    def init(key, x_1d):
        """(params, optimizer state) of a network reading ``d`` features (x_1d: [1, d]): one program per d, where
        running flax's init and Adam's init op by op compiled each of their operations per shape."""
        params = model.init(key, x_1d)["params"]
        return params, opt.init(params)

    def make_predict(logits_fn):
        return jax.jit(lambda p, xb: jax.nn.sigmoid(logits_fn(p, xb)))

    return (model, opt, make_step(logits_dense), make_step(logits_sparse), make_predict(logits_dense),
            make_predict(logits_sparse), init)


def _padded_rows(x: sp.csr_matrix, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CSR rows -> (columns [N, L] int32, values [N, L] float32), zero-padded (column 0, value 0: adds nothing) to
    L = the max non-zeros per row rounded up to a power of two, so that the folds and feature sets of one run share
    a few compiled steps instead of one per exact width."""
    x = sp.csr_matrix(x)
    nnz = np.diff(x.indptr)
    width = 1 << (max(width, int(nnz.max()) if len(nnz) else 0, 1) - 1).bit_length()
    cols = np.zeros((x.shape[0], width), np.int32)
    vals = np.zeros((x.shape[0], width), np.float32)
    for i in range(x.shape[0]):
        lo, hi = x.indptr[i], x.indptr[i + 1]
        cols[i, : hi - lo] = x.indices[lo:hi]
        vals[i, : hi - lo] = x.data[lo:hi]
    return cols, vals


def mlp(x_train, y_train, x_eval, *, seed: int = 0, epochs: int = 10, batch_size: int = 128, lr: float = 1e-3,
        hidden: Sequence[int] = (250, 100, 10)) -> np.ndarray:
    """in -> 250 -> 100 -> 10 -> 1 (ReLU), BCE on logits, Adam; returns sigmoid(logit) = P(member)."""
    import jax
    import jax.numpy as jnp

    xt, xe = _scale(x_train, x_eval)
    y = np.asarray(y_train, np.float32)
    n, d = xt.shape
    _, _, step_dense, step_sparse, predict_dense, predict_sparse, init = _mlp_fns(tuple(hidden), float(lr))
    key = jax.random.PRNGKey(seed)
    key, init_key = jax.random.split(key)
    params, state = init(init_key, jnp.zeros((1, d), jnp.float32))
    sparse = sp.issparse(xt)
    if sparse:
        xt = _padded_rows(xt)
        xe = _padded_rows(xe)
        take = lambda x, idx: (x[0][idx], x[1][idx])  # noqa: E731
        step, predict = step_sparse, predict_sparse
    else:
        xt, xe = np.asarray(xt, np.float32), np.asarray(xe, np.float32)
        take = lambda x, idx: x[idx]  # noqa: E731
        step, predict = step_dense, predict_dense

    b = min(batch_size, n)
    for _ in range(epochs):
        key, sub = jax.random.split(key)
        perm = np.asarray(jax.random.permutation(sub, n))
        for lo in range(0, n, b):
            idx = perm[lo: lo + b]
            w = np.ones(b, np.float32)
            if len(idx) < b:  # pad the last batch (zero weight) so that one shape is compiled
                w[len(idx):] = 0
                idx = np.concatenate([idx, np.zeros(b - len(idx), idx.dtype)])
            params, state, _ = step(params, state, take(xt, idx), y[idx], w)
    # prediction in bounded chunks of one row count (the last one padded with repeats of row 0), so that an
    # evaluation set compiles one program per feature width whatever its size
    n_eval = len(xe[0]) if sparse else len(xe)
    width = xe[0].shape[1] if sparse else d
    rows = min(max(1, (1 << 22) // max(width, 1)), 4096, 1 << max(3, (max(n_eval, 1) - 1).bit_length()))
    out = []
    for lo in range(0, n_eval, rows):
        idx = np.arange(lo, lo + rows)
        idx[idx >= n_eval] = 0
        out.append(np.asarray(predict(params, take(xe, idx)))[: min(rows, n_eval - lo)])
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0)


_FNS = {"lr": logistic_regression, "rf": random_forest, "mlp": mlp}


def fit_predict(name: str, x_train, y_train, x_eval, *, seed: int = 0) -> np.ndarray:
    """Train classifier ``name`` on (x_train, y_train); return P(member) for x_eval."""
    if name not in _FNS:
        raise ClassifierError(f"unknown classifier {name!r}; known: {', '.join(CLASSIFIER_NAMES)}")
    y = np.asarray(y_train)
    if len(np.unique(y)) < 2:
        raise ClassifierError("the training set has one class only; need members (1) and non-members (0)")
    return np.asarray(_FNS[name](x_train, y, x_eval, seed=seed), np.float64)
