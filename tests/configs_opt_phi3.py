"""The config.json files that real OPT and Phi-3 checkpoints publish on the Hugging Face Hub, as data (nothing is
downloaded): every field they carry must be parsed, implemented or known to be inert (``tests/test_opt_phi3.py``,
``tests/test_plan.py``)."""
from __future__ import annotations

# facebook/opt-125m: pre-norm, embedding width = hidden size, tied head
OPT_125M = {
    "_name_or_path": "distilgpt2", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
    "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0,
    "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}

# facebook/opt-350m: post-norm blocks, no final norm, a 512-wide embedding projected in and out of 1024
OPT_350M = {
    "_name_or_path": "facebook/opt-350m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": False,
    "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 4096, "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0,
    "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 16, "num_hidden_layers": 24,
    "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.20.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 512,
}

# facebook/opt-6.7b
OPT_6_7B = {
    "_name_or_path": "facebook/opt-6.7b", "_remove_final_layer_norm": False, "activation_dropout": 0.0,
    "activation_function": "relu", "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 16384, "hidden_size": 4096,
    "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 32, "num_hidden_layers": 32, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True, "vocab_size": 50272,
    "word_embed_proj_dim": 4096,
}
OPT_6_7B_PARAMETERS = 6_658_473_984  # the published count (embeddings, 2050 positions, 32 layers, final norm)

# microsoft/Phi-3-mini-4k-instruct: MHA (32 kv heads of 96), sliding window 2047, no rope scaling, untied head
PHI3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064,
}

REAL = {"opt-125m": OPT_125M, "opt-350m": OPT_350M, "opt-6.7b": OPT_6_7B, "phi-3-mini-4k": PHI3_MINI_4K}
# the published parameter counts (a tied head counted once; OPT-350m: no final norm, project_in/out of 512 x 1024)
PARAMETERS = {"opt-125m": 125_239_296, "opt-350m": 331_196_416, "opt-6.7b": OPT_6_7B_PARAMETERS,
              "phi-3-mini-4k": 3_821_079_552}


def tiny_depth_and_width(hf: dict) -> dict:
    """The same config.json at 2 layers and a width of 16-24 (2 heads of 8, or 4 of 6): every other field as
    published (vocabulary, positions, norms, window, token ids, embedding projection when the original has one)."""
    small = dict(hf, num_hidden_layers=2)
    if hf["model_type"] == "opt":
        projects = hf["word_embed_proj_dim"] != hf["hidden_size"]
        return dict(small, hidden_size=16, num_attention_heads=2, ffn_dim=24, word_embed_proj_dim=8 if projects else 16)
    return dict(small, hidden_size=24, num_attention_heads=4, num_key_value_heads=4, intermediate_size=20)
