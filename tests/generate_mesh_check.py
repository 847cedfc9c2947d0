"""Run in a subprocess with 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

    python tests/generate_mesh_check.py OUT.json NEOX_DIR FAMILY[:MESH[:fsdp|rep]] ...

For each FAMILY (``gpt_neox``: the checkpoint in NEOX_DIR with its tokenizer; another name: ``tiny_configs.shardable``
built with ``from_config``, the vocabulary widened to the tokenizer's, and NEOX_DIR's tokenizer attached), the same
weights on one device (the reference) and on each MESH (``data=2,model=4``; FSDP unless ``:rep``; default meshes:
data=8, data=2,model=4, model=8). On each it generates (the mesh side under ``jax.transfer_guard("disallow")``):
greedy continuations, sampled ones (n=3, top-k, a per-prompt ``max_new``, an EOS that ends some rows early), and
the SaMIA / SaMIA*zlib scores of a few texts. Writes, per family and mesh, whether every sample equals the
one-device sample token for token, how many rows differ, the score differences, how many distinct samples there
are (so equality is not trivial), and the compiled programs' KV-cache layout, to OUT.json.
``tests/test_generate_mesh.py`` asserts on it.
"""
import dataclasses
import json
import sys
import time

import jax
import numpy as np

import mia.models as mm
from mia.attacks import AttackContext, get
from mia.attacks.samia import sampled_candidates
from mia.data.examples import Example, tokenize_examples
from mia.engine.batching import ScoringSettings
from mia.engine.generate import generate
from mia.sharding import make_mesh, parse_mesh

from tiny_configs import shardable

PROMPT_LENGTHS = [3, 7, 1, 12, 5, 20, 9]  # 7 prompts: not a multiple of data=2 or 8
BUDGETS = [10, 4, 12, 8, 10, 6, 11]  # max_new per prompt
GEN = dict(token_budget=64, min_bucket=32)  # one program per setting; 1 prompt per data device per call
TEXTS = ["the model reads the data and the data is long and it goes on",  # even word counts
         "a line of text with several words in it now",
         "value token file member loss train and more words after that one",
         "import json and textwrap dedent the lines now",
         "def main return none if not path else the string"]
SAMIA = dict(n=3, top_k=20, temperature=1.0, prefix_ratio=0.5, max_length=28)


def models(name, neox_dir, one):
    """(reference on one device, a function mesh, fsdp -> the same weights there)."""
    if name == "gpt_neox":  # a real checkpoint: load() reads each device's shard from the memory map
        return mm.load(neox_dir, mesh=one), lambda mesh, fsdp: mm.load(neox_dir, mesh=mesh, fsdp=fsdp)
    ref = mm.load(neox_dir, mesh=one)
    hf = dict(shardable(name), vocab_size=ref.vocab_size, eos_token_id=ref.config.eos_token_id)
    fam = mm.hub.family(hf["model_type"])
    base = dataclasses.replace(mm.from_config(fam.config_cls.from_hf(hf), key=jax.random.PRNGKey(1)),
                               tokenizer=ref.tokenizer)
    return mm.place(base, one), lambda mesh, fsdp: mm.place(base, mesh, fsdp=fsdp)


def sample(model, prompts, eos_ids):
    return generate(model, prompts, max_new=BUDGETS, n=3, top_k=20, temperature=0.9, eos_ids=eos_ids, seed=7,
                    prompt_ids=[11 * i + 5 for i in range(len(prompts))], **GEN)


def common_token(samples):
    """An EOS id that ends some rows early: the most frequent token among the first 3 of each sample."""
    return int(np.bincount(np.concatenate([x[:3] for xs in samples for x in xs])).argmax())


def samia_context(model, texts):
    examples = tokenize_examples([Example(f"t{i}", text=t, label=i % 2) for i, t in enumerate(texts)],
                                 model.tokenizer, 256)
    return AttackContext(model, examples, ScoringSettings(progress=False, min_bucket=16, token_budget=256), {},
                         {"seed": 3})


def echoing_texts(model):
    """TEXTS with their second halves replaced by the words of the model's own first sample (same prompts, same
    example ids, so the same samples): a random tiny model's samples share no words with English, and the scores
    would all be 0."""
    out = []
    for text, cands in zip(TEXTS, sampled_candidates(samia_context(model, TEXTS), **SAMIA)[1]):
        words = text.split()
        k = len(words) // 2  # an even word count: the prompt is the first k words
        out.append(" ".join(words[:k] + (cands[0] + words[k:])[:k]))
    return out


