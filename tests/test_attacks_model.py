"""Model-querying attacks (recall, em_mia, recall_avg, mope, ref, neighbor) against small NumPy references."""
import json
from itertools import combinations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mia.attacks import AttackError, em_mia as E, get
from mia.attacks.mope import build_mope_step, jitted_mope
from mia.data.examples import Example
from mia.engine.batching import ScoringSettings
from mia.engine.loop import engine_layout

from attack_helpers import WORDS, ctx_for, make_examples, np_ll
from hf_tiny import log_softmax


@pytest.fixture(scope="module")
def flax_logits(tiny_model):
    """(seq, params) -> [T, V] float64 logits of mia's model under other parameters (MoPe's perturbed copies)."""
    fn = jax.jit(tiny_model.logits)

    def logits(seq, params):  # one compiled shape (right padding is invisible to a causal model)
        tok, val = np.zeros((1, 256), np.int32), np.zeros((1, 256), bool)
        tok[0, :len(seq)], val[0, :len(seq)] = seq, True
        return np.asarray(fn(params, tok, val), np.float64)[0, :len(seq)]

    return logits


@pytest.fixture(scope="module")
def data(tiny_model):
    return make_examples(tiny_model.tokenizer, 8, 0)


# ------------------------------------------------------------------------------------------------ ReCaLL
def test_recall_matches_numpy(tiny_model, data, ref_logits):
    shots = make_examples(tiny_model.tokenizer, 12, 1, words=(2, 5), partition="prefix", prefix="p")
    ctx = ctx_for(tiny_model, data, shots)
    got = get("recall").fn(ctx, n=12, include_first=True)
    p = np.asarray(tiny_model.tokenizer("".join(e.text for e in shots))["input_ids"])
    want = [np_ll(ref_logits, np.concatenate([p, e.tokens]), start=len(p)) / np_ll(ref_logits, e.tokens) for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert any("12 shot(s) joined as text" in n for n in ctx.notes)
    # (include_first=False, em-mia's L-1 terms, is checked on the engine in test_conditional.py)


def test_recall_token_shots_and_overlength(tiny_model, data, ref_logits):
    rng = np.random.default_rng(5)
    shots = [Example(f"t{i}", tokens=rng.integers(1, 300, 30).astype(np.int32), partition="prefix") for i in range(12)]
    ctx = ctx_for(tiny_model, data, shots)
    got = get("recall").fn(ctx, n=12, include_first=True)
    room = 256 - max(len(e.tokens) for e in data)
    k = room // 30
    assert k < 12
    p = np.concatenate([e.tokens for e in shots[12 - k:]])  # the LAST k shots, token ids concatenated
    want = [np_ll(ref_logits, np.concatenate([p, e.tokens]), start=len(p)) / np_ll(ref_logits, e.tokens) for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert any(f"kept the last {k} of 12" in n and "token ids" in n for n in ctx.notes)


def test_recall_refuses_overlap_and_missing_prefix(tiny_model, data):
    shots = make_examples(tiny_model.tokenizer, 12, 1, words=(2, 5), partition="prefix", prefix="p")
    clash = Example("p_copy", tokens=data[3].tokens.copy(), partition="prefix")
    with pytest.raises(AttackError, match=r"overlaps the evaluated examples \(2\): e3, e5"):
        get("recall").fn(ctx_for(tiny_model, data, shots[:10] + [clash, data[5]]), n=12, include_first=True)
    with pytest.raises(AttackError, match="--prefix-data"):
        get("recall").fn(ctx_for(tiny_model, data), n=12, include_first=True)
    with pytest.raises(AttackError, match="at least 12 'prefix'"):
        get("recall").fn(ctx_for(tiny_model, data, shots[:4]), n=12, include_first=True)


def test_cli_refuses_missing_prefix_and_ref_dir(tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main

    rows = [{"id": f"x{i}", "text": f"the data {i} is a line of text", "label": i % 2} for i in range(4)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    base = ["score", "--model", str(tiny_neox_dir), "--data", str(tmp_path / "d.jsonl"), "--out",
            str(tmp_path / "o.jsonl"), "--no-cache", "--no-progress", "--bootstrap", "10"]
    assert main(base + ["--attacks", "recall"]) == 2
    assert "--prefix-data" in capsys.readouterr().err
    assert main(base + ["--attacks", "ref", "--ref-model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--ref-model" in err and "nowhere" in err


# ------------------------------------------------------------------------------------------------ EM-MIA
def test_em_matrix_and_recall_avg_match_numpy(tiny_model, data, ref_logits, tmp_path, monkeypatch):
    import mia.engine.conditional as C

    cached = ScoringSettings(progress=False, min_bucket=32, cache_dir=str(tmp_path))
    ctx = ctx_for(tiny_model, data)
    ctx.settings = cached
    R = E.recall_matrix(ctx)
    ll = np.array([np_ll(ref_logits, e.tokens) for e in data])
    want = np.array([[np_ll(ref_logits, np.concatenate([p.tokens, x.tokens]), start=len(p.tokens) + 1) / ll[j]
                      for j, x in enumerate(data)] for p in data])
    np.testing.assert_allclose(R, want, rtol=1e-4)
    np.testing.assert_allclose(get("recall_avg").fn(ctx), want.mean(0), rtol=1e-4)
    # EM-MIA from the LOSS init (f0 = LL(x)), step by step on the torch matrix and LLs. The prefix AUCs and median
    # splits are rank statistics: they agree when no two reference values of a row (or of f0) are closer than twice
    # mia's largest difference from torch, so the orders are the same
    diff = max(np.abs(R - want).max(), np.abs(np.asarray(get("loss").fn(ctx)) - ll).max())
    gap = min(np.diff(np.sort(v)).min() for v in (*want, ll))
    assert gap > 2 * diff, f"reference values {gap:.1e} apart, mia within {diff:.1e} of torch: change the data"
    for iters in (1, 10):
        np.testing.assert_allclose(get("em_mia").fn(ctx, init="loss", iters=iters, prefix_score="auc"),
                                   numpy_em(want, ll, iters), atol=1e-12)
    # every available init runs off the same matrix (no further model call) and is used as f0
    for init in ("loss", "zlib", "mink", "minkpp"):
        try:
            spec = get(init)
        except AttackError:
            continue
        f0 = spec.fn(ctx, **spec.defaults)
        np.testing.assert_array_equal(get("em_mia").fn(ctx, init=init, iters=10, prefix_score="auc"),
                                      E.em_mia_scores(R, f0, iters=10))
    with pytest.raises(AttackError, match="init must be one of"):
        get("em_mia").fn(ctx, init="nope", iters=10, prefix_score="auc")
    # a new run with another init reads the matrix from the disk cache: no conditional-LL model call
    def boom(*a, **k):
        raise AssertionError("model called")

    monkeypatch.setattr(C, "jitted_prefix", boom)
    monkeypatch.setattr(C, "jitted_conditional", boom)
    again = ctx_for(tiny_model, data)
    again.settings = cached
    np.testing.assert_array_equal(get("em_mia").fn(again, init="loss", iters=3, prefix_score="rankdist"),
                                  E.em_mia_scores(R, get("loss").fn(again), iters=3, prefix_score="rankdist"))


def numpy_em(R, f0, iters):
    """docs/algorithms.md#em_mia, step by step with sklearn's AUC."""
    from sklearn.metrics import roc_auc_score

    f = np.where(np.isnan(f0), 0.0, f0)
    for _ in range(iters):
        y = (f > np.median(f)).astype(int)
        r = np.array([roc_auc_score(y, R[p]) if 0 < y.sum() < len(y) else np.nan for p in range(len(R))])
        f = np.where(np.isnan(-r), 0.0, -r)
    return f


def test_em_iterations_match_plain_loop():
    rng = np.random.default_rng(0)
    n = 40
    member = rng.random(n) < 0.5
    # hand-made R: member prefixes raise R on members; rounded so that ties occur
    R = np.round(1 + 0.05 * rng.standard_normal((n, n)) + 0.04 * np.outer(~member, member), 2)
    f0 = rng.standard_normal(n) + member
    f0[[3, 7]] = np.nan
    for iters in (1, 3, 10):
        np.testing.assert_allclose(E.em_mia_scores(R, f0, iters=iters), numpy_em(R, f0, iters), atol=1e-12)
    # RankDist alternative: 1 - mean|rank(R[p]) - rank(f)| / (N - 1), average ranks
    from scipy.stats import rankdata

    f = np.nan_to_num(f0)
    want = -np.array([1 - np.abs(rankdata(R[p]) - rankdata(f)).mean() / (n - 1) for p in range(n)])
    np.testing.assert_allclose(E.em_mia_scores(R, f0, iters=1, prefix_score="rankdist"), want, atol=1e-12)
    # degenerate pseudo-labels (all f equal -> no member above the median) -> NaN AUCs -> f = 0
    np.testing.assert_array_equal(E.em_mia_scores(R, np.ones(n), iters=2), np.zeros(n))


def test_average_ranks_match_scipy():
    from scipy.stats import rankdata

    a = np.round(np.random.default_rng(1).standard_normal((5, 30)), 1)
    np.testing.assert_array_equal(E.average_ranks(a), rankdata(a, axis=1))


# ------------------------------------------------------------------------------------------------ MoPe
def padded(seqs, t=64):
    tok, val = np.zeros((len(seqs), t), np.int32), np.zeros((len(seqs), t), bool)
    for r, x in enumerate(seqs):
        tok[r, :len(x)], val[r, :len(x)] = x, True
    return tok, val


@pytest.mark.slow  # ~40 s on 2 idle cores (two MoPe steps + a jitted reference draw); default-run budget
def test_mope_chunked_vmap_equals_loop_and_batching(tiny_model, data, flax_logits):
    model = tiny_model
    toks = [e.tokens for e in data[:4]]
    tok, val = padded(toks)
    key, n, sigma = jax.random.PRNGKey(7), 5, 0.05
    # noise blocks of 1000 elements, so that the tiny model's matrices are drawn in many blocks, the last one cut
    # (the default 2^22 makes every leaf here one block); chunk 2 pads the 5 copies to 6 (the extra one is dropped),
    # chunk 5 vmaps all copies at once
    block = 1000
    mesh, shardings = engine_layout(model)
    rows = -(-len(toks) // mesh.shape["data"]) * mesh.shape["data"]  # the engine's rows: a multiple of `data`
    ptok, pval = padded(toks + [[]] * (rows - len(toks)))
    scores = {c: np.asarray(build_mope_step(model, mesh, shardings, n, sigma, c, block)(key, model.params, ptok,
                                                                                        pval))[:len(toks)]
              for c in (2, 5)}
    # explicit loop over perturbed copies, same keys, NumPy log-softmax. The documented draw, written out: group 0 =
    # the leaves outside the layer stack, group 1 + l = layer l's slice; leaf j of a group (tree order), shape
    # [R, *rest], gets sigma * (normal(fold_in(k_ij, b), [rows, *rest]) for b = 0, 1, ... stacked)[:R] with
    # k_ij = fold_in(fold_in(k_i, group), j) and rows = min(R, max(1, block // prod(rest))); whole perturbed trees
    # at once, block after block in a Python loop (the attack draws per layer, blocks vmapped)
    layers = model.module.LAYERS
    top = {name: v for name, v in model.params.items() if name != layers}
    stack = model.params[layers]
    n_layers = jax.tree_util.tree_leaves(stack)[0].shape[0]

    def noise(k, shape):
        rest = int(np.prod(shape[1:]))
        rows = min(shape[0], max(1, block // rest))
        parts, b = [], 0
        while b * rows < shape[0]:
            parts.append(jax.random.normal(jax.random.fold_in(k, b), (rows,) + tuple(shape[1:])))
            b += 1
        return jax.numpy.concatenate(parts)[:shape[0]]

    def draw(k, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef.unflatten([x + sigma * noise(jax.random.fold_in(k, j), x.shape) for j, x in enumerate(leaves)])

    @jax.jit
    def noisy(k):
        p = draw(jax.random.fold_in(k, 0), top)
        per_layer = [draw(jax.random.fold_in(k, 1 + i), jax.tree_util.tree_map(lambda a: a[i], stack))
                     for i in range(n_layers)]
        p[layers] = jax.tree_util.tree_map(lambda *a: jax.numpy.stack(a), *per_layer)
        return p
    assert max(x.size for x in jax.tree_util.tree_leaves(model.params)) > 8 * block  # many blocks per matrix
    losses = []
    for k in jax.random.split(key, n):
        p = noisy(k)
        losses.append([-np_ll(lambda q: flax_logits(q, p), x) for x in toks])
    l0 = np.array([-np_ll(lambda q: flax_logits(q, model.params), x) for x in toks])
    want = np.mean(losses, axis=0) - l0
    for c, s in scores.items():
        np.testing.assert_allclose(s, want, atol=2e-4, err_msg=f"chunk={c}")
    np.testing.assert_allclose(scores[2], scores[5], atol=1e-5)


@pytest.mark.slow
def test_mope_registered_attack_does_not_depend_on_batching(tiny_model, data):
    """Registered attack: key from the seed and the same n models in every batch, so batching changes nothing:
    length-sorted batches of 4 (token budget 1280 / chunk 5 / length 64) vs the examples in file order."""
    model, n, sigma = tiny_model, 5, 0.05
    fn = jitted_mope(model, n, sigma, 5)
    direct = np.concatenate([np.asarray(fn(jax.random.PRNGKey(0), model.params, *padded([e.tokens for e in part])))
                             for part in (data[:4], data[4:])])
    ctx = ctx_for(model, data)
    ctx.settings = ScoringSettings(progress=False, min_bucket=32, token_budget=1280)
    np.testing.assert_allclose(get("mope").fn(ctx, n=n, sigma=sigma, chunk=5), direct, atol=1e-5)


# ------------------------------------------------------------------------------------------------ reference model
@pytest.fixture(scope="module")
def other_ref_dir(tmp_path_factory):
    """A tiny GPT-NeoX with its own, different BPE vocabulary."""
    from conftest import build_tiny_tokenizer
    from transformers import GPTNeoXConfig

    from hf_tiny import save_tiny

    path = tmp_path_factory.mktemp("ref_other")
    tok = build_tiny_tokenizer(path, vocab_size=290)
    save_tiny(GPTNeoXConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=64), path, seed=5)
    return path


def test_ref_same_model_is_zero_and_other_matches_numpy(tiny_model, tiny_neox_dir, other_ref_dir, data):
    import mia.models as mm

    np.testing.assert_allclose(get("ref").fn(ctx_for(tiny_model, data, ref_model=str(tiny_neox_dir))), 0, atol=1e-5)
    ref = mm.load(other_ref_dir)
    # token-id examples: decoded with the target tokenizer, re-tokenized with the reference one, noted
    tok_only = [Example(e.id, tokens=e.tokens, label=e.label) for e in data]
    ctx = ctx_for(tiny_model, tok_only, ref_model=str(other_ref_dir))
    got = get("ref").fn(ctx)
    ll_t = np.asarray(get("loss").fn(ctx), np.float64)
    fn = jax.jit(ref.logits)
    want = []
    for e in data:
        ids = np.asarray(ref.tokenizer(tiny_model.tokenizer.decode(e.tokens.tolist()))["input_ids"])[:64]
        tok = np.zeros((1, 64), np.int32)
        tok[0, :len(ids)] = ids
        lp = log_softmax(np.asarray(fn(ref.params, tok), np.float64)[0])
        want.append(np.mean([lp[i - 1, ids[i]] for i in range(1, len(ids))]))
    np.testing.assert_allclose(got, ll_t - np.array(want), rtol=1e-4, atol=1e-5)
    assert any("re-tokenized with the reference" in n and "decoded with the target" in n for n in ctx.notes)


def test_ref_refuses_missing_model(tiny_model, data, tmp_path):
    with pytest.raises(AttackError, match="--ref-model DIR"):
        get("ref").fn(ctx_for(tiny_model, data))
    with pytest.raises(AttackError, match="not found"):
        get("ref").fn(ctx_for(tiny_model, data, ref_model=str(tmp_path / "missing")))


# ------------------------------------------------------------------------------------------------ neighbourhood
@pytest.fixture(scope="module")
def tiny_mlm_dir(tmp_path_factory):
    """A tiny random BertForMaskedLM (saved with transformers/torch) with a WordPiece vocabulary of WORDS."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    path = tmp_path_factory.mktemp("tiny_mlm")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(WORDS))
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(str(path))
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=32, max_position_embeddings=64))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the candidate probabilities (no near-ties)
    model.eval().save_pretrained(str(path), safe_serialization=True)
    return path


def torch_neighbours(path, text, n, k):
    """Mattern et al.'s generate_neighbors (dropout p = 0), restricted to non-special positions and candidates."""
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    tok, model = AutoTokenizer.from_pretrained(str(path)), BertForMaskedLM.from_pretrained(str(path)).eval()
    ids = tok(text, return_tensors="pt").input_ids
    special = set(tok.all_special_ids)
    scores = {}
    with torch.no_grad():
        for i in range(1, ids.shape[1] - 1):
            emb = model.bert.embeddings(ids)
            probs = torch.softmax(model(inputs_embeds=emb).logits, dim=2)[0, i]
            orig = probs[ids[0, i]].item()
            cp, cs = torch.topk(probs, k + 1)
            for pr, c in zip(cp, cs):
                if c == ids[0, i] or int(c) in special:
                    continue
                scores[(int(c), i)] = pr.item() / (1 - orig)
    from heapq import nlargest

    out = []
    for c, i in nlargest(n, scores, key=scores.get):
        new = ids[0].clone()
        new[i] = c
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


def test_mlm_logits_and_neighbours_match_transformers(tiny_mlm_dir):
    import torch
    from transformers import BertForMaskedLM

    from mia.attacks._mlm import neighbours
    from mia.models.bert import load_mlm, mlm_logits

    mlm = load_mlm(tiny_mlm_dir)
    ids = np.asarray(mlm.tokenizer("the data model is not a token line")["input_ids"])[None]
    with torch.no_grad():
        want = BertForMaskedLM.from_pretrained(str(tiny_mlm_dir)).eval()(torch.tensor(ids)).logits.numpy()
    got = np.asarray(mlm_logits(mlm.config, mlm.params, ids, np.ones_like(ids, bool)))
    np.testing.assert_allclose(got, want, atol=1e-4)
    text = "the data of this model was not from the file"
    assert neighbours(mlm, text, jax.random.PRNGKey(0), n=6, k=3, p=0.0) == torch_neighbours(tiny_mlm_dir, text, 6, 3)
    # with dropout the search is random but reproducible for a key
    a = neighbours(mlm, text, jax.random.PRNGKey(1), n=6, k=3, p=0.7)
    assert a == neighbours(mlm, text, jax.random.PRNGKey(1), n=6, k=3, p=0.7) and len(a) == 6


def test_neighbor_score_matches_numpy_and_is_cached(tiny_model, tiny_mlm_dir, data, ref_logits, tmp_path):
    from mia.attacks.neighbor import neighbour_texts

    ctx = ctx_for(tiny_model, data[:4], mlm=str(tiny_mlm_dir))
    ctx.settings = ScoringSettings(progress=False, min_bucket=32, cache_dir=str(tmp_path))
    got = get("neighbor").fn(ctx, n=4, k=3, p=0.7)
    nbs = neighbour_texts(ctx, n=4, k=3, p=0.7)
    assert [len(x) for x in nbs] == [4] * 4 and list(tmp_path.glob("neighbors-*/*.json"))
    tok = tiny_model.tokenizer
    want = [np_ll(ref_logits, e.tokens) - np.mean([np_ll(ref_logits, np.asarray(tok(t)["input_ids"])) for t in nb])
            for e, nb in zip(data[:4], nbs)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(AttackError, match="--mlm DIR"):
        get("neighbor").fn(ctx_for(tiny_model, data[:4]), n=4, k=3, p=0.7)


def test_mope_noise_is_drawn_in_the_parameter_dtype():
    """bf16/fp16 leaves: noise drawn and added in the leaf's dtype (the memory budget), equal to the documented
    draw; float32 leaves unchanged from docs/algorithms.md#mope; integer leaves untouched."""
    from mia.attacks.mope import perturb_leaf

    key = jax.random.PRNGKey(3)
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        leaf = jnp.asarray(np.random.default_rng(0).standard_normal((7, 5)) * 0.1, dt)
        out = perturb_leaf(key, leaf, 0.005)
        assert out.dtype == dt
        # a leaf of at most NOISE_BLOCK elements is one block: normal(fold_in(key, 0), shape)
        noise = jax.random.normal(jax.random.fold_in(key, 0), (7, 5), dt)
        want = np.asarray(leaf, np.float64) + np.asarray(jnp.asarray(0.005, dt) * noise, np.float64)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2 if dt != jnp.float32 else 1e-6,
                                   atol=1e-7)
        diff = np.asarray(out, np.float64) - np.asarray(leaf, np.float64)
        assert 0.002 < diff.std() < 0.008, (dt, diff.std())  # noise of the stated sigma, not rounded away
    ints = jnp.arange(6)
    assert perturb_leaf(key, ints, 0.5) is ints


def test_mope_block_noise_is_gaussian_and_independent_across_blocks():
    """The blocked draw at the default block size, judged as noise (not against its own layout): a [3, 2^21] leaf is
    drawn as two blocks of 2 rows (the second cut to 1 row). Mean ~0, std ~sigma, Kolmogorov-Smirnov against
    N(0, sigma^2); rows of different blocks, rows of one block, two leaves and two copies uncorrelated; in bf16 the
    same mean and std."""
    from scipy.stats import kstest

    from mia.attacks.mope import NOISE_BLOCK, block_rows, perturb_leaf

    shape, sigma = (3, NOISE_BLOCK // 2), 0.005
    assert block_rows(shape) == 2  # two blocks: rows {0, 1} and {2}
    zero = jnp.zeros(shape, jnp.float32)
    k = jax.random.PRNGKey(11)
    eps = np.asarray(perturb_leaf(k, zero, sigma), np.float64)
    other_leaf = np.asarray(perturb_leaf(jax.random.fold_in(k, 1), zero, sigma), np.float64)
    n = eps.size
    assert abs(eps.mean()) < 4 * sigma / np.sqrt(n)
    assert abs(eps.std() / sigma - 1) < 4 / np.sqrt(2 * n)
    assert kstest(eps.ravel()[::7] / sigma, "norm").pvalue > 1e-3  # every 7th draw: 900,000 over all 3 rows
    bound = 5 / np.sqrt(shape[1])  # 5 standard errors of a correlation of independent rows

    def corr(a, b):
        return abs(np.corrcoef(a, b)[0, 1])
    assert corr(eps[0], eps[2]) < bound and corr(eps[1], eps[2]) < bound  # across blocks, same positions
    assert corr(eps[0], eps[1]) < bound  # within a block
    assert corr(eps[2], other_leaf[2]) < bound and corr(eps[0], other_leaf[0]) < bound  # another leaf's key
    assert not np.array_equal(eps[2], eps[0]) and np.all(eps != 0, axis=1).mean() == 1.0
    # in bf16 jax.random.normal is coarse (128 distinct values, mean about -0.011, std 0.997): within 2% of sigma
    # (on a leaf an eighth as wide, one block: the dtype's draw, not the layout, is checked here)
    eps16 = np.asarray(perturb_leaf(k, jnp.zeros((3, shape[1] // 8), jnp.bfloat16), sigma), np.float64)
    assert abs(eps16.mean()) < 0.02 * sigma and abs(eps16.std() / sigma - 1) < 0.01
    assert corr(eps16[0], eps16[2]) < 5 / np.sqrt(eps16.shape[1])


# ------------------------------------------------------------------------------------------------ EM-MIA Kendall
def kendall_tau_b(x, y):
    """Kendall's tau-b by its definition over all pairs: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    c = d = tx = ty = 0
    for i, j in combinations(range(len(x)), 2):
        a, b = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        if a == 0 and b == 0:
            continue
        if a == 0:
            tx += 1
        elif b == 0:
            ty += 1
        elif a == b:
            c += 1
        else:
            d += 1
    den = np.sqrt((c + d + tx) * (c + d + ty))
    return np.nan if den == 0 else (c - d) / den


def test_em_mia_kendall_prefix_score_matches_definition():
    rng = np.random.default_rng(0)
    R = rng.integers(0, 4, size=(7, 7)).astype(float)  # many ties
    R[3] = 2.0  # a constant row: tau undefined (NaN) -> membership 0
    f0 = rng.integers(0, 3, size=7).astype(float)
    np.testing.assert_allclose(E.rowwise_kendall_tau(R, f0), [kendall_tau_b(r, f0) for r in R], equal_nan=True)
    f = f0.copy()
    for _ in range(3):  # the official loop: r_p = tau(R[p], f); f = -r; NaN -> 0
        f = np.nan_to_num(-np.array([kendall_tau_b(r, f) for r in R]), nan=0.0)
    np.testing.assert_allclose(E.em_mia_scores(R, f0, iters=3, prefix_score="kendall"), f)
    with pytest.raises(AttackError, match="prefix_score must be one of auc, kendall, rankdist; got 'tau'"):
        E.em_mia_scores(R, f0, prefix_score="tau")


def test_neighbor_cache_eviction_recomputes_never_serves_stale(tmp_path, monkeypatch):
    """Fast, with the masked-LM search replaced by a counted deterministic stand-in: 12 texts through the
    neighbour cache at a limit of about three entries. Entries are evicted while the texts are cached, the cache
    ends under the limit, a second pass recomputes exactly the evicted texts (and serves the rest), and an entry
    rewritten for another text is recomputed, never served."""
    from types import SimpleNamespace

    from mia.files import cache_limit
    from mia.attacks import neighbor

    calls = []

    def fake_search(mlm, text, key, *, n, k, p):
        calls.append(text)
        return [f"{text} ~{j}" for j in range(n)]

    monkeypatch.setattr(neighbor, "neighbours", fake_search)
    monkeypatch.setattr(neighbor, "load_masked_lm", lambda ctx: SimpleNamespace(fingerprint="fake"))
    texts = [f"text number {i} of the cache test" for i in range(12)]
    cache = tmp_path / "cache"
    ctx = ctx_for(None, [Example(f"e{i}", text=t) for i, t in enumerate(texts)])
    ctx.settings = ScoringSettings(progress=False, cache_dir=str(cache))
    want = [fake_search(None, t, None, n=3, k=1, p=0.5) for t in texts]
    calls.clear()
    entry = len(json.dumps({"text": texts[0], "neighbors": want[0]}))
    monkeypatch.setattr(cache_limit, "_override_gb", 3.5 * entry / cache_limit.GB)
    monkeypatch.setattr(cache_limit, "_estimates", {})
    evicted = []
    real_delete = cache_limit.delete_entry
    monkeypatch.setattr(cache_limit, "delete_entry", lambda e: evicted.append(e.files[0].name) or real_delete(e))

    assert neighbor.neighbour_texts(ctx, n=3, k=1, p=0.5) == want and calls == texts
    assert evicted and cache_limit.total_size(cache) <= cache_limit.max_bytes()
    kept = sorted(cache.glob("neighbors-*/*.json"))
    assert 0 < len(kept) <= 3 and len(kept) + len(evicted) == len(texts)
    kept_texts = {json.loads(f.read_text())["text"] for f in kept}
    stale_text = json.loads(kept[0].read_text())["text"]
    kept[0].write_text(json.dumps({"text": "another text", "neighbors": ["x y", "y z", "z w"]}))
    calls.clear()
    # the second pass in reverse order reads the kept (most recent) entries before its own writes evict anything
    back = ctx_for(None, [Example(f"e{i}", text=t) for i, t in reversed(list(enumerate(texts)))])
    back.settings = ctx.settings
    assert neighbor.neighbour_texts(back, n=3, k=1, p=0.5) == want[::-1]
    assert sorted(calls) == sorted(set(texts) - kept_texts | {stale_text}), (calls, kept_texts)


@pytest.mark.slow
def test_neighbor_cache_past_its_limit_evicts_and_recomputes(tiny_model, tiny_mlm_dir, data, tmp_path, monkeypatch):
    """The neighbour texts' disk cache under a size limit of about three entries while the attack writes five: the
    least recently used are evicted during the run (which computes everything: its scores are the reference) and
    the cache ends under the limit; a second run recomputes the evicted texts, serves the kept ones, and gives the
    same neighbours and scores. A kept entry rewritten for another text is recomputed, never served."""
    from mia.files import cache_limit
    from mia.attacks.neighbor import neighbour_texts

    def run():
        ctx = ctx_for(tiny_model, data[:5], mlm=str(tiny_mlm_dir))
        ctx.settings = ScoringSettings(progress=False, min_bucket=32, cache_dir=str(cache))
        return get("neighbor").fn(ctx, n=2, k=2, p=0.7), neighbour_texts(ctx, n=2, k=2, p=0.7)

    cache = tmp_path / "cache"
    entry = len(json.dumps({"text": data[0].text, "neighbors": ["a b c d e f g h"] * 2}))  # about one entry's size
    monkeypatch.setattr(cache_limit, "_override_gb", 3 * entry / cache_limit.GB)
    monkeypatch.setattr(cache_limit, "_estimates", {})
    evicted = []
    real_delete = cache_limit.delete_entry
    monkeypatch.setattr(cache_limit, "delete_entry", lambda e: evicted.append(e) or real_delete(e))
    want, want_nbs = run()
    assert [len(x) for x in want_nbs] == [2] * 5
    assert any(e.kind == "neighbors" for e in evicted), evicted
    kept = sorted(cache.glob("neighbors-*/*.json"))
    assert 0 < len(kept) < 5 and cache_limit.total_size(cache) <= cache_limit.max_bytes()
    stale = json.loads(kept[0].read_text())
    kept[0].write_text(json.dumps({"text": "another text", "neighbors": ["x y", "y z"]}))
    evicted.clear()
    got, nbs = run()
    assert nbs == want_nbs
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert any(e.kind == "neighbors" for e in evicted), evicted
    assert not kept[0].exists() or json.loads(kept[0].read_text()) == stale  # rewritten, or evicted since
