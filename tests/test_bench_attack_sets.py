"""experiments.bench_attack_sets: the agreement check fails on a planted disagreement (default run); end to end at a
tiny size, both parts print their tables and the two sides of the pandora part agree (slow: five subprocesses)."""
import numpy as np
import pytest


def test_agreement_check_names_the_attack_and_text_of_a_planted_disagreement():
    from experiments.bench_attack_sets import ATTACKS, Disagreement, check_agreement

    rng = np.random.default_rng(0)
    ours = {a: list(rng.normal(size=5)) for a in ATTACKS}
    close = {a: [x * (1 + 1e-5) for x in v] for a, v in ours.items()}
    check_agreement(ours, close, rtol=1e-3, atol=1e-5)
    for attack in ATTACKS:  # one text of one attack off by 1%: the check names it
        planted = {a: list(v) for a, v in close.items()}
        planted[attack][2] *= 1.01
        with pytest.raises(Disagreement, match=f"{attack}: .* text 2"):
            check_agreement(ours, planted, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_bench_attack_sets_runs_both_parts_and_the_sides_agree(capsys):
    from experiments.bench_attack_sets import ATTACKS, check_agreement, main

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
