"""Byte-level BPE trained on the testbed corpus, saved where ``transformers.AutoTokenizer`` finds it.

As Pythia's tokenizer: byte-level pre-tokenization (no prefix space), ``<|endoftext|>`` = id 0 used as EOD
(also bos/eos/unk), no special tokens added when encoding.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

EOD_TOKEN = "<|endoftext|>"
EOD_ID = 0


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A ``PreTrainedTokenizerFast`` with at most ``vocab_size`` tokens, id 0 = ``<|endoftext|>``."""
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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                   unk_token=EOD_TOKEN, model_max_length=1 << 30)


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
