"""Cheap data checks come before the model is loaded: a data file that labels one input both a member and a
non-member is refused by ``mia score`` and ``mia.score`` without the model being loaded (``mia.api.load`` replaced
by a function that fails the test), with one line naming both lines of the file."""
import json

import pytest

import mia
from mia import api
from mia.cli import main
from mia.data.examples import DataError

CONFLICT = [{"id": "a", "text": "x = 1", "label": 1}, {"id": 7, "text": "y = 2", "label": 0},
            {"id": "b", "text": "x = 1", "label": 0}]
CONFLICT_TOKENS = [{"id": 1, "tokens": [5, 9, 11], "label": 0}, {"id": 2, "tokens": [5, 9, 11], "label": 1}]


@pytest.fixture
def no_model_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the data were checked")

    monkeypatch.setattr(api, "load", boom)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("rows, lines", [(CONFLICT, ("d.jsonl:3", "d.jsonl:1")),
                                         (CONFLICT_TOKENS, ("d.jsonl:2", "d.jsonl:1"))])
def test_cli_refuses_a_label_conflict_before_loading_the_model(tmp_path, capsys, no_model_load, rows, lines):
    data = _write(tmp_path / "d.jsonl", rows)
    (tmp_path / "m").mkdir()  # a model directory that could not be loaded (no config.json)
    capsys.readouterr()
    code = main(["score", "--model", str(tmp_path / "m"), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                 "--no-progress", "--no-cache"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and "both a member and a non-member" in err[0], (code, err)
    assert all(x in err[0] for x in lines), err


@pytest.mark.parametrize("rows", [CONFLICT, CONFLICT_TOKENS])
def test_api_refuses_a_label_conflict_before_loading_the_model(tmp_path, no_model_load, rows):
    with pytest.raises(DataError, match="both a member and a non-member"):
        mia.score(str(tmp_path / "no-such-model"), _write(tmp_path / "d.jsonl", rows), "loss", cache=False,
                  progress=False)
    with pytest.raises(DataError, match="both a member and a non-member"):
        mia.score(str(tmp_path / "no-such-model"), rows, "loss", cache=False, progress=False)


def test_lines_that_may_be_set_aside_are_left_to_the_later_check(tmp_path):
    """With --skip-invalid a text may still tokenize to one token and be set aside, so the early check leaves
    texts alone; token ids given (2 or more) are checked early either way; an empty text never is."""
    texts = [{"id": 1, "text": "a", "label": 1}, {"id": 2, "text": "a", "label": 0}]
    api.check_data(api.read_data(texts), skip_invalid=True)
    with pytest.raises(DataError, match="same text"):
        api.check_data(api.read_data(texts))
    api.check_data(api.read_data([{"id": 1, "text": "", "label": 1}, {"id": 2, "text": "", "label": 0}]))
    api.check_data(api.read_data([{"id": 1, "tokens": [3], "label": 1}, {"id": 2, "tokens": [3], "label": 0}]))
    with pytest.raises(DataError, match="same token ids"):
        api.check_data(api.read_data(CONFLICT_TOKENS), skip_invalid=True)
    # only the scored partitions are checked here, as after tokenizing
    api.check_data(api.read_data([dict(r, partition="train") for r in CONFLICT]))
