"""The random models the benchmarks share: a Pythia-shaped GPT-NeoX made by transformers and saved to a directory, so
that mia loads it through the same reader as a real checkpoint and the torch side runs the same weights."""
from __future__ import annotations


def add_shape_flags(ap, hidden=512, layers=6, heads=8, vocab=50304) -> None:
    """--hidden --layers --heads --vocab of the random GPT-NeoX (defaults: Pythia-70m's shape)."""
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--vocab", type=int, default=vocab)


def save_random_gpt_neox(path, *, hidden: int, layers: int, heads: int, vocab: int, seed: int = 0):
    """A random GPT-NeoX made by transformers (MLP 4 x hidden, rotary on a quarter of each head, untied head, as
    Pythia), saved to ``path`` as safetensors + config.json; returns the float32 torch model in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * hidden,
                                     max_position_embeddings=2048, rotary_pct=0.25, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model
