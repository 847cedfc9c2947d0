"""experiments.profile_token_stats at a tiny size: every figure it documents is printed, each a positive number."""
import re

import pytest


@pytest.mark.slow
def test_profile_prints_every_part(capsys):
    from experiments.profile_token_stats import main

    main(["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "128", "--batch", "2", "--length", "16",
          "--repeats", "1", "--chunks", "0,4"])
    out = capsys.readouterr().out
    for name in ("2048^3", "mlp_up", "mlp_down", "qkv", "lm_head"):
        assert re.search(rf"matmul {re.escape(name)} .* XLA +[0-9.]+ +numpy +[0-9.]+ GFLOP/s", out), name
    assert len(re.findall(r"^step  chunk +\d+ +(every statistic|log-prob alone) +[0-9.]+ s$", out, re.M)) == 4
    assert re.search(r"^parts body +[0-9.]+ s$", out, re.M)
    assert len(re.findall(r"^parts LM head \+ log-prob, chunk +\d+ +[0-9.]+ s$", out, re.M)) == 2
    assert re.search(r"^parts LM head \+ every statistic", out, re.M)


def test_an_unknown_part_is_one_line(capsys):
    from experiments.profile_token_stats import main

    with pytest.raises(SystemExit):
        main(["--part", "matmul,speed"])
    assert "--part: unknown ['speed']; choose from matmul, step, parts" in capsys.readouterr().err
