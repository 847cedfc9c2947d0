"""Data: training orders (Megatron indexed files, OLMo global indices), split files, local text benchmarks, corpora."""
