"""Benchmark: whole ``mia score`` processes by attack set, and the four log-prob attacks against pandora's way.

    python -m experiments.bench_attack_sets [--part whole|pandora|both] [--hidden 512 --layers 6 --heads 8
        --vocab 50304] [--rows 64] [--texts 256] [--length 512] [--k 0.1] [--repeats 1]

One random GPT-NeoX (Pythia-70m-shaped by default) is made by transformers and saved to a temp dir (safetensors +
config.json). The texts are random token ids in [1, vocab) (seeded; no id 0, which pandora's ``ids > 0`` attention
mask would drop), written as JSONL rows ``{"id", "tokens", "text", "label"}``; ``text`` is the ids written as words
(``w17 w4031 ...``), the text zlib compresses on both sides (given with the ids, so mia never decodes). Every run is
a separate subprocess with a fresh empty ``MIA_CACHE_DIR`` (no score and no compiled program is reused: compiling is
part of mia's time) and is timed whole, from the parent; the subprocess also reports its time after its imports. An
untimed subprocess that only imports jax, torch, transformers and mia runs first (``--no-warmup``: not), so that the
first timed process does not alone pay for reading the libraries from disk.

  whole    ``mia score --attacks loss`` and ``--attacks loss,mink,minkpp`` on ``--rows`` texts (statistics on
           demand: LOSS alone runs the log-prob-only program, Min-K%++ the every-statistic one). Target: LOSS alone
           >= 1.15x faster.
  pandora  LOSS, Min-K%, Min-K%++ and zlib on ``--texts`` texts. mia: one ``mia score --attacks
           loss,mink:k=K,minkpp:k=K,zlib`` (one pass computes the statistics they need). torch: pandora_llm's way,
           one process, a batch-1 loop over every text PER ATTACK (transformers GPT-NeoX, float32, eval, no_grad;
           per text: forward with mask ``ids > 0``, log-softmax over the vocabulary, the target log-probs, then the
           attack's statistic). The two sides' scores must agree (``--rtol``/``--atol``) before a time is printed.
           Target: mia >= 3.5x faster.

Where pandora_llm's definitions differ from mia's, the torch loop computes mia's score with pandora's per-text work
(docs/algorithms.md): scores are oriented higher = member (pandora negates LOSS, Min-K% and Min-K%++); Min-K%++ uses
the probability-weighted moments of log p with no epsilon (pandora: the unweighted ``std_mean`` over the vocabulary,
+1e-8; the same [T, V] work); zlib is LL / zlib bytes (pandora's ``ZLIB`` is model-free, its ``LossZLIB`` a sum
NLL + bytes: the loop does LossZLIB's forward pass and mia's ratio). k is pandora's default 0.1 for both Min-Ks
(mia's default is 0.2), passed to mia explicitly; pandora's count int(k n) equals mia's max(1, int(k n)) here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from experiments.random_models import add_shape_flags, save_random_gpt_neox

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = ("loss", "mink", "minkpp", "zlib")  # the pandora part's attacks, in the torch loop's order
WORKER = "--worker"


class Disagreement(AssertionError):
    """mia's and the torch loop's scores of one attack differ beyond the tolerance."""


# ------------------------------------------------------------------------------------------------ data and runs

def write_rows(path: Path, n: int, length: int, vocab: int, seed: int) -> None:
    """``n`` JSONL rows of ``length`` random ids in [1, vocab): {"id", "tokens", "text" (the ids as words),
    "label" (alternating 1/0)}."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = rng.integers(1, vocab, length).tolist()
            f.write(json.dumps({"id": i, "tokens": ids, "text": " ".join(f"w{t}" for t in ids), "label": 1 - i % 2})
                    + "\n")


def child_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH (the mia the subprocesses import)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def run_worker(args: list, cache_dir: Path) -> tuple[float, dict]:
    """(wall seconds of the whole subprocess, the JSON of its last stdout line). The subprocess is this module
    with ``--worker ...``, a fresh interpreter with ``MIA_CACHE_DIR`` = ``cache_dir``."""
    env = dict(child_env(), MIA_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, "-m", "experiments.bench_attack_sets", WORKER] + [str(a) for a in args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:6])} ...: exit {r.returncode}\n{r.stderr[-3000:]}")
    return wall, json.loads(r.stdout.strip().splitlines()[-1])


def run_mia(model: Path, data: Path, attacks: str, out: Path, work: Path) -> tuple[float, float, dict]:
    """(whole-process seconds, seconds after the imports, {score label: [N] scores}) of one ``mia score``."""
    with tempfile.TemporaryDirectory(dir=work, prefix="cache_") as cache:
        wall, report = run_worker(["mia", "score", "--model", model, "--data", data, "--attacks", attacks,
                                   "--out", out, "--dtype", "float32", "--bootstrap", "0", "--no-progress"],
                                  Path(cache))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    scores = {label: np.array([x["scores"][label] for x in lines], np.float64) for label in lines[0]["scores"]}
    return wall, report["seconds"], scores


