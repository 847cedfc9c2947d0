"""Graded-difficulty splits: the spec's rules, and easy > hard blind AUC on a synthetic embedding set."""
import argparse
import json

import numpy as np
import pytest

from mia.blind import fit_predict
from mia.data import difficulty as D
from mia.data.splits import read_split, write_split
from mia.metrics import auc


def _pools(seed=0, d=64, topics=4, per_topic=80, sigma=0.3):
    """Member topics t_0..t_3; non-member topics: t_0 (same as a member topic: hard), -t_1 (opposite: easy), 2
    others."""
    rng = np.random.default_rng(seed)
    centers = D.l2_normalize(rng.normal(size=(topics + 2, d)))
    m_centers = centers[:topics]
    n_centers = np.stack([centers[0], -centers[1], centers[topics], centers[topics + 1]])

    def draw(cs):
        return D.l2_normalize(np.concatenate([c + rng.normal(0, sigma, (per_topic, d)) for c in cs]))

    xm, xn = draw(m_centers), draw(n_centers)
    pm, pn = rng.permutation(len(xm)), rng.permutation(len(xn))  # pool order is not topic order
    return xm[pm], xn[pn]


@pytest.fixture(scope="module")
def splits():
    xm, xn = _pools()
    return xm, xn, D.graded_splits(xm, xn, size=40, k=4, niter=20, seed=42)


def test_spherical_kmeans_recovers_topics():
    xm, _ = _pools()
    c, assign = D.spherical_kmeans(xm, 4, niter=20, seed=42)
    np.testing.assert_allclose(np.linalg.norm(c, axis=1), 1)
    assert all(70 <= n <= 90 for n in np.bincount(assign, minlength=4))  # 4 topics of 80
    c2, assign2 = D.spherical_kmeans(xm, 4, niter=20, seed=42)
    np.testing.assert_array_equal(assign, assign2)


def test_distance_filter_is_greedy_in_index_order():
    rng = np.random.default_rng(0)
    x = D.l2_normalize(rng.normal(size=(50, 4)))
    kept = D.distance_filter(x, list(range(50)), 0.6)
    assert kept[0] == 0
    d = 1 - x[kept] @ x[kept].T
    assert (d[np.triu_indices(len(kept), 1)] >= 0.6).all()
    for b in set(range(50)) - set(kept):  # each dropped point is close to an earlier kept one
        assert any(1 - x[a] @ x[b] < 0.6 for a in kept if a < b)


def _reference_clusters(x, k, niter, seed, half, threshold=0.6):
    """{cluster: kept pool indices} of the valid clusters, from the k-means assignment and the 0.6 filter written
    out: within a cluster, in index order, a point still kept drops every later point closer than ``threshold``."""
    _, assign = D.spherical_kmeans(x, k, niter=niter, seed=seed)  # the clustering itself: test_spherical_kmeans_*
    out = {}
    for c in range(k):
        kept = []
        for b in np.flatnonzero(assign == c):
            if all(1 - x[a] @ x[b] >= threshold for a in kept):
                kept.append(int(b))
        if len(kept) >= half:
            out[c] = kept
    return out


def _mean_dist(x, i, y, js):
    """mean over j in js of 1 - cos(x[i], y[j]) (rows are unit vectors)."""
    return np.mean([1 - x[i] @ y[j] for j in js])


def _is_extreme_half(chosen, kept, dist, largest):
    """``chosen`` is the half of ``kept`` with the largest (smallest) ``dist``: every chosen point beats every other."""
    rest = sorted(set(kept) - set(chosen))
    if not rest:
        return True
    a, b = [dist[i] for i in chosen], [dist[i] for i in rest]
    return min(a) > max(b) if largest else max(a) < min(b)


