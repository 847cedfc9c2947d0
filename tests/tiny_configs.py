"""Tiny transformers configs of every decoder family: the one place a new family adds its test model.

``PARITY``: odd, mutually prime-ish widths (a transposed or mis-split weight cannot go unnoticed), each family's
distinctive options switched on (GQA, tied heads, local windows, clip_qkv, partial rotary). ``shardable``: widths
and head counts that divide a mesh axis of 4, for the sharding checks. ``tests/test_families_parity.py`` checks
that every registered family has an entry in both.
"""
from __future__ import annotations

import transformers as tf

V = 97  # vocabulary of the PARITY models
SHARD_V = 128  # vocabulary of the shardable models


def _neox(**kw) -> tf.GPTNeoXConfig:
    c = tf.GPTNeoXConfig(**kw)
    c.rope_parameters["partial_rotary_factor"] = kw["rotary_pct"]
    return c

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

PARITY = {
    # partial rotary (0.4 of head_dim 8), parallel residual, untied head
    "gpt_neox": lambda: _neox(vocab_size=V, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
                              intermediate_size=56, max_position_embeddings=64, rotary_pct=0.4,
                              tie_word_embeddings=False),
    # GQA (6 query heads on 2 kv heads), untied head, non-default rope base
    "llama_gqa": lambda: tf.LlamaConfig(
        vocab_size=V, hidden_size=36, intermediate_size=52, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # MHA, tied head, explicit head_dim != hidden/heads, biases on
    "llama_tied": lambda: tf.LlamaConfig(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=5, head_dim=12,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # Llama 3.x RoPE scaling, its three bands exercised: head_dim 16 at base 100 has wavelengths 6.3 ... 353 against
    # an original context of 32 (kept below 8, interpolated in 8-32, divided by 8 above 32); GQA 3 on 1, tied head
    "llama3_rope": lambda: tf.LlamaConfig(
        vocab_size=V, hidden_size=48, intermediate_size=52, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=256, rope_parameters=LLAMA3_ROPE),
    # q/k/v biases, GQA, a sliding layer (window 4 < sequence 13) after a global one (max_window_layers 1), tied head
    "qwen2": lambda: tf.Qwen2Config(
        vocab_size=V, hidden_size=36, intermediate_size=52, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        tie_word_embeddings=True),
    # per-head q/k norms, head_dim 12 != 40 / 4, biases on all four projections, GQA, linear RoPE scaling, untied
    "qwen3": lambda: tf.Qwen3Config(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 3.0}),
    "gpt2": lambda: tf.GPT2Config(
        vocab_size=V, n_embd=40, n_layer=2, n_head=5, n_positions=32, n_inner=52, scale_attn_by_inverse_layer_idx=True),
    # 3 layers: global, local, local; window 4 < sequence 13
    "gpt_neo": lambda: tf.GPTNeoConfig(
        vocab_size=V, hidden_size=40, num_layers=3, num_heads=5, intermediate_size=52, max_position_embeddings=32,
        window_size=4, attention_types=[[["global", "local"], 1], [["local"], 1]]),
    # clip_qkv small enough that it clips; GQA
    "olmo": lambda: tf.OlmoConfig(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, clip_qkv=0.05),
    "olmo2": lambda: tf.Olmo2Config(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2),
    # pre-norm, biases, tied head; learned positions offset by 2
    "opt": lambda: tf.OPTConfig(
        vocab_size=V, hidden_size=40, ffn_dim=52, num_hidden_layers=2, num_attention_heads=5,
        max_position_embeddings=32),
    # OPT-350m's options: post-norm, no final norm, project_in/out (embedding width 24), untied head, no biases
    "opt_post": lambda: tf.OPTConfig(
        vocab_size=V, hidden_size=40, ffn_dim=52, num_hidden_layers=2, num_attention_heads=5,
        max_position_embeddings=32, do_layer_norm_before=False, word_embed_proj_dim=24, tie_word_embeddings=False,
        enable_bias=False),
    # fused qkv (GQA, 6 heads on 2) and gate_up, sliding window 4 < sequence 13, half rotary
    "phi3": lambda: tf.Phi3Config(
        vocab_size=V, hidden_size=36, intermediate_size=52, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
    # GQA, a sliding window of 4 < sequence 13 on every layer
    "mistral": lambda: tf.MistralConfig(
        vocab_size=V, hidden_size=36, intermediate_size=52, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=64),
    # 3 layers: sliding, full, sliding (window 4 < 13); head_dim 12 != 40 / 4; query_pre_attn_scalar != head_dim;
    # both soft caps small enough to bite (tests/test_gemma_mistral.py checks that they and the window matter)
    "gemma2": lambda: tf.Gemma2Config(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, sliding_window=4, query_pre_attn_scalar=10, max_position_embeddings=64,
        attn_logit_softcapping=0.05, final_logit_softcapping=1.0, attn_implementation="eager"),
    # 3 layers (pattern 2: sliding, full, sliding), q/k norms, local and global rotary bases, linear scaling (x8) on
    # the full layer, a final soft cap
    "gemma3_text": lambda: tf.Gemma3TextConfig(
        vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, sliding_window=4, query_pre_attn_scalar=10, max_position_embeddings=64,
        sliding_window_pattern=2, final_logit_softcapping=1.0, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 8.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 30.0}}),
}


def shardable(name: str) -> dict:
    """config.json (a dict) of a tiny model of family ``name`` whose heads and widths divide a mesh axis of 4."""
    small = dict(vocab_size=SHARD_V, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    return {
        "llama": lambda: tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False, **small),
        "gpt2": lambda: tf.GPT2Config(vocab_size=SHARD_V, n_embd=32, n_layer=2, n_head=4, n_positions=128, n_inner=64),
        "gpt_neo": lambda: tf.GPTNeoConfig(vocab_size=SHARD_V, hidden_size=32, num_layers=2, num_heads=4,
                                           intermediate_size=64, max_position_embeddings=128, window_size=8,
                                           attention_types=[[["global", "local"], 1]]),
        "olmo": lambda: tf.OlmoConfig(num_hidden_layers=2, num_key_value_heads=2, clip_qkv=0.5, **small),
        "olmo2": lambda: tf.Olmo2Config(num_hidden_layers=2, num_key_value_heads=2, **small),
        "opt": lambda: tf.OPTConfig(vocab_size=SHARD_V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=16,
                                    do_layer_norm_before=False),
        "phi3": lambda: tf.Phi3Config(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8, pad_token_id=0,
                                      eos_token_id=2, **small),
        "qwen2": lambda: tf.Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1, **small),
        "qwen3": lambda: tf.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **small),
        "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=SHARD_V, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, tie_word_embeddings=False),
        "mistral": lambda: tf.MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8, **small),
        "gemma2": lambda: tf.Gemma2Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                          attn_logit_softcapping=1.0, final_logit_softcapping=5.0, **small),
        "gemma3_text": lambda: tf.Gemma3TextConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                                                   sliding_window=8, sliding_window_pattern=2, **small),
    }[name]().to_dict()


