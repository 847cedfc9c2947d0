"""experiments.bench_attack_sets end to end at a tiny size: both parts print their tables, the two sides of the
pandora part agree (or it raises), and the agreement check fails on a planted disagreement."""
import numpy as np
import pytest


def test_bench_attack_sets_runs_both_parts_and_its_agreement_check_can_fail(capsys):
    from experiments.bench_attack_sets import ATTACKS, Disagreement, check_agreement, main

    out = main(["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "128", "--rows", "4", "--texts", "4",
                "--length", "24", "--no-warmup"])
    text = capsys.readouterr().out
    for row in ("| loss |", "| loss,mink,minkpp |", "| torch, batch 1 | total, one process",
                "| mia | loss,mink:k=0.1,minkpp:k=0.1,zlib |", "loss alone vs loss,mink,minkpp:",
                "mia vs the torch loop:", ": ok"):
        assert row in text, row
    for attack in ATTACKS:
        assert f"| torch, batch 1 | {attack} |" in text

    ours, theirs = out["pandora"]["mia"], out["pandora"]["torch"]
    assert set(ours) == set(theirs) == set(ATTACKS) and all(len(v) == 4 for v in ours.values())
    assert len({tuple(np.round(v, 6)) for v in ours.values()}) == 4  # four different scores, not one copied
    check_agreement(ours, theirs, rtol=1e-3, atol=1e-5)
    for attack in ATTACKS:  # one text of one attack off by 1%: the check names it
        planted = {a: list(v) for a, v in theirs.items()}
        planted[attack][2] *= 1.01
        with pytest.raises(Disagreement, match=f"{attack}: .* text 2"):
            check_agreement(ours, planted, rtol=1e-3, atol=1e-5)
