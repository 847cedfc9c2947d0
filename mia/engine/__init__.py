"""The engine every attack shares: pure jitted functions of (params, tokens, mask) and the host loop around them.

  stats.py          token stats: log p(x_t), mean/std of log p, entropy; the chunked LM-head primitive
  conditional.py    LL(x | p) matrices for ReCaLL / EM-MIA, the prefix's keys/values computed once
  generate.py       batched sampling (SaMIA)
  batching.py       length buckets, rows per batch, padded rows placed on the mesh
  loop.py           the jitted step on the model's layout and the asynchronous host loop
  failsafe.py       jitted steps that fall back to blocked attention when cuDNN's or splash's kernel fails here
  cache.py          the content-addressed on-disk score cache
  distributed.py    several processes under jax.distributed
  plan.py           ``mia plan``: ahead-of-time compilation and per-device memory
  compile_cache.py  JAX's persistent compilation cache

The device mesh and partition rules live in ``mia.sharding`` (below ``mia.models`` and the engine). Importing
``mia.engine`` imports none of these; import the module you need.
"""
