"""mia.engine.generate against transformers on a tiny GPT-NeoX, and the SaMIA attack's scoring against pure Python."""
from __future__ import annotations

import zlib
from collections import Counter

import numpy as np
import pytest

from mia.engine.generate import GenerationError, generate


@pytest.fixture(scope="module")
def sharp_neox(tmp_path_factory):
    """(torch model, our model) of a 2-layer random GPT-NeoX with large weights: peaked, context-dependent next-token
    distributions, so that greedy paths vary and a wrong cache would change them."""
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    import mia.models as mm

    path = tmp_path_factory.mktemp("sharp_neox")
    cfg = GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False,
                        eos_token_id=0, bos_token_id=0)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.35)
    hf.save_pretrained(str(path), safe_serialization=True)
    return hf, mm.load(path)


def hf_greedy(hf, prompt, max_new, eos):
    import torch

    out = hf.generate(
        torch.tensor(prompt[None], dtype=torch.long),
        attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt):].numpy()


def hf_probs(hf, prefix, temperature, top_k):
    """transformers' next-token distribution after ``prefix`` with its temperature then top-k warpers (float64)."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor(np.asarray(prefix)[None], dtype=torch.long)).logits[0, -1].double().numpy()
    z = logits / temperature
    z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    return p / p.sum()


PROMPTS = [
    np.array(p, np.int32) for p in ([5, 17, 3], [40, 2, 9, 9, 71, 12, 30], [88], [7, 7, 61, 25, 3, 50, 11, 4, 19])
]


def test_greedy_equals_transformers_token_for_token(sharp_neox):
    hf, model = sharp_neox
    free = generate(model, PROMPTS, max_new=20, greedy=True, eos_ids=())
    assert len({tuple(o[0]) for o in free}) == len(PROMPTS) and all(len(set(o[0].tolist())) > 3 for o in free)
    for p, o in zip(PROMPTS, free):
        np.testing.assert_array_equal(o[0], hf_greedy(hf, p, 20, None))
    # per-row stop: the EOS id is a token row 1 reaches at step 5 (other rows may stop elsewhere or run to the end)
    eos = int(free[1][0][5])
    stopped = generate(model, PROMPTS, max_new=20, greedy=True, eos_ids=(eos,))
    assert len(stopped[1][0]) == list(free[1][0]).index(eos) + 1 <= 6
    np.testing.assert_array_equal(stopped[1][0], hf_greedy(hf, PROMPTS[1], 20, eos))
    for o, f in zip(stopped, free):  # transformers' rule: the free path up to and including the first EOS
        np.testing.assert_array_equal(o[0], f[0][:list(f[0]).index(eos) + 1] if eos in f[0] else f[0])


def test_sampled_next_tokens_match_the_softmax(sharp_neox):
    """Chi-square goodness of fit of 4000 draws of token 0 (from the prefill) and of token 1 (through the KV cache)
    against transformers' softmax with temperature 0.8 and top-k 12; the same counts reject a wrong temperature."""
    from scipy.stats import chisquare

    hf, model = sharp_neox
    prompt, T, k, n = PROMPTS[1], 0.8, 12, 4000
    draws = np.stack(generate(model, [prompt], max_new=2, n=n, temperature=T, top_k=k, eos_ids=(), seed=1)[0])
    first = draws[:, 0]
    p0 = hf_probs(hf, prompt, T, k)
    assert set(first.tolist()) <= set(np.flatnonzero(p0 > 0).tolist())  # top-k: nothing outside the k best

    def pvalue(tokens, p):
        support = np.flatnonzero(p > 0)
        counts = np.array([(tokens == t).sum() for t in support])
        return chisquare(counts, p[support] * len(tokens)).pvalue

    p_first = pvalue(first, p0)
    assert p_first > 1e-3, p_first
    assert pvalue(first, hf_probs(hf, prompt, 1.6, k)) < 1e-6  # the test has power: a wrong temperature fails
    t0 = np.bincount(first).argmax()
    rows = first == t0
    p_second = pvalue(draws[rows, 1], hf_probs(hf, np.append(prompt, t0), T, k))
    assert rows.sum() > 300 and p_second > 1e-3, (rows.sum(), p_second)
    print(f"chi-square p-values: token 0 {p_first:.3f}, token 1 | token 0 = {t0}: {p_second:.3f} ({rows.sum()} rows)")


def test_kth_largest_is_exact_with_ties_and_infinities():
    import jax
    import jax.numpy as jnp

    from mia.engine.generate import kth_largest

    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 300)).astype(np.float32) * np.float32(10.0) ** rng.uniform(-3, 3, (6, 1)).astype(np.float32)
    x[:, :120] = np.round(x[:, :120])  # ties
    x[0, :7] = -np.inf
    x[1, 3] = np.inf
    x[2, :] = -0.0
    fn = jax.jit(kth_largest, static_argnums=1)
    for k in (1, 2, 50, 299, 300):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), k)), np.sort(x, axis=-1)[:, -k])


def test_refuses_generation_past_the_context(sharp_neox):
    _, model = sharp_neox
    with pytest.raises(GenerationError,
                       match=r"past the model's context: prompt 1 has 60 tokens \+ 8 new = 68 > the 64"):
        generate(model, [PROMPTS[0], np.ones(60, np.int32)], max_new=8, greedy=True)
    with pytest.raises(GenerationError, match="empty"):
        generate(model, [np.zeros(0, np.int32)], max_new=2, greedy=True)