# ------------------------------------------------------------------------------------------------ the workers

def mia_worker(argv: list) -> None:
    """``mia <argv>`` as ``python -m mia`` runs it (``mia.cli.main``), then one JSON line: the seconds after the
    imports (jax and the modules ``mia score`` imports as it goes are imported first, as the torch worker imports
    torch and transformers before its clock starts)."""
    import jax  # noqa: F401

    import mia.api  # noqa: F401
    import mia.attacks  # noqa: F401
    import mia.engine.loop  # noqa: F401
    import mia.models  # noqa: F401
    from mia.cli import main

    t0 = time.perf_counter()
    status = main(argv)
    seconds = time.perf_counter() - t0
    if status:
        raise SystemExit(status)
    print(json.dumps({"seconds": seconds}))


def target_logprobs(model, ids):
    """pandora's per-text step at batch 1: [1, T] ids -> ([T-1, V] log-softmax, [T-1] target log-probs), float32;
    the attention mask is ``ids > 0`` as pandora's."""
    import torch

    logits = model(input_ids=ids, attention_mask=(ids > 0).long()).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp, logp.gather(-1, ids[0, 1:, None])[:, 0]


def bottom_k_mean(values, k: float) -> float:
    """Mean of the int(k n) smallest of [n] values (pandora's count; mia's max(1, .) is the same when k n >= 1)."""
    import torch

    n = max(1, int(k * values.shape[0]))
    return float(torch.sort(values)[0][:n].mean())


def torch_score(attack: str, model, ids, text: str, k: float) -> float:
    """One text's score of ``attack`` (mia's definition, higher = member), from one batch-1 forward pass."""
    import torch

    logp, tok = target_logprobs(model, ids)
    if attack == "loss":
        return float(tok.mean())
    if attack == "mink":
        return bottom_k_mean(tok, k)
    if attack == "minkpp":
        p = logp.exp()
        mu = (p * logp).sum(-1)
        sigma = torch.sqrt((p * (logp - mu[:, None]) ** 2).sum(-1))
        return bottom_k_mean((tok - mu) / sigma, k)
    if attack == "zlib":
        return float(tok.mean()) / len(zlib.compress(text.encode("utf-8")))
    raise ValueError(f"unknown attack {attack!r}")


def torch_worker(model_dir: str, data: str, k: float) -> None:
    """pandora's way in one process: the model loaded once, then per attack a batch-1 loop over every text; one JSON
    line: seconds of the load, of each attack's loop, after the imports in all, and the scores."""
    t0 = time.perf_counter()
    import torch
    from transformers import GPTNeoXForCausalLM

    t_imported = time.perf_counter()
    model = GPTNeoXForCausalLM.from_pretrained(model_dir).float().eval()
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    texts = [(torch.tensor(r["tokens"], dtype=torch.long)[None], r["text"]) for r in rows]
    load = time.perf_counter() - t_imported
    seconds, scores = {}, {}
    with torch.no_grad():
        for attack in ATTACKS:
            t = time.perf_counter()
            scores[attack] = [torch_score(attack, model, ids, text, k) for ids, text in texts]
            seconds[attack] = time.perf_counter() - t
    print(json.dumps({"imports": t_imported - t0, "load": load, "loops": seconds,
                      "seconds": time.perf_counter() - t_imported, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "scores": scores}))


# ------------------------------------------------------------------------------------------------ the parts

def check_agreement(ours: dict, theirs: dict, rtol: float, atol: float) -> dict:
    """{attack: max |mia - torch|} over the texts; ``Disagreement`` naming the attack and the worst text when
    ``|a - b| > atol + rtol |b|`` anywhere (or a NaN on either side)."""
    worst = {}
    for attack, a in ours.items():
        b = np.asarray(theirs[attack], np.float64)
        a = np.asarray(a, np.float64)
        diff = np.abs(a - b)
        bad = ~(diff <= atol + rtol * np.abs(b))
        if bad.any():
            i = int(np.argmax(np.where(bad, np.nan_to_num(diff, nan=np.inf), -1.0)))
            raise Disagreement(f"{attack}: mia and the torch loop disagree on text {i}: {a[i]!r} vs {b[i]!r} "
                               f"({int(bad.sum())} of {len(b)} beyond rtol {rtol}, atol {atol})")
        worst[attack] = float(diff.max())
    return worst


def warm_up() -> None:
    """One untimed subprocess that imports what both sides import, so that the first timed process does not pay
    for reading the libraries from disk (only the OS page cache carries over; no Python or JAX state)."""
    subprocess.run([sys.executable, "-c", "import jax, torch, transformers, mia.api, mia.cli"], check=True, cwd=ROOT,
                   env=child_env())


def best_run(fn, repeats: int):
    """The run of ``fn()`` -> (wall, ...) with the smallest wall time, of ``repeats``."""
    return min((fn() for _ in range(repeats)), key=lambda r: r[0])