def run(model, prompts, eos, texts, guard):
    t0 = time.time()
    with jax.transfer_guard(guard):  # generation places its inputs explicitly (SaMIA's ROUGE helper does not)
        greedy = generate(model, prompts, max_new=12, greedy=True, eos_ids=(), **GEN)
        sampled = sample(model, prompts, (eos,))
    t1 = time.time()
    ctx = samia_context(model, texts)
    scores = {a: np.asarray(get(a).fn(ctx, **SAMIA), np.float64) for a in ("samia", "samia_zlib")}
    scores["candidates"] = sampled_candidates(ctx, **SAMIA)[1]
    print(f"generate {t1 - t0:.1f} s, samia {time.time() - t1:.1f} s", file=sys.stderr)
    return greedy, sampled, scores


def compare(a, b):
    """Rows (prompt, sample) whose tokens differ (every row when the shapes of the outputs differ)."""
    if [len(xs) for xs in a] != [len(ys) for ys in b]:
        return sum(len(xs) for xs in a)
    return int(sum(not np.array_equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)))


def cache_layout(model):
    """The KV-cache buffer's per-device shape in the compiled sampling program (from the while loop's carry)."""
    from mia.engine.generate import Sampling, jitted_decode
    import re

    b, s, n = 8, 8, 3
    args = (model.params, np.zeros((b, s), np.int32), np.ones((b, s), bool), np.arange(b, dtype=np.uint32),
            np.uint32(0), np.full(b * n, 4, np.int32), np.float32(1.0), np.full(1, -1, np.int32), np.int32(0))
    text = jitted_decode(model, Sampling(max_new=4, n=n, top_k=20)).lower(*args).compile().as_text()
    layers = model.config.num_hidden_layers
    carries = [line.split(" while(")[0] for line in text.splitlines()
               if " while(" in line and 'op_name="jit(step)/while"' in line]
    shapes = sorted({m for c in carries for m in re.findall(rf"f32\[{layers},\d+,{s + 3},\d+,\d+\]", c)})
    return shapes


def main(out_path, neox_dir, specs):
    assert len(jax.devices()) == 8, jax.devices()
    one = make_mesh(devices=jax.devices()[:1])
    report = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        mesh_text, _, kind = rest.partition(":")
        meshes = [mesh_text] if mesh_text else ["data=8", "data=2,model=4", "model=8"]
        ref, on = models(name, neox_dir, one)
        rng = np.random.default_rng(0)  # the same prompts for every spec of a family
        prompts = [rng.integers(1, ref.vocab_size, n).astype(np.int32) for n in PROMPT_LENGTHS]
        eos = common_token(sample(ref, prompts, ()))
        texts = echoing_texts(ref)
        g1, s1, sc1 = run(ref, prompts, eos, texts, "allow")
        for text in meshes:
            model = on(make_mesh(parse_mesh(text, 8)), kind != "rep")
            g8, s8, sc8 = run(model, prompts, eos, texts, "disallow")
            report[f"{name}:{text}:{'fsdp' if model.fsdp else 'rep'}"] = dict(
                greedy_rows_differ=compare(g1, g8), sampled_rows_differ=compare(s1, s8),
                score_diff={a: float(np.abs(sc1[a] - sc8[a]).max()) for a in ("samia", "samia_zlib")},
                scores={a: sc1[a].tolist() for a in ("samia", "samia_zlib")},
                candidates_equal=sc1["candidates"] == sc8["candidates"],
                distinct_candidates=len({" ".join(c) for cs in sc1["candidates"] for c in cs}),
                distinct_greedy=len({tuple(x[0]) for x in g1}),
                distinct_sampled=len({tuple(x) for xs in s1 for x in xs}), rows=sum(len(xs) for xs in s1),
                stopped_early=int(sum(len(x) < m for xs, m in zip(s1, BUDGETS) for x in xs)),
                ended_with_eos=int(sum(len(x) > 0 and x[-1] == eos for xs in s1 for x in xs)),
                lengths=[len(x) for xs in s1 for x in xs],
                cache=cache_layout(model), kv_heads=int(getattr(model.config, "num_key_value_heads", 0) or
                                                        model.config.num_attention_heads))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