# ------------------------------------------------------------------------------------------------ SaMIA
def rouge1_reference(candidate: list, reference: list) -> float:
    """ROUGE-1 recall written out: matched reference words (each matched at most as often as it occurs in the
    candidate) over the reference length."""
    if not candidate or not reference:
        return 0.0
    left = list(candidate)
    hits = 0
    for word in reference:
        if word in left:
            left.remove(word)
            hits += 1
    return hits / len(reference)


def test_samia_scores_match_a_pure_python_rouge1():
    from mia.attacks.samia import samia_scores, split_prompt

    rng = np.random.default_rng(0)
    vocab = "the a of cat dog sat on mat and ran far away".split()
    refs = [list(rng.choice(vocab, int(rng.integers(1, 12)))) for _ in range(6)] + [["solo"]]
    cands = [[list(rng.choice(vocab, int(rng.integers(0, 15)))) for _ in range(4)] for _ in range(6)]
    cands.append([["solo", "solo"], [], ["x"], ["solo"]])
    for use_zlib in (False, True):
        got = samia_scores(refs, cands, use_zlib=use_zlib)
        want = [np.mean([rouge1_reference(c, r) * (len(zlib.compress(" ".join(c).encode())) if use_zlib else 1)
                         for c in cs]) for r, cs in zip(refs, cands)]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert samia_scores([["a", "b"]], [[["b", "a", "a"]]])[0] == 1.0
    assert Counter(split_prompt("w1 w2\nw3  w4 w5", 0.5)[1]) == Counter(["w3", "w4", "w5"])


def test_samia_attack_end_to_end_seeded_and_order_free(tiny_model):
    """Registered; equal to the scoring of its own samples; seeded: the same seed gives the same samples in another
    run and with the examples in another order (rows draw from their own keys), another seed other samples."""
    from mia.attacks import AttackContext, AttackError, get
    from mia.attacks.samia import samia_scores, sampled_candidates
    from mia.data.examples import Example, tokenize_examples
    from mia.engine.batching import ScoringSettings

    texts = ["the model reads the data and the data is long", "a line of text with several words in it now",
             "value token file member loss train"]
    ex = tokenize_examples(
        [Example(f"s{i}", text=t, label=i % 2) for i, t in enumerate(texts)], tiny_model.tokenizer, 256
    )
    ctx_for = lambda examples, seed: AttackContext(
        tiny_model,
        examples,
        ScoringSettings(progress=False, min_bucket=64),
        {},  # noqa: E731
        {"seed": seed},
    )
    ctx = ctx_for(ex, 0)
    params = dict(get("samia").defaults, n=4, max_length=40)
    s = get("samia").fn(ctx, **params)
    z = get("samia_zlib").fn(ctx, **params)
    refs, cands = sampled_candidates(ctx, **params)
    assert len(cands) == 3 and all(len(c) == 4 for c in cands) and len({" ".join(c) for c in cands[0]}) > 1
    np.testing.assert_array_equal(s, samia_scores(refs, cands))
    np.testing.assert_array_equal(z, samia_scores(refs, cands, use_zlib=True))
    again = sampled_candidates(ctx_for(ex[::-1], 0), **params)[1][::-1]
    assert again == cands
    other = sampled_candidates(ctx_for(ex, 1), **params)[1]
    assert other != cands
    assert samia_scores([refs[0]], [[refs[0]]])[0] == 1.0
    one_word = tokenize_examples([Example("w", text="supercalifragilistic", label=0)], tiny_model.tokenizer, 256)
    with pytest.raises(AttackError, match="example w has 1 word"):
        get("samia").fn(ctx_for(one_word, 0), **params)
    assert get("samia").defaults == dict(n=10, top_k=50, temperature=1.0, prefix_ratio=0.5, max_length=1024)


@pytest.mark.slow
def test_samia_sees_the_memorization_dial(smoke_testbed, tmp_path):
    """The dial check: on the smoke dial split (docs/attacks.md's command) both variants find the members."""
    from experiments.checkmia import run

    s = run("smoke", tmp_path / "dial", testbed_dir=smoke_testbed.root, attacks="samia,samia_zlib", blind=False,
            bootstrap=100, memorize_epochs=8, n_members=100, n_train=0, n_calib=30, n_prefix=4, seed=1, progress=False)
    auc = {r["method"]: r["auc"] for r in s["rows"] if r["kind"] == "attack"}
    assert set(auc) == {"samia", "samia_zlib"} and all(a >= 0.58 for a in auc.values()), auc


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_gqa", "llama_tied", "llama3_rope", "gpt2", "gpt_neo", "olmo", "olmo2",
                                    "qwen2", "qwen3", "opt", "opt_post", "phi3", "mistral", "gemma2", "gemma3_text"])
def test_greedy_equals_transformers_for_every_family(family, tmp_path):
    """GQA, tied heads, learned positions (gpt2; opt: offset 2), local attention windows (gpt_neo, mistral, gemma,
    phi3: window 4 < 20 tokens; qwen2's sliding layer), clip_qkv, llama3 and linear RoPE scaling, per-head q/k norms
    (qwen3), post-norm with project_in/out (opt_post), soft caps (gemma2), per-layer rotary bases (gemma3_text)."""
    import torch
    from transformers import AutoModelForCausalLM

    import mia.models as mm

    from tiny_configs import PARITY

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(PARITY[family]()).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.35)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model = mm.load(tmp_path)
    prompts = [p % 97 for p in PROMPTS]
    ours = generate(model, prompts, max_new=12, greedy=True, eos_ids=())
    for p, o in zip(prompts, ours):
        np.testing.assert_array_equal(o[0], hf_greedy(hf, p, 12, None))