def test_split_rules(splits):
    """The rules of docs/algorithms.md#difficulty as properties, each cluster pair and distance recomputed here from the
    cluster assignment with plain loops (not by replaying the code's random calls)."""
    xm, xn, s = splits
    xm, xn = D.l2_normalize(xm), D.l2_normalize(xn)
    half = 20
    for name in D.DIFFICULTIES:
        for key, pool in (("members", xm), ("nonmembers", xn)):
            sel = s[name][key]
            assert len(sel) == len(set(sel)) == half and sel == sorted(sel), (name, key)
            assert all(0 <= i < len(pool) for i in sel), (name, key)
    # mix splits combine as defined
    assert s["mix-1"] == {"members": s["random"]["members"], "nonmembers": s["hard"]["nonmembers"]}
    assert s["mix-2"] == {"members": s["hard"]["members"], "nonmembers": s["random"]["nonmembers"]}

    cm = _reference_clusters(xm, 4, 20, 42, half)
    cn = _reference_clusters(xn, 4, 20, 42, half)
    assert cm and cn
    # pairs (valid member cluster i, valid non-member cluster j) by mean cross distance over every point pair
    cross = {(i, j): np.mean([_mean_dist(xm, a, xn, cn[j]) for a in cm[i]]) for i in cm for j in cn}
    order = sorted(cross, key=lambda ij: cross[ij])
    assert len(set(np.round(list(cross.values()), 9))) == len(cross)  # no tie: the sorted order is unique
    pair = {"easy": order[-1], "medium": order[len(order) // 2], "hard": order[0]}
    info = s["_info"]
    assert info["n_pairs"] == len(order)
    for name, (i, j) in pair.items():
        assert info["pairs"][name][:2] == [i, j], name
        assert info["pairs"][name][2] == pytest.approx(cross[i, j], abs=1e-9), name
        # each side is drawn from its cluster's points that survive the 0.6 filter
        assert set(s[name]["members"]) <= set(cm[i]) and set(s[name]["nonmembers"]) <= set(cn[j]), name
    # easy: the points farthest (mean distance) from the other cluster; hard: the closest
    for name, largest in (("easy", True), ("hard", False)):
        i, j = pair[name]
        dm = {a: _mean_dist(xm, a, xn, cn[j]) for a in cm[i]}
        dn = {b: _mean_dist(xn, b, xm, cm[i]) for b in cn[j]}
        assert _is_extreme_half(s[name]["members"], cm[i], dm, largest), name
        assert _is_extreme_half(s[name]["nonmembers"], cn[j], dn, largest), name
    # the synthetic pools make the three pairs distinct and easy's pair far from hard's
    assert cross[pair["easy"]] > cross[pair["medium"]] > cross[pair["hard"]]
    # chosen points are far apart from each other (the 0.6 filter)
    for name in ("easy", "medium", "hard"):
        for key, x in (("members", xm), ("nonmembers", xn)):
            e = x[s[name][key]]
            assert (1 - e @ e.T)[np.triu_indices(half, 1)].min() >= 0.6, (name, key)


def test_random_split_is_a_seeded_uniform_draw():
    """random: size/2 members (non-members) from the WHOLE member (non-member) pool, uniformly (a chi-square test over
    40 seeds), the same draw for the same seed and another one for another seed; every split is the same for the same
    seed."""
    xm, xn = _pools(per_topic=40)
    a = D.graded_splits(xm, xn, size=40, k=4, niter=10, seed=42)
    assert a == D.graded_splits(xm, xn, size=40, k=4, niter=10, seed=42)  # deterministic, every split
    counts = np.zeros((2, len(xm)))
    for seed in range(40):
        r = D.graded_splits(xm, xn, size=40, k=4, niter=10, seed=seed)["random"]
        counts[0, r["members"]] += 1
        counts[1, r["nonmembers"]] += 1
        if seed != 42:
            assert r != a["random"]
    # 40 draws of 20 out of 160: each index expected 5 times; a chi-square test of uniformity at the 0.1% level
    from scipy.stats import chisquare

    # (a draw from the filtered clusters only would miss many indices)
    assert (chisquare(counts, axis=1).pvalue > 1e-3).all()


def _blind_auc(xm, xn, sel, seed=0):
    """LR on the embeddings, trained on half of each class and scored on the other half."""
    x = np.concatenate([xm[sel["members"]], xn[sel["nonmembers"]]])
    y = np.r_[np.ones(len(sel["members"]), int), np.zeros(len(sel["nonmembers"]), int)]
    rng = np.random.default_rng(seed)
    tr = np.zeros(len(y), bool)
    for c in (0, 1):
        idx = rng.permutation(np.flatnonzero(y == c))
        tr[idx[: len(idx) // 2]] = True
    return auc(fit_predict("lr", x[tr], y[tr], x[~tr]), y[~tr])


def test_difficulty_orders_blind_auc(splits):
    xm, xn, s = splits
    a = {name: _blind_auc(xm, xn, s[name]) for name in ("easy", "medium", "hard", "random")}
    assert a["easy"] > 0.95 and a["hard"] < 0.8 and a["easy"] > a["hard"], a


def test_too_few_points_is_one_clear_error():
    xm, xn = _pools(per_topic=10)
    with pytest.raises(D.DifficultyError, match="no valid"):
        D.graded_splits(xm, xn, size=40, k=4)


def test_cli_writes_six_split_files(tmp_path, splits):
    xm, xn, _ = splits
    ex = [{"id": f"m{i}", "label": 1, "text": f"member {i}"} for i in range(len(xm))]
    ex += [{"id": f"n{i}", "label": 0, "text": f"non-member {i}"} for i in range(len(xn))]
    pool = write_split(tmp_path / "pool.jsonl", {"source": {"kind": "text"}}, ex)
    np.savez(tmp_path / "emb.npz", ids=np.array([e["id"] for e in ex]), emb=np.concatenate([xm, xn]))
    parser = argparse.ArgumentParser(prog="mia split")
    D.add_difficulty_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["difficulty", "--pool", str(pool), "--out", str(tmp_path / "out"), "--size", "40",
                              "--k", "4", "--niter", "20", "--embeddings", str(tmp_path / "emb.npz")])
    assert args.func(args) == 0
    easy = read_split(tmp_path / "out" / "easy.jsonl")
    assert easy.header["format"] == "mia-split/1" and easy.header["params"]["difficulty"] == "easy"
    assert easy.header["counts"]["members"] == 20 and len(easy.partition("eval")) == 40
    assert easy.header["source"]["pool"]["sha256"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {f"{n}.jsonl" for n in D.DIFFICULTIES}
    assert json.loads((tmp_path / "out" / "difficulty.json").read_text())["params"]["k"] == 4


@pytest.mark.parametrize("argv, flag", [
    (["difficulty", "--k", "0"], "--k"),
    (["difficulty", "--size", "1"], "--size"),
    (["difficulty", "--size", "-4"], "--size"),
    (["difficulty", "--threshold", "-0.1"], "--threshold"),
    (["difficulty", "--threshold", "2.5"], "--threshold"),
    (["difficulty", "--threshold", "nan"], "--threshold"),
    (["difficulty", "--seed", "-1"], "--seed"),
    (["text", "--format", "wikimia", "--seed", "-1"], "--seed"),
])
def test_split_options_are_range_checked(argv, flag, tmp_path, capsys):
    """``mia split difficulty`` --k/--size/--threshold/--seed (and the other splits' --seed) out of range: one
    ``error:`` line naming the option, exit 2, before the pool is read (it does not exist here)."""
    from mia.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["split", *argv[:1], "--pool" if argv[0] == "difficulty" else "--file", str(tmp_path / "none"),
              "--out", str(tmp_path / "o"), *argv[1:]])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_pool_embedding_with_the_encoder(tmp_path):
    from mia.models.bert import default_encoder_dir

    default_encoder_dir()  # make setup installs MiniLM: its absence fails here (with the pip line), it is not skipped
    words = "river stone music garden code python compiler kernel".split()
    rng = np.random.default_rng(0)
    ex = [{"id": f"{lab}{i}", "label": lab, "text": " ".join(rng.choice(words[:4] if lab else words[4:], 6))}
          for lab in (1, 0) for i in range(12)]
    paths = D.build_difficulty_splits(write_split(tmp_path / "p.jsonl", {}, ex), tmp_path / "o", size=4, k=2,
                                      niter=10, threshold=0.05)
    z = np.load(tmp_path / "o" / "embeddings.npz")
    assert z["emb"].shape == (24, 384) and np.allclose(np.linalg.norm(z["emb"], axis=1), 1, atol=1e-5)
    assert len(read_split(paths["easy"]).examples) == 4
