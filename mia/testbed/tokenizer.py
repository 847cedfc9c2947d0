"""Byte-level BPE trained on the testbed corpus, saved where ``transformers.AutoTokenizer`` finds it.

As Pythia's tokenizer: byte-level pre-tokenization (no prefix space), ``<|endoftext|>`` = id 0 used as EOD
(also bos/eos/unk), no special tokens added when encoding. ``reserved`` > 0 appends that many special tokens
``<|reserved_i|>`` after the BPE vocabulary (ids [bpe size, bpe size + reserved)): ids that the corpus never uses
(the build checks it), for new-token canaries.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

EOD_TOKEN = "<|endoftext|>"
EOD_ID = 0
RESERVED_TOKEN = "<|reserved_{}|>"


def train_tokenizer(texts: Sequence[str], vocab_size: int, reserved: int = 0):
    """A ``PreTrainedTokenizerFast`` with at most ``vocab_size`` BPE tokens, id 0 = ``<|endoftext|>``, then
    ``reserved`` special tokens ``<|reserved_i|>`` (ids ``bpe size + i``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert tok.token_to_id(EOD_TOKEN) == EOD_ID
    if reserved:
        first = tok.get_vocab_size()
        tok.add_special_tokens([tokenizers.AddedToken(RESERVED_TOKEN.format(i), special=True, normalized=False)
                                for i in range(int(reserved))])
        assert [tok.token_to_id(RESERVED_TOKEN.format(i)) for i in (0, reserved - 1)] == [first, first + reserved - 1]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                   unk_token=EOD_TOKEN, model_max_length=1 << 30)


def reserved_ids(tokenizer) -> range:
    """The ids of the reserved tokens ``<|reserved_i|>`` (empty without them): contiguous, after the BPE ids."""
    vocab = tokenizer.get_vocab()
    ids = sorted(v for k, v in vocab.items() if k.startswith("<|reserved_") and k.endswith("|>"))
    if not ids:
        return range(0)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"the tokenizer's reserved tokens are not contiguous ids ({ids[0]}..{ids[-1]})")
    return range(ids[0], ids[0] + len(ids))


def save_tokenizer(tokenizer, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path / "tokenizer.json"


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encode_documents(tokenizer, texts: Sequence[str], batch: int = 64) -> list:
    """Token ids of each document (no special tokens), with the fast tokenizer's batch encoder."""
    backend = tokenizer.backend_tokenizer
    out = []
    for i in range(0, len(texts), batch):
        out.extend(e.ids for e in backend.encode_batch(list(texts[i:i + batch]), add_special_tokens=False))
    return out
