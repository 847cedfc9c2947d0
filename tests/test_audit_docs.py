"""Statements about DP sampling and accounting, in the docs and docstrings, checked against the code: the Poisson
sampling rate the testbed uses, and the fixed-batch against Poisson epsilons that docs/auditing.md states."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mia.testbed import dp, preset

ROOT = Path(__file__).resolve().parent.parent
AUDITING = ROOT / "docs" / "auditing.md"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_poisson_rate_is_described_as_the_code_draws_it():
    """Each record joins each step with probability 1 / train_steps (not batch_size / records: with canary copies
    the records outnumber train_steps x batch_size); the config's comment and the CLI's help say so."""
    cfg = preset("smoke", train_steps=40, canaries=96, canary_reps=(1, 4, 16), dp_noise=1.0)
    assert dp.sample_rate(cfg) == 1 / cfg.train_steps != cfg.batch_size / dp.n_records(cfg)
    sizes = [len(dp.poisson_batch(cfg, step)) for step in range(cfg.train_steps)]
    expected = dp.n_records(cfg) / cfg.train_steps  # batch_size natural rows plus the copies' share, on average
    assert abs(np.mean(sizes) - expected) < 4 * np.sqrt(expected / cfg.train_steps)
    source = (ROOT / "mia" / "testbed" / "config.py").read_text()
    comment = _flat(source[source.index("dp_sampling: str"):source.index("def __post_init__")])
    assert "q = 1 / train_steps" in comment and "batch_size / records" not in comment
    from mia.testbed.__main__ import build_parser

    assert "probability 1/train_steps" in _flat(build_parser().format_help())


def _fixed_batch_sentence() -> str:
    text = _flat(AUDITING.read_text())
    return text[text.index("- **fixed**: each record is read by exactly one step"):][:1200]


def test_docs_do_not_claim_fixed_batches_always_cost_more():
    sentence = _fixed_batch_sentence()
    assert "much larger epsilon for the same noise" not in sentence
    assert re.search(r"at noise 0\.3116 .* Poisson gives \*\*15\.988\*\* and fixed batches \*\*14\.819\*\*", sentence)


@pytest.mark.slow
def test_the_fixed_batch_numbers_are_the_accountants():
    """Every number of the docs' fixed-batch bullet, from the accountant (smoke preset, delta 1/1600), and the
    crossing near noise 0.328 (Poisson above fixed just below it, fixed above Poisson just above it)."""
    sentence = _fixed_batch_sentence()
    cfg = preset("smoke", dp_noise=1.0)

    def both(noise):
        c = cfg.replace(dp_noise=noise)
        return dp.accountant_epsilon(c), dp.accountant_epsilon(c.replace(dp_sampling="fixed"))

    for noise, (poisson, fixed) in ((0.5, (3.809, 7.864)), (1.0, (0.377, 3.284)), (0.3116, (15.988, 14.819))):
        assert f"{poisson:.3f}" in sentence and f"{fixed:.3f}" in sentence
        assert [round(x, 3) for x in both(noise)] == [poisson, fixed]
    below, above = both(0.326), both(0.330)
    assert below[0] > below[1] and above[0] < above[1] and "near noise 0.328 (epsilon 13.8)" in sentence