def part_whole(model: Path, work: Path, args) -> dict:
    data = work / "whole.jsonl"
    write_rows(data, args.rows, args.length, args.vocab, args.seed)
    runs = {}
    for attacks in ("loss", "loss,mink,minkpp"):
        runs[attacks] = best_run(lambda: run_mia(model, data, attacks, work / "whole_out.jsonl", work)[:2],
                                 args.repeats)
    print(f"\n### whole process, attack sets: {args.rows} texts x {args.length} tokens, best of {args.repeats}\n")
    print("| `mia score --attacks` | whole process (s) | after imports (s) |")
    print("|---|---:|---:|")
    for attacks, (wall, inner) in runs.items():
        print(f"| {attacks} | {wall:.2f} | {inner:.2f} |")
    (w1, i1), (w3, i3) = runs["loss"], runs["loss,mink,minkpp"]
    print(f"\nloss alone vs loss,mink,minkpp: {w3 / w1:.2f}x faster (whole process; target >= 1.15x), "
          f"{i3 / i1:.2f}x after imports")
    return {"runs": runs, "ratio": w3 / w1}


def part_pandora(model: Path, work: Path, args) -> dict:
    data = work / "pandora.jsonl"
    write_rows(data, args.texts, args.length, args.vocab, args.seed + 1)
    labels = {"loss": "loss", "mink": f"mink:k={args.k:g}", "minkpp": f"minkpp:k={args.k:g}", "zlib": "zlib"}
    spec = ",".join(labels[a] for a in ATTACKS)

    def ours():
        wall, inner, scores = run_mia(model, data, spec, work / "pandora_out.jsonl", work)
        return wall, inner, {a: scores[labels[a]] for a in ATTACKS}

    def theirs():
        with tempfile.TemporaryDirectory(dir=work, prefix="cache_") as cache:
            return run_worker(["torch", model, data, args.k], Path(cache))

    mia_wall, mia_inner, mia_scores = best_run(ours, args.repeats)
    torch_wall, report = best_run(theirs, args.repeats)
    torch_scores = report["scores"]
    worst = check_agreement(mia_scores, torch_scores, args.rtol, args.atol)

    print(f"\n### pandora-style: {args.texts} texts x {args.length} tokens, k = {args.k:g}, best of {args.repeats}; "
          f"torch {report['torch']} ({report['threads']} threads)\n")
    print("| side | attack | scoring loop (s) | after imports (s) | whole process (s) |")
    print("|---|---|---:|---:|---:|")
    for attack in ATTACKS:
        print(f"| torch, batch 1 | {attack} | {report['loops'][attack]:.2f} | | |")
    loops = sum(report["loops"].values())
    print(f"| torch, batch 1 | total, one process (load {report['load']:.2f} s) | {loops:.2f} | "
          f"{report['seconds']:.2f} | {torch_wall:.2f} |")
    print(f"| mia | {spec} | | {mia_inner:.2f} | {mia_wall:.2f} |")
    print(f"\nmia vs the torch loop: {torch_wall / mia_wall:.2f}x faster (whole process; target >= 3.5x), "
          f"{report['seconds'] / mia_inner:.2f}x after imports")
    print("agreement, max |mia - torch|: " + ", ".join(f"{a} {d:.1e}" for a, d in worst.items())
          + f" (rtol {args.rtol:g}, atol {args.atol:g}): ok")
    return {"ratio": torch_wall / mia_wall, "worst": worst, "mia": mia_scores, "torch": torch_scores}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="both", choices=("whole", "pandora", "both"))
    add_shape_flags(ap)
    ap.add_argument("--rows", type=int, default=64, help="texts of the whole-process part")
    ap.add_argument("--texts", type=int, default=256, help="texts of the pandora part")
    ap.add_argument("--length", type=int, default=512, help="tokens per text")
    ap.add_argument("--k", type=float, default=0.1, help="Min-K%% and Min-K%%++ k (pandora's default)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each subprocess; the fastest is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed import subprocess run first")
    ap.add_argument("--rtol", type=float, default=1e-3, help="agreement required between the two sides' scores")
    ap.add_argument("--atol", type=float, default=1e-5)
    return ap


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [WORKER]:
        if argv[1] == "mia":
            return mia_worker(argv[2:])
        return torch_worker(argv[2], argv[3], float(argv[4]))
    args = build_parser().parse_args(argv)
    load0 = os.getloadavg()[0]
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench_attack_sets_") as tmp:
        work = Path(tmp)
        model = work / "model"
        save_random_gpt_neox(model, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        print(f"bench_attack_sets: GPT-NeoX hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab "
              f"{args.vocab}; {os.cpu_count()} CPUs, load average {load0:.1f} at the start")
        if not args.no_warmup:
            warm_up()
        if args.part in ("whole", "both"):
            out["whole"] = part_whole(model, work, args)
        if args.part in ("pandora", "both"):
            out["pandora"] = part_pandora(model, work, args)
    print(f"\nload average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    return out


if __name__ == "__main__":
    main()
