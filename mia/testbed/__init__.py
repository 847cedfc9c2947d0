"""A small Pythia-architecture model trained with a recorded data order and checkpoints, for checkpoint MIAs.

``build_testbed("smoke", out_dir)`` (or ``python -m mia.testbed --preset smoke --out DIR``) trains a byte-level BPE
tokenizer on a corpus (the Python standard library by default), packs the corpus into rows of ``seq_len + 1``
tokens joined with EOD = 0 as Pythia does, shuffles the rows with a seeded permutation, and trains a GPT-NeoX model
on them in order: step ``s`` sees rows ``[s*B, (s+1)*B)`` and checkpoint ``step{N}`` has seen rows ``[0, N*B)``.
See ``build`` for the directory layout and ``config.PRESETS`` for the presets; ``suite`` trains several sizes on
one order (``build_suite``, ``SUITES``).

Privacy auditing: ``canaries=m`` inserts a pool of canaries of designed kinds with exact membership
(``mia.testbed.canaries``; ``reserved_tokens`` gives new-token canaries their ids); ``dp_noise=sigma`` trains with
DP-SGD and records the accountant's epsilon (``mia.testbed.dp``); ``build_twin`` trains another model on a
testbed's data (same order, same canaries), e.g. its private twin; ``mia.testbed.finetune`` fine-tunes a trained
testbed on a private set with canaries (full or LoRA, ordinary or DP-SGD).
"""
from .build import Testbed, build_from_config, build_testbed, build_twin, model_config, open_testbed
from .config import PRESETS, TestbedConfig, TestbedError, preset
from .suite import SUITES, Suite, build_suite, open_suite

__all__ = ["PRESETS", "SUITES", "Suite", "Testbed", "TestbedConfig", "TestbedError", "build_from_config",
           "build_suite", "build_testbed", "build_twin", "model_config", "open_suite", "open_testbed", "preset"]
