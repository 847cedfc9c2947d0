import numpy as np
import pytest
from transformers import GPTNeoXConfig

import mia.models as mm
from hf_tiny import padded_batch, save_tiny, torch_logits


def _cfg(**kw):
    base = dict(vocab_size=97, hidden_size=40, num_hidden_layers=2, num_attention_heads=5, intermediate_size=56,
                max_position_embeddings=64, rotary_pct=0.4, use_parallel_residual=True, tie_word_embeddings=False)
    base.update(kw)
    c = GPTNeoXConfig(**base)
    c.rope_parameters["partial_rotary_factor"] = base["rotary_pct"]
    return c


@pytest.mark.parametrize("kw", [dict(), dict(use_parallel_residual=False), dict(rotary_pct=1.0)])
def test_logits_match_transformers(tmp_path, kw):
    ref = save_tiny(_cfg(**kw), tmp_path)
    model = mm.load(tmp_path)
    tokens, mask = padded_batch(97, [13, 7, 1, 10])
    want = torch_logits(ref, tokens, mask)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=1e-4, rtol=0)


def test_save_roundtrip_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny(_cfg(), tmp_path / "a")
    model = mm.load(tmp_path / "a")
    mm.save(model, tmp_path / "b")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")).float().eval()
    tokens, mask = padded_batch(97, [11, 5])
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    want = torch_logits(back, tokens, mask)
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=1e-4, rtol=0)
