"""One flag vocabulary across the experiments: every flag two experiments share means the same thing in both (name,
action, type, default), and the old spellings are refused with one line naming the new flag."""
import importlib
import inspect

import pytest

from experiments import harness
from mia import metrics

MODULES = ("checkmia", "checkmiabench", "em_mia", "camia", "audit", "curves", "finetune_mia")
# Shared by name but not by design: each experiment has its own presets (em_mia's default None is "default", or
# "paper" with --olmo); audit's --delta is the accountant's, which needs delta > 0, checkmiabench's allows 0.
OWN_MEANING = {"--preset", "--delta", "--help"}
PROBES = ("0", "1", "-1", "2", "7,9", "x", "", "a,b", "1.5", "2147483648")


def _parsers():
    return {m: importlib.import_module(f"experiments.{m}").build_parser() for m in MODULES}


def _actions(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _outcome(kind, value):
    if kind is None:
        return ("str", value)
    try:
        return ("ok", repr(kind(value)))
    except Exception as e:  # noqa: BLE001 - the kind of refusal is what is compared
        return ("error", type(e).__name__)


def _signature(action) -> tuple:
    """What a flag does: its action class, nargs, default, const, choices and what its type makes of PROBES."""
    return (type(action).__name__, action.nargs, repr(action.default), action.const,
            tuple(action.choices) if action.choices else None, tuple(_outcome(action.type, v) for v in PROBES))


def test_every_shared_flag_means_the_same_in_every_experiment():
    by_flag: dict = {}
    for module, parser in _parsers().items():
        for flag, action in _actions(parser).items():
            by_flag.setdefault(flag, {})[module] = action
    shared = {f: d for f, d in by_flag.items() if len(d) > 1 and f not in OWN_MEANING}
    assert {"--testbed", "--member", "--steps", "--bootstrap", "--seed", "--memorize-epochs", "--batch-size",
            "--seq-len", "--olmo", "--global-indices", "--data-paths"} <= set(shared)
    for flag, actions in sorted(shared.items()):
        sigs = {m: _signature(a) for m, a in actions.items()}
        assert len(set(sigs.values())) == 1, (flag, sigs)


def test_the_vocabulary_flags_come_from_the_shared_helpers():
    """Not only equal today: the same objects, defined once in experiments.harness, so they cannot drift."""
    want = {"--testbed": harness.testbed_dir, "--steps": harness.STEPS_TYPE, "--bootstrap": harness.BOOTSTRAP_TYPE,
            "--seed": harness.SEED_TYPE, "--memorize-epochs": harness.MEMORIZE_TYPE}
    for module, parser in _parsers().items():
        actions = _actions(parser)
        for flag, kind in want.items():
            if flag in actions:
                assert actions[flag].type is kind, (module, flag)
        assert actions["--bootstrap"].default == harness.DEFAULT_BOOTSTRAP == metrics.N_RESAMPLES == 1000, module
        if "--testbed" in actions:
            assert actions["--testbed"].default is None and type(actions["--testbed"]).__name__ == "_AppendAction"
        if "--steps" in actions:
            assert actions["--steps"].default is None, module
        if "--member" in actions:
            assert actions["--member"].default is None, module
    for fn in (metrics.bootstrap, metrics.metric_rows, metrics.summary_row):
        assert inspect.signature(fn).parameters["n_resamples"].default == metrics.N_RESAMPLES


@pytest.mark.parametrize("module, old, value, new", [
    ("checkmiabench", "--sizes", "70m", "--member"), ("checkmiabench", "--step", "100", "--steps"),
    ("em_mia", "--step", "100", "--steps"), ("em_mia", "--sizes", "all", "--member"),
    ("camia", "--step", "100", "--steps"), ("camia", "--sizes", "largest", "--member"),
    ("checkmia", "--step", "100", "--steps"),
])
def test_an_old_spelling_is_one_line_naming_the_new_flag(module, old, value, new, capsys):
    main = importlib.import_module(f"experiments.{module}").main
    with pytest.raises(SystemExit) as e:
        main([old, value, "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"{old} was renamed {new}" in err[0], err


def test_an_old_spelling_is_refused_even_with_a_value_that_would_fail(capsys):
    """``--step`` is checked before its value: not an abbreviation of ``--steps`` and not a type error."""
    main = importlib.import_module("experiments.camia").main
    with pytest.raises(SystemExit):
        main(["--step"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step was renamed --steps" in err[0], err


def test_testbed_is_one_directory_per_flag(tmp_path, capsys):
    """The comma list some experiments took is refused with the repeated spelling; a comma inside an existing
    directory's name is that directory."""
    main = importlib.import_module("experiments.checkmiabench").main
    with pytest.raises(SystemExit):
        main(["--testbed", "a,b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one directory per --testbed" in err[0] and "--testbed a --testbed b" in err[0], err
    odd = tmp_path / "x,y"
    odd.mkdir()
    args = importlib.import_module("experiments.checkmiabench").build_parser().parse_args(
        ["--testbed", str(odd), "--testbed", str(tmp_path)])
    assert args.testbed == [str(odd), str(tmp_path)]


@pytest.mark.parametrize("module", ["em_mia", "camia", "checkmia"])
def test_one_checkpoint_experiments_refuse_several_steps(module, capsys):
    main = importlib.import_module(f"experiments.{module}").main
    with pytest.raises(SystemExit):
        main(["--steps", "50,100"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evaluates one checkpoint" in err[0], err


# Beyond the experiments: the same spelling wherever mia takes a checkpoint step, a token budget or a bucket step.
RETIRED = {"--step": "--steps", "--budget": "--batch-tokens", "--token-budget": "--batch-tokens"}


def test_no_command_defines_a_retired_spelling():
    """Every ``add_argument`` of mia/ and experiments/ (the CLI, ``mia split``, every experiment and bench script)
    uses the shared spellings; a retired one exists only as a refusal (``add_renamed_flag``)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*(root / "mia").rglob("*.py"), *(root / "experiments").glob("*.py")]):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for flag in re.findall(r'add_argument\(\s*"(--[a-z-]+)"', line):
                if flag in RETIRED:
                    found.append(f"{path.relative_to(root)}:{n} {flag}")
    assert found == []


@pytest.mark.parametrize("argv, old", [
    (["split", "pythia", "--data", "x.bin", "--step", "5", "--out", "s.jsonl"], "--step"),
    (["split", "olmo", "--global-indices", "g", "--data-paths", "p", "--step", "5", "--out", "s.jsonl"], "--step"),
])
def test_mia_split_takes_steps_and_refuses_step(argv, old, capsys):
    from mia.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{old} was renamed {RETIRED[old]}" in err[0], err


@pytest.mark.parametrize("module, old", [("bench_padding", "--budget"), ("bench_padding", "--step"),
                                         ("bench_attacks", "--token-budget")])
def test_bench_scripts_refuse_their_old_spellings(module, old, capsys):
    main = importlib.import_module(f"experiments.{module}").main
    with pytest.raises(SystemExit) as e:
        main([old, "5"])
    assert e.value.code == 2
    new = "--bucket-step" if (module, old) == ("bench_padding", "--step") else RETIRED[old]
    assert f"{old} was renamed {new}" in capsys.readouterr().err
