"""Bad input at every edge (mia.validate): a table of hostile inputs to ``mia score``, ``mia blind``,
``python -m mia.testbed`` and ``experiments.checkmia``, each run in-process through its ``main(argv)``.

Each case must give exit status 2 and exactly one stderr line, starting ``error:`` and naming the file, field or
option at fault. "Accepted" cases check that good input still gives the right result, and hypothesis fuzzes the
JSONL and safetensors-header readers (any bytes: a valid result or one user error, never another exception).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from mia import validate as V


# ============================================================================================= the harness
def run_main(main, argv, capsys) -> tuple[int, list[str], str]:
    """(exit status, non-empty stderr lines, stdout) of ``main(argv)`` called in-process."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, [l for l in err.splitlines() if l.strip()], out


def assert_one_error(code, lines, *names):
    assert code == 2, (code, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:"), lines
    for name in names:
        assert name in lines[0], (name, lines[0])


@dataclasses.dataclass
class Case:
    """A hostile input: ``files`` (name -> str/bytes/callable(dir) written under a fresh directory), ``argv`` with
    ``{tmp}`` (that directory) and ``{model}`` (the tiny model) filled in, and the ``names`` the error must mention."""

    id: str
    argv: list
    names: tuple
    files: dict = dataclasses.field(default_factory=dict)


GOOD = '{"id": 1, "text": "def f(x):\\n    return x"}\n{"id": 2, "text": "import json\\nprint(json)"}\n'


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def score_case(id, data, names, extra=(), files=None):
    """A ``mia score`` case on data file d.jsonl (contents ``data``) with extra argv (--no-cache unless the case
    is about --cache-dir)."""
    fs = {"d.jsonl": data}
    fs.update(files or {})
    no_cache = [] if "--cache-dir" in extra else ["--no-cache"]
    return Case(id, ["score", "--model", "{model}", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/o.jsonl",
                     "--no-progress", *no_cache, *extra], names, fs)


def _model_copy(tmp: Path, model: Path, *, config=None, weights: Optional[bytes] = None) -> Path:
    """{tmp}/m: the tiny model with its config.json replaced (a dict edit or raw bytes) and/or its weights."""
    m = tmp / "m"
    m.mkdir()
    for f in model.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, m / f.name)
    cfg = json.loads((model / "config.json").read_text())
    if callable(config):
        cfg = config(cfg)
    (m / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
    original = (model / "model.safetensors").read_bytes() if weights is None else weights
    (m / "model.safetensors").write_bytes(original)
    return m


def model_case(id, names, config=None, weights=None):
    def make(tmp, model):
        if id == "weight-int32-layernorm":
            _integer_weight(tmp, model, "gpt_neox.layers.0.input_layernorm.weight", "safetensors")
            return
        _model_copy(tmp, model, config=config, weights=weights)

    return Case(id, ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/o.jsonl",
                     "--no-progress", "--no-cache"], names, {"d.jsonl": GOOD, "m": make})


def _integer_weight(tmp: Path, model: Path, name: str, form: str) -> Path:
    """{tmp}/m: the tiny model with tensor ``name`` stored as int32 (its values rounded), as model.safetensors or
    (``form`` "bin") as a torch.save'd pytorch_model.bin."""
    from mia.models.hub import read_safetensors, write_safetensors

    tensors = {k: np.array(v) for k, v in read_safetensors(model / "model.safetensors").items()}
    tensors[name] = np.rint(tensors[name]).astype(np.int32)
    m = _model_copy(tmp, model)
    if form == "bin":
        import torch

        (m / "model.safetensors").unlink()
        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, m / "pytorch_model.bin")
    else:
        write_safetensors(tensors, m / "model.safetensors")
    return m


def _saved_dataset_dict(path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list([{"text": "a b", "label": 1}, {"text": "c d", "label": 0}])
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(path))


def _set(**kv):
    return lambda cfg: dict(cfg, **kv)


def _drop(key):
    return lambda cfg: {k: v for k, v in cfg.items() if k != key}


def _st(header, data: bytes = b"", length: Optional[int] = None) -> bytes:
    """A safetensors file from a header (any JSON value, or raw bytes) and data bytes."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(head) if length is None else length).to_bytes(8, "little") + head + data


_F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

SCORE_CASES = [
    # --data itself
    Case("data-is-directory", ["score", "--model", "{model}", "--data", "{tmp}", "--out", "{tmp}/o.jsonl"],
         ("--data", "is a directory")),
    Case("data-missing", ["score", "--model", "{model}", "--data", "{tmp}/none.jsonl", "--out", "{tmp}/o.jsonl"],
         ("--data", "not found")),
    score_case("invalid-json", GOOD + '{"id": 3, "text": \n', ("d.jsonl:3", "invalid JSON")),
    score_case("not-an-object", _jsonl([1, 2]), ("d.jsonl:1", "JSON object")),
    score_case("deep-nesting", '{"id": 1, "text": ' + "[" * 100_000 + "\n", ("d.jsonl:1",)),
    score_case("not-utf8", b'{"id": 1, "text": "\xff\xfe ab"}\n', ("d.jsonl:1", "UTF-8")),
    score_case("empty-file", "", ("d.jsonl", "no examples")),
    score_case("id-missing", _jsonl({"id": 1, "text": "a b"}, {"text": "a b c"}), ("d.jsonl:2", "'id'")),
    score_case("id-object", _jsonl({"id": {"a": 1}, "text": "a b c"}), ("d.jsonl:1", "'id'")),
    score_case("id-bool", _jsonl({"id": True, "text": "a b c"}), ("d.jsonl:1", "'id'")),
    score_case("id-surrogate", '{"id": "\\udc80", "text": "a b c"}\n', ("d.jsonl:1", "'id'", "surrogate")),
    score_case("id-duplicate", _jsonl({"id": 1, "text": "a b"}, {"id": "1", "text": "c d"}),
               ("d.jsonl:2", "duplicate id")),
    score_case("label-conflict-text", _jsonl({"id": "a", "text": "x = 1", "label": 1},
                                             {"id": 7, "text": "y = 2", "label": 0},
                                             {"id": "b", "text": "x = 1", "label": 0}),
               ("d.jsonl:3", "'b'", "d.jsonl:1", "'a'", "same text", "both a member and a non-member")),
    score_case("label-conflict-tokens", _jsonl({"id": 1, "tokens": [5, 9, 11], "label": 0},
                                               {"id": 2, "tokens": [5, 9, 11], "label": 1}),
               ("d.jsonl:2", "d.jsonl:1", "same token ids")),
    score_case("label-2", _jsonl({"id": 1, "text": "a b", "label": 2}), ("d.jsonl:1", "'label'")),
    score_case("label-bool", _jsonl({"id": 1, "text": "a b", "label": True}), ("d.jsonl:1", "'label'")),
    score_case("label-string", _jsonl({"id": 1, "text": "a b", "label": "1"}), ("d.jsonl:1", "'label'")),
    score_case("label-nan", '{"id": 1, "text": "a b", "label": NaN}\n', ("d.jsonl:1", "'label'")),
    score_case("no-text-no-tokens", _jsonl({"id": 1, "label": 1}), ("d.jsonl:1", "'text' or a 'tokens'")),
    score_case("text-number", _jsonl({"id": 1, "text": 12}), ("d.jsonl:1", "'text'")),
    score_case("text-lone-surrogate", '{"id": 1, "text": "abc \\ud800 def"}\n', ("d.jsonl:1", "'text'", "surrogate")),
    score_case("tokens-beyond-int32", _jsonl({"id": 1, "tokens": [1, 2 ** 40]}), ("d.jsonl:1", "'tokens'")),
    score_case("tokens-negative", _jsonl({"id": 1, "tokens": [1, -3]}), ("d.jsonl:1", "'tokens'")),
    score_case("tokens-string", _jsonl({"id": 1, "tokens": "1 2 3"}), ("d.jsonl:1", "'tokens'")),
    score_case("tokens-float", _jsonl({"id": 1, "tokens": [1, 2.5]}), ("d.jsonl:1", "'tokens'")),
    score_case("tokens-bool", _jsonl({"id": 1, "tokens": [1, True]}), ("d.jsonl:1", "'tokens'")),
    score_case("tokens-beyond-vocab", _jsonl({"id": 1, "tokens": [1, 100_000]}), ("d.jsonl:1", "vocabulary")),
    score_case("one-token", _jsonl({"id": 1, "tokens": [5]}), ("d.jsonl:1", "at least 2")),
    score_case("partition-misspelt", _jsonl({"id": 1, "text": "a b", "partition": "evaluation"}),
               ("d.jsonl:1", "'partition'", "evaluation")),
    score_case("partition-number", _jsonl({"id": 1, "text": "a b", "partition": 3}), ("d.jsonl:1", "'partition'")),
    # the form of --data (mia.data.sources): a suffix that is none of the forms is refused listing them, never read
    # as JSONL ("invalid JSON (Expecting value)")
    Case("data-suffix-txt", ["score", "--model", "{model}", "--data", "{tmp}/d.txt", "--out", "{tmp}/o.jsonl"],
         ("--data", "d.txt: unsupported file type '.txt'; data can be .jsonl", ".json (an array of row objects",
          ".csv, .tsv, .parquet, or a directory saved by datasets' save_to_disk"), {"d.txt": GOOD}),
    Case("data-suffix-compressed", ["score", "--model", "{model}", "--data", "{tmp}/d.jsonl.gz", "--out",
                                    "{tmp}/o.jsonl"], ("--data", "'.jsonl.gz' (decompress it first)"),
         {"d.jsonl.gz": b"\x1f\x8b\x08\x00"}),
    Case("data-json-array-bad-line", ["score", "--model", "{model}", "--data", "{tmp}/d.json", "--out",
                                      "{tmp}/o.jsonl", "--no-cache"], ("d.json:3: invalid JSON (Expecting value",),
         {"d.json": '[\n {"id": 1, "text": "a b"},\n {"id": 2, "text": }\n]\n'}),
    Case("data-json-array-not-objects", ["score", "--model", "{model}", "--data", "{tmp}/d.json", "--out",
                                         "{tmp}/o.jsonl", "--no-cache"], ("d.json:row 2: expected a JSON object",),
         {"d.json": '[{"id": 1, "text": "a b"}, [2, "c d"]]'}),
    Case("data-json-one-object", ["score", "--model", "{model}", "--data", "{tmp}/d.json", "--out", "{tmp}/o.jsonl",
                                  "--no-cache"], ("d.json: one JSON object over several lines", "JSON array"),
         {"d.json": '{\n "data": [{"text": "a b"}]\n}\n'}),
    Case("data-tsv-bad-label", ["score", "--model", "{model}", "--data", "{tmp}/d.tsv", "--out", "{tmp}/o.jsonl",
                                "--no-cache"], ("d.tsv:row 2: field 'label' must be 0 or 1",),
         {"d.tsv": "text\tlabel\na, b\t1\nc d\t7\n"}),
    Case("data-datasetdict-split-unknown", ["score", "--model", "{model}", "--data", "{tmp}/dd/tset", "--out",
                                            "{tmp}/o.jsonl"],
         ("--data", "dd/tset: no split 'tset' in the saved DatasetDict", "its splits: test, train"),
         {"dd": lambda tmp, model: _saved_dataset_dict(tmp / "dd")}),
    model_case("weight-int32-layernorm", ("model.safetensors", "'gpt_neox.layers.0.input_layernorm.weight'",
                                          "is int32", "floating point")),
    score_case("em-iters-beyond-bound", GOOD, ("em_mia", "iters", "[1, 10000]"),
               ["--attacks", "em_mia:iters=1000000000000"]),
    # options
    score_case("max-length-negative", GOOD, ("--max-length",), ["--max-length", "-5"]),
    score_case("max-length-zero", GOOD, ("--max-length",), ["--max-length", "0"]),
    score_case("max-length-one", GOOD, ("--max-length",), ["--max-length", "1"]),
    score_case("max-length-text", GOOD, ("--max-length",), ["--max-length", "ten"]),
    score_case("max-length-beyond-context", GOOD, ("--max-length", "context"), ["--max-length", "100000"]),
    score_case("batch-tokens-zero", GOOD, ("--batch-tokens",), ["--batch-tokens", "0"]),
    score_case("bootstrap-negative", GOOD, ("--bootstrap",), ["--bootstrap", "-1"]),
    score_case("seed-negative", GOOD, ("--seed",), ["--seed", "-1"]),
    score_case("dtype-unknown", GOOD, ("--dtype",), ["--dtype", "float64"]),
    score_case("init-timeout-zero", GOOD, ("--init-timeout",), ["--init-timeout", "0"]),
    score_case("peer-timeout-zero", GOOD, ("--peer-timeout",), ["--peer-timeout", "0"]),
    score_case("bucket-step-negative", GOOD, ("--bucket-step",), ["--bucket-step", "-128"]),
    score_case("pack-unknown", GOOD, ("--pack",), ["--pack", "always"]),
    score_case("coordinator-port-out-of-range", GOOD, ("--coordinator", "70000", "out of range"),
               ["--coordinator", "localhost:70000", "--num-processes", "2", "--process-id", "0"]),
    score_case("coordinator-port-zero", GOOD, ("--coordinator", "port 0"),
               ["--coordinator", "localhost:0", "--num-processes", "2", "--process-id", "1"]),
    score_case("process-id-without-coordinator", GOOD, ("--process-id", "--coordinator"), ["--process-id", "0"]),
    score_case("num-processes-without-coordinator", GOOD, ("--num-processes", "--coordinator"),
               ["--num-processes", "1"]),
    score_case("attacks-empty", GOOD, ("--attacks",), ["--attacks", ""]),
    score_case("attacks-commas", GOOD, ("--attacks",), ["--attacks", " , ;"]),
    score_case("attack-unknown", GOOD, ("--attacks", "nosuch"), ["--attacks", "loss,nosuch"]),
    score_case("attack-twice", GOOD, ("'loss'", "twice"), ["--attacks", "loss,loss"]),
    score_case("attack-param-twice", GOOD, ("mink", "'k'", "twice"), ["--attacks", "mink:k=0.1,k=0.2"]),
    score_case("attack-param-unknown", GOOD, ("mink", "'q'"), ["--attacks", "mink:q=1"]),
    score_case("attack-param-not-kv", GOOD, ("mink", "key=value"), ["--attacks", "mink:0.1"]),
    score_case("em-iters-zero", GOOD, ("em_mia", "iters"), ["--attacks", "em_mia:iters=0"]),
    score_case("em-iters-negative", GOOD, ("em_mia", "iters"), ["--attacks", "em_mia:iters=-1"]),
    score_case("em-init-unknown", GOOD, ("em_mia", "init"), ["--attacks", "em_mia:init=bogus"]),
    score_case("mink-k-above-one", GOOD, ("--attacks", "mink", "parameter k"), ["--attacks", "mink:k=1.5"]),
    score_case("mink-k-zero", GOOD, ("mink", "parameter k"), ["--attacks", "mink:k=0"]),
    score_case("mink-k-nan", GOOD, ("mink", "parameter k"), ["--attacks", "mink:k=nan"]),
    score_case("minkpp-k-text", GOOD, ("minkpp", "parameter k"), ["--attacks", "minkpp:k=small"]),
    score_case("mope-sigma-zero", GOOD, ("mope", "sigma"), ["--attacks", "mope:sigma=0"]),
    score_case("mope-n-inf", GOOD, ("mope", "parameter n"), ["--attacks", "mope:n=inf"]),
    score_case("camia-method", GOOD, ("camia", "method"), ["--attacks", "camia:method=bogus"]),
    score_case("camia-lr-components", GOOD, ("camia_lr", "components"), ["--attacks", "camia_lr:components=7"]),
    score_case("recall-variant", GOOD, ("recall", "variant"), ["--attacks", "recall:variant=x"]),
    score_case("recall-include-first", GOOD, ("recall", "include_first"), ["--attacks", "recall:include_first=maybe"]),
    score_case("neighbor-p-one", GOOD, ("neighbor", "parameter p"), ["--attacks", "neighbor:p=1"]),
    score_case("samia-temperature-zero", GOOD, ("samia", "temperature"), ["--attacks", "samia:temperature=0"]),
    score_case("ref-without-ref-model", GOOD, ("--ref-model",), ["--attacks", "loss,ref"]),
    score_case("em-init-ref-without-ref-model", GOOD, ("--ref-model",), ["--attacks", "em_mia:init=ref"]),
    score_case("neighbor-without-mlm", GOOD, ("--mlm",), ["--attacks", "neighbor"]),
    score_case("recall-without-prefix", GOOD, ("--prefix-data",), ["--attacks", "loss,recall"]),
    score_case("camia-without-calib", GOOD, ("--calib-data",), ["--attacks", "camia"]),
    score_case("camia-lr-without-train", GOOD, ("--train-data",), ["--attacks", "camia_lr"]),
    score_case("surp-k-zero", GOOD, ("surp", "parameter k"), ["--attacks", "surp:k=0"]),
    score_case("surp-max-entropy-zero", GOOD, ("surp", "max_entropy"), ["--attacks", "surp:max_entropy=0"]),
    score_case("dcpdd-a-zero", GOOD, ("dcpdd", "parameter a"), ["--attacks", "dcpdd:a=0"]),
    score_case("pac-augment-unknown", GOOD, ("pac", "augment", "swap"), ["--attacks", "pac:augment=swap"]),
    score_case("pac-alpha-above-one", GOOD, ("pac", "alpha"), ["--attacks", "pac:alpha=1.5"]),
    score_case("pac-k-min-zero", GOOD, ("pac", "k_min"), ["--attacks", "pac:k_min=0"]),
    score_case("conrecall-gamma-negative", GOOD, ("conrecall", "gamma"), ["--attacks", "conrecall:gamma=-1"]),
    score_case("conrecall-n-zero", GOOD, ("conrecall", "parameter n"), ["--attacks", "conrecall:n=0"]),
    score_case("conrecall-without-member-prefix", GOOD, ("conrecall", "--member-prefix-data"),
               ["--attacks", "loss,conrecall:n=1", "--prefix-data", "{tmp}/p.jsonl"],
               files={"p.jsonl": _jsonl({"id": "p", "text": "x = 1", "label": 0})}),
    score_case("dcpdd-without-freq-corpus", GOOD, ("dcpdd", "--freq-corpus"), ["--attacks", "loss,dcpdd"]),
    score_case("member-prefix-data-missing", GOOD, ("--member-prefix-data", "not found"),
               ["--member-prefix-data", "{tmp}/m.jsonl"]),
    score_case("freq-corpus-directory", GOOD, ("--freq-corpus", "is a directory"), ["--freq-corpus", "{tmp}"]),
    score_case("freq-corpus-not-utf8", GOOD, ("f.txt:2", "UTF-8"),
               ["--attacks", "loss,dcpdd", "--freq-corpus", "{tmp}/f.txt"],
               files={"f.txt": b"import os\n\xff\xfe x\n"}),
    score_case("freq-corpus-token-beyond-int32", GOOD, ("f.jsonl:1", "'tokens'"),
               ["--attacks", "loss,dcpdd", "--freq-corpus", "{tmp}/f.jsonl"],
               files={"f.jsonl": _jsonl({"tokens": [1, 2 ** 40]})}),
    # --documents (mia.documents)
    score_case("doc-id-missing", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1, "partition": "train"},
                                        {"id": 2, "text": "c d", "label": 0}),
               ("d.jsonl:2", "document id missing"), ["--documents"]),
    score_case("doc-id-object", _jsonl({"id": 1, "doc_id": [1], "text": "a b"}), ("d.jsonl:1", "'doc_id'"),
               ["--documents"]),
    score_case("doc-label-disagrees", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1},
                                             {"id": 2, "doc_id": "a", "text": "c d", "label": 0}),
               ("d.jsonl:2", "'a'", "label", "d.jsonl:1"), ["--documents"]),
    score_case("doc-partition-disagrees", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1},
                                                 {"id": 2, "doc_id": "a", "text": "c d", "label": 1,
                                                  "partition": "train"}),
               ("d.jsonl:2", "'a'", "partition"), ["--documents"]),
    score_case("doc-train-unlabelled", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "partition": "train"}),
               ("d.jsonl:1", "'a'", "without a label"), ["--documents"]),
    score_case("doc-no-train", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1},
                                      {"id": 2, "doc_id": "b", "text": "c d", "label": 0}),
               ("d.jsonl", "'train'", "got none"), ["--documents"]),
    score_case("doc-train-one-class", _jsonl(*({"id": i, "doc_id": f"d{i}", "text": "a b", "label": 1,
                                                "partition": "train"} for i in range(3)),
                                             {"id": 9, "doc_id": "e", "text": "c d"}),
               ("d.jsonl", "train document", "members"), ["--documents"]),
    score_case("doc-no-eval", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1, "partition": "train"},
                                     {"id": 2, "doc_id": "b", "text": "c d", "label": 0, "partition": "train"}),
               ("d.jsonl", "'eval'"), ["--documents"]),
    score_case("doc-train-one-class-after-skip", _jsonl({"id": 1, "doc_id": "a", "text": "a b", "label": 1,
                                                        "partition": "train"},
                                                       {"id": 2, "doc_id": "b", "text": "", "label": 0,
                                                        "partition": "train"},
                                                       {"id": 3, "doc_id": "c", "text": "c d"}),
               ("d.jsonl", "train document", "members"), ["--documents", "--skip-invalid"]),
    score_case("doc-features-unknown", GOOD, ("--doc-features",), ["--documents", "--doc-features", "quantiles"]),
    score_case("doc-bins-zero", GOOD, ("--doc-bins",), ["--documents", "--doc-bins", "0"]),
    score_case("doc-classifier-unknown", GOOD, ("--doc-classifier",), ["--documents", "--doc-classifier", "svm"]),
    score_case("seq-tokens-without-documents", GOOD, ("--seq-tokens", "--documents"), ["--seq-tokens", "8"]),
    score_case("seq-tokens-one", GOOD, ("--seq-tokens",), ["--documents", "--seq-tokens", "1"]),
    score_case("seq-tokens-beyond-context", _jsonl({"id": 1, "text": "a b", "label": 1, "partition": "train"},
                                                   {"id": 2, "text": "c d", "label": 0, "partition": "train"},
                                                   {"id": 3, "text": "e f"}),
               ("--seq-tokens", "context"), ["--documents", "--seq-tokens", "100000"]),
    # paths, checked before any work
    score_case("out-is-directory", GOOD, ("--out", "is a directory"), ["--out", "{tmp}"]),
    score_case("out-under-file", GOOD, ("--out", "is a file"), ["--out", "{tmp}/d.jsonl/o.jsonl"]),
    score_case("out-is-data", GOOD, ("--out", "input"), ["--out", "{tmp}/d.jsonl"]),
    score_case("cache-dir-file", GOOD, ("--cache-dir", "is a file"), ["--cache-dir", "{tmp}/d.jsonl"]),
    score_case("cache-dir-under-file", GOOD, ("--cache-dir",), ["--cache-dir", "{tmp}/d.jsonl/cache"]),
    score_case("model-missing", GOOD, ("--model", "not found"), ["--model", "{tmp}/nope"]),
    score_case("model-is-file", GOOD, ("--model", "is a file"), ["--model", "{tmp}/d.jsonl"]),
    score_case("prefix-data-directory", GOOD, ("--prefix-data", "is a directory"), ["--prefix-data", "{tmp}"]),
    score_case("calib-data-missing", GOOD, ("--calib-data", "not found"), ["--calib-data", "{tmp}/c.jsonl"]),
    score_case("train-data-bad-line", GOOD, ("t.jsonl:1", "'label'"), ["--train-data", "{tmp}/t.jsonl"],
               files={"t.jsonl": _jsonl({"id": 9, "text": "x y", "label": 5})}),
    score_case("ref-model-file", GOOD, ("--ref-model", "is a file"), ["--ref-model", "{tmp}/d.jsonl"]),
    score_case("mlm-missing", GOOD, ("--mlm", "not found"), ["--mlm", "{tmp}/nope"]),
    # config.json
    model_case("config-hidden-size-string", ("config.json", "'hidden_size'"), config=_set(hidden_size="96")),
    model_case("config-hidden-size-float", ("config.json", "'hidden_size'"), config=_set(hidden_size=32.0)),
    model_case("config-partial-rotary-1.7", ("config.json", "partial_rotary_factor"),
               config=_set(partial_rotary_factor=1.7, rotary_pct=None)),
    model_case("config-rope-parameters-rotary", ("config.json", "rope_parameters.partial_rotary_factor"),
               config=lambda c: dict(c, rope_parameters=dict(c.get("rope_parameters") or {}, partial_rotary_factor=0))),
    model_case("config-rotary-pct-negative", ("config.json", "'rotary_pct'"), config=_set(rotary_pct=-0.5)),
    model_case("config-layers-negative", ("config.json", "'num_hidden_layers'"), config=_set(num_hidden_layers=-1)),
    model_case("config-vocab-huge", ("config.json", "'vocab_size'"), config=_set(vocab_size=2 ** 40)),
    model_case("config-eps-string", ("config.json", "'layer_norm_eps'"), config=_set(layer_norm_eps="1e-5")),
    model_case("config-flag-string", ("config.json", "'use_parallel_residual'"),
               config=_set(use_parallel_residual="yes")),
    model_case("config-rope-theta-negative", ("config.json", "rope_theta"), config=_set(rotary_emb_base=-1.0,
                                                                                        rope_theta=-1.0)),
    model_case("config-eos-list-bad", ("config.json", "eos_token_id"), config=_set(eos_token_id=[0, "a"])),
    model_case("config-context-zero", ("config.json", "max_position_embeddings"),
               config=_set(max_position_embeddings=0)),
    model_case("config-heads-do-not-divide", ("config.json", "divisible"), config=_set(hidden_size=33)),
    model_case("config-model-type-unknown", ("config.json", "model_type"), config=_set(model_type="mamba")),
    model_case("config-model-type-missing", ("config.json", "model_type"), config=_drop("model_type")),
    model_case("config-model-type-list", ("config.json", "'model_type'"), config=_set(model_type=["gpt_neox"])),
    model_case("config-invalid-json", ("config.json", "invalid JSON"), config=lambda c: b'{"model_type": '),
    model_case("config-not-utf8", ("config.json",), config=lambda c: b'{"model_type": "\xff"}'),
    model_case("config-a-list", ("config.json", "JSON object"), config=lambda c: b"[1, 2]"),
    model_case("config-field-missing", ("config.json", "hidden_size"), config=_drop("hidden_size")),
    # safetensors headers
    model_case("st-huge-length", ("model.safetensors", "header length"), weights=_st({}, length=2 ** 63)),
    model_case("st-random-bytes", ("model.safetensors",),
               weights=np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()),
    model_case("st-short", ("model.safetensors", "8-byte"), weights=b"\x01\x02"),
    model_case("st-header-not-json", ("model.safetensors", "JSON"), weights=_st(b"{not json")),
    model_case("st-header-not-utf8", ("model.safetensors", "UTF-8"), weights=_st(b'{"\xff": 1}')),
    model_case("st-header-a-list", ("model.safetensors", "not an object"), weights=_st([1, 2])),
    model_case("st-entry-string", ("model.safetensors", "'w'", "object"), weights=_st({"w": "F32"})),
    model_case("st-dtype-unknown", ("model.safetensors", "dtype"),
               weights=_st({"w": dict(_F32, dtype="F8")}, b"\0" * 8)),
    model_case("st-shape-strings", ("model.safetensors", "shape"),
               weights=_st({"w": dict(_F32, shape=["2"])}, b"\0" * 8)),
    model_case("st-shape-negative", ("model.safetensors", "shape"),
               weights=_st({"w": dict(_F32, shape=[-2])}, b"\0" * 8)),
    model_case("st-offsets-outside", ("model.safetensors", "data_offsets", "outside"),
               weights=_st({"w": dict(_F32, data_offsets=[0, 1 << 40], shape=[1 << 38])}, b"\0" * 8)),
    model_case("st-offsets-size-mismatch", ("model.safetensors", "data_offsets", "needs"),
               weights=_st({"w": dict(_F32, data_offsets=[0, 4])}, b"\0" * 8)),
    model_case("st-offsets-reversed", ("model.safetensors", "data_offsets"),
               weights=_st({"w": dict(_F32, data_offsets=[8, 0])}, b"\0" * 8)),
    model_case("st-metadata-list", ("model.safetensors", "__metadata__"), weights=_st({"__metadata__": [1]})),
    model_case("st-valid-but-wrong-tensors", ("missing",), weights=_st({"w": _F32}, b"\0" * 8)),
    Case("tokenizer-json-corrupt", ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/o.jsonl",
                                    "--no-progress", "--no-cache"], ("m/tokenizer.json", "not valid JSON"),
         {"d.jsonl": GOOD, "m": lambda tmp, model: (_model_copy(tmp, model),
                                                     (tmp / "m" / "tokenizer.json").write_text('{"version": 3'))}),
    Case("tokenizer-config-corrupt", ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out",
                                      "{tmp}/o.jsonl", "--no-progress", "--no-cache"],
         ("m/tokenizer_config.json", "not valid JSON"),
         {"d.jsonl": GOOD, "m": lambda tmp, model: (_model_copy(tmp, model),
                                                     (tmp / "m" / "tokenizer_config.json").write_bytes(b"\xff{"))}),
    Case("tokenizer-json-a-list", ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out",
                                   "{tmp}/o.jsonl", "--no-progress", "--no-cache"], ("m/tokenizer.json", "JSON object"),
         {"d.jsonl": GOOD, "m": lambda tmp, model: (_model_copy(tmp, model),
                                                     (tmp / "m" / "tokenizer.json").write_text("[1, 2]"))}),
    Case("shard-index-escapes", ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/o.jsonl",
                                 "--no-progress", "--no-cache"], ("model.safetensors.index.json", "file name"),
         {"d.jsonl": GOOD, "m": lambda tmp, model: _sharded(tmp, model, {"weight_map": {"a": "../../x.safetensors"}})}),
    Case("shard-index-values-not-strings", ["score", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--out",
                                            "{tmp}/o.jsonl", "--no-progress", "--no-cache"],
         ("model.safetensors.index.json", "weight_map"),
         {"d.jsonl": GOOD, "m": lambda tmp, model: _sharded(tmp, model, {"weight_map": {"a": 3}})}),
]


def _sharded(tmp: Path, model: Path, index) -> None:
    """{tmp}/m with model.safetensors replaced by a shard index (``index``, a JSON value)."""
    m = _model_copy(tmp, model)
    (m / "model.safetensors").unlink()
    (m / "model.safetensors.index.json").write_text(json.dumps(index))

BLIND_CASES = [
    Case("blind-alpha-2", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--alpha", "2"], ("--alpha",)),
    Case("blind-alpha-0", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--alpha", "0"], ("--alpha",)),
    Case("blind-alpha-nan", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--alpha", "nan"], ("--alpha",)),
    Case("blind-bootstrap-negative", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--bootstrap", "-3"],
         ("--bootstrap",)),
    Case("blind-cv-folds-1", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--cv-folds", "1"],
         ("--cv-folds",)),
    Case("blind-n-train-0", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--n-train", "0"],
         ("--n-train",)),
    Case("blind-features-empty", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--features", ""],
         ("--features", "empty")),
    Case("blind-feature-unknown", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--features", "bow,tfdf"],
         ("--features", "tfdf")),
    Case("blind-classifier-twice", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--classifiers", "lr,lr"],
         ("--classifiers", "twice")),
    Case("blind-split-directory", ["blind", "--split", "{tmp}", "--out", "{tmp}/o"], ("--split", "is a directory")),
    Case("blind-split-missing", ["blind", "--split", "{tmp}/none.jsonl", "--out", "{tmp}/o"], ("--split", "not found")),
    Case("blind-out-is-file", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/s.jsonl"], ("--out", "is a file")),
    Case("blind-encoder-file", ["blind", "--split", "{tmp}/s.jsonl", "--out", "{tmp}/o", "--encoder", "{tmp}/s.jsonl"],
         ("--encoder", "is a file")),
]
for c in BLIND_CASES:
    c.files = {"s.jsonl": GOOD}

TESTBED_CASES = [
    Case("testbed-out-is-file", ["--preset", "smoke", "--out", "{tmp}/f"], ("--out", "is a file"), {"f": "x"}),
    Case("testbed-out-under-file", ["--preset", "smoke", "--out", "{tmp}/f/tb"], ("--out", "is a file"), {"f": "x"}),
    Case("testbed-suite-out-is-file", ["--suite", "smoke", "--out", "{tmp}/f"], ("--out", "is a file"), {"f": "x"}),
    Case("testbed-corpus-missing", ["--out", "{tmp}/tb", "--corpus", "{tmp}/none.jsonl"], ("--corpus", "not found")),
    Case("testbed-checkpoints-text", ["--out", "{tmp}/tb", "--checkpoints", "10,ten"], ("--checkpoints", "'ten'")),
    Case("testbed-vocab-small", ["--out", "{tmp}/tb", "--vocab-size", "10"], ("--vocab-size",)),
    Case("testbed-lr-zero", ["--out", "{tmp}/tb", "--lr", "0"], ("--lr",)),
    Case("testbed-lr-nan", ["--out", "{tmp}/tb", "--lr", "nan"], ("--lr",)),
    Case("testbed-beta1-one", ["--out", "{tmp}/tb", "--beta1", "1"], ("--beta1",)),
    Case("testbed-rotary-1.7", ["--out", "{tmp}/tb", "--rotary-pct", "1.7"], ("--rotary-pct",)),
    Case("testbed-train-steps-0", ["--out", "{tmp}/tb", "--train-steps", "0"], ("--train-steps",)),
    Case("testbed-save-every-0", ["--out", "{tmp}/tb", "--save-every", "0"], ("--save-every",)),
    Case("testbed-memorize-rows-0", ["--out", "{tmp}/tb", "--memorize-rows", "0"], ("--memorize-rows",)),
    Case("testbed-memorize-epochs-huge", ["--out", "{tmp}/tb", "--memorize-epochs", "1000000000000"],
         ("--memorize-epochs", "[0, 1000]", "1000000000000")),
    Case("testbed-train-steps-huge", ["--out", "{tmp}/tb", "--train-steps", "1000001"],
         ("--train-steps", "[1, 1000000]")),
    Case("testbed-warmup-steps-huge", ["--out", "{tmp}/tb", "--warmup-steps", "10000000"], ("--warmup-steps",)),
    Case("testbed-preset-unknown", ["--preset", "huge"], ("--preset",)),
]

CHECKMIA_CASES = [
    Case("checkmia-preset-unknown", ["--preset", "huge", "--out", "{tmp}/o"], ("--preset", "huge")),
    Case("checkmia-testbed-is-file", ["--preset", "smoke", "--testbed", "{tmp}/f", "--out", "{tmp}/o"],
         ("--testbed", "is a file"), {"f": "x"}),
    Case("checkmia-out-is-file", ["--preset", "smoke", "--out", "{tmp}/f"], ("--out", "is a file"), {"f": "x"}),
    Case("checkmia-attacks-empty", ["--preset", "smoke", "--out", "{tmp}/o", "--attacks", ""], ("--attacks",)),
    Case("checkmia-attack-unknown", ["--preset", "smoke", "--out", "{tmp}/o", "--attacks", "nosuch"],
         ("--attacks", "nosuch")),
    Case("checkmia-attack-param", ["--preset", "smoke", "--out", "{tmp}/o", "--attacks", "mink:k=2"],
         ("--attacks", "mink", "k")),
    Case("checkmia-em-iters-0", ["--preset", "smoke", "--out", "{tmp}/o", "--attacks", "em_mia:iters=0"],
         ("--attacks", "iters")),
    Case("checkmia-step-negative", ["--preset", "smoke", "--steps", "-1"], ("--steps",)),
    Case("checkmia-n-members-0", ["--preset", "smoke", "--n-members", "0"], ("--n-members",)),
    Case("checkmia-seed-negative", ["--preset", "smoke", "--seed", "-1"], ("--seed",)),
    Case("checkmia-bootstrap-negative", ["--preset", "smoke", "--bootstrap", "-1"], ("--bootstrap",)),
    Case("checkmia-train-steps-0", ["--preset", "smoke", "--train-steps", "0"], ("--train-steps",)),
    Case("checkmia-train-steps-huge", ["--preset", "smoke", "--train-steps", "1000000000000"],
         ("--train-steps", "[1, 1000000]")),
    Case("checkmia-memorize-epochs-huge", ["--preset", "smoke", "--memorize-epochs", "1000000000000"],
         ("--memorize-epochs", "[0, 1000]")),
    Case("checkmia-corpus-missing", ["--preset", "smoke", "--out", "{tmp}/o", "--corpus", "{tmp}/none"], ("--corpus",)),
]


def _mimir_files(tmp: Path, model: Path) -> None:
    """{tmp}/mimir: MIMIR's cache layout with one domain (arxiv, split ngram_7_0.2), two texts per class."""
    for sub in ("train", "test"):
        d = tmp / "mimir" / "cache_100_200_1000_512" / sub
        d.mkdir(parents=True)
        (d / "arxiv_ngram_7_0.2.jsonl").write_text('"a text"\n"another text"\n')


def _pythia_dir(tmp: Path, model: Path) -> None:
    """{tmp}/py: a --pythia directory holding pythia-70m-deduped/step100 only (a config.json is what is listed)."""
    d = tmp / "py" / "pythia-70m-deduped" / "step100"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")


# Experiments (``python -m experiments.NAME``; argv[0] is NAME): every case fails before a suite is built, a model
# loaded or a split drawn, so each costs milliseconds. {tmp}/f is a file, {tmp}/e an empty directory.
_F = {"f": "x", "e": lambda tmp, model: (tmp / "e").mkdir()}
_O = ["--out", "{tmp}/o"]
EXPERIMENT_CASES = [
    # em_mia
    Case("em-preset-unknown", ["em_mia", "--preset", "huge", *_O], ("--preset", "huge")),
    Case("em-out-is-file", ["em_mia", "--out", "{tmp}/f"], ("--out", "is a file")),
    Case("em-out-under-file", ["em_mia", "--out", "{tmp}/f/o"], ("--out", "is a file")),
    Case("em-seed-negative", ["em_mia", "--seed", "-1", *_O], ("--seed",)),
    Case("em-bootstrap-negative", ["em_mia", "--bootstrap", "-1", *_O], ("--bootstrap",)),
    Case("em-pool-0", ["em_mia", "--pool", "0", *_O], ("--pool",)),
    Case("em-size-1", ["em_mia", "--size", "1", *_O], ("--size",)),
    Case("em-pool-below-half-size", ["em_mia", "--pool", "3", "--size", "10", *_O], ("--pool", "size/2")),
    Case("em-k-0", ["em_mia", "--k", "0", *_O], ("--k",)),
    Case("em-threshold-3", ["em_mia", "--threshold", "3", *_O], ("--threshold",)),
    Case("em-threshold-nan", ["em_mia", "--threshold", "nan", *_O], ("--threshold",)),
    Case("em-doc-len-1", ["em_mia", "--doc-len", "1", *_O], ("--doc-len",)),
    Case("em-step-0", ["em_mia", "--steps", "0", *_O], ("--steps",)),
    Case("em-step-beyond-suite", ["em_mia", "--preset", "smoke", "--steps", "101", *_O],
         ("--steps 101", "smoke suite trains steps (0, 100]")),
    Case("em-memorize-negative", ["em_mia", "--memorize-epochs", "-1", *_O], ("--memorize-epochs",)),
    Case("em-memorize-huge", ["em_mia", "--memorize-epochs", "1000000000000", *_O], ("--memorize-epochs", "1000]")),
    Case("em-testbed-missing", ["em_mia", "--testbed", "{tmp}/none", *_O], ("--testbed", "not found")),
    Case("em-testbed-is-file", ["em_mia", "--testbed", "{tmp}/f", *_O], ("--testbed", "is a file")),
    Case("em-suite-dir-is-file", ["em_mia", "--suite-dir", "{tmp}/f", *_O], ("--suite-dir", "is a file")),
    Case("em-encoder-missing", ["em_mia", "--encoder", "{tmp}/none", *_O], ("--encoder", "not found")),
    Case("em-embeddings-directory", ["em_mia", "--embeddings", "{tmp}/e", *_O], ("--embeddings", "is a directory")),
    Case("em-olmo-missing", ["em_mia", "--olmo", "{tmp}/none", *_O], ("--olmo", "not found")),
    Case("em-olmo-is-file", ["em_mia", "--olmo", "{tmp}/f", *_O], ("--olmo", "is a file")),
    Case("em-ref-model-no-config", ["em_mia", "--olmo", "{tmp}/e", "--ref-model", "{tmp}/e", *_O],
         ("--ref-model", "config.json")),
    Case("em-ref-model-without-olmo", ["em_mia", "--ref-model", "{model}", *_O], ("--ref-model", "--olmo")),
    Case("em-olmo-without-order", ["em_mia", "--olmo", "{tmp}/e", *_O], ("--global-indices",)),
    Case("em-global-indices-missing", ["em_mia", "--olmo", "{tmp}/e", "--global-indices", "{tmp}/none",
                                       "--data-paths", "{tmp}/f", *_O], ("--global-indices", "not found")),
    Case("em-data-paths-directory", ["em_mia", "--olmo", "{tmp}/e", "--global-indices", "{tmp}/f", "--data-paths",
                                     "{tmp}/e", *_O], ("--data-paths", "is a directory")),
    Case("em-member-steps-text", ["em_mia", "--olmo", "{tmp}/e", "--member-steps", "5", *_O], ("--member-steps",)),
    Case("em-step-inside-members", ["em_mia", "--olmo", "{tmp}/e", "--steps", "50", "--global-indices", "{tmp}/f",
                                    "--data-paths", "{tmp}/f", *_O], ("--steps 50",)),
    Case("em-eos-negative", ["em_mia", "--eos", "-1", *_O], ("--eos",)),
    Case("em-batch-size-0", ["em_mia", "--batch-size", "0", *_O], ("--batch-size",)),
    Case("em-seq-len-1", ["em_mia", "--seq-len", "1", *_O], ("--seq-len",)),
    # camia
    Case("camia-preset-unknown", ["camia", "--preset", "paper", *_O], ("--preset", "paper")),
    Case("camia-out-is-file", ["camia", "--out", "{tmp}/f"], ("--out", "is a file")),
    Case("camia-draws-0", ["camia", "--draws", "0", *_O], ("--draws",)),
    Case("camia-n-domains-0", ["camia", "--n-domains", "0", *_O], ("--n-domains",)),
    Case("camia-n-members-negative", ["camia", "--n-members", "-3", *_O], ("--n-members",)),
    Case("camia-n-nonmembers-text", ["camia", "--n-nonmembers", "many", *_O], ("--n-nonmembers",)),
    Case("camia-max-per-class-0", ["camia", "--max-per-class", "0", *_O], ("--max-per-class",)),
    Case("camia-step-0", ["camia", "--steps", "0", *_O], ("--steps",)),
    Case("camia-step-beyond-suite", ["camia", "--preset", "smoke", "--steps", "500", *_O], ("--steps 500", "(0, 100]")),
    Case("camia-testbed-is-file", ["camia", "--testbed", "{tmp}/f", *_O], ("--testbed", "is a file")),
    Case("camia-mimir-missing", ["camia", "--mimir", "{tmp}/none", "--model", "{model}", *_O],
         ("--mimir", "not found")),
    Case("camia-mimir-is-file", ["camia", "--mimir", "{tmp}/f", "--model", "{model}", *_O], ("--mimir", "is a file")),
    Case("camia-mimir-no-files", ["camia", "--mimir", "{tmp}/e", "--model", "{model}", *_O],
         ("--mimir", "no MIMIR files")),
    Case("camia-mimir-domain-unknown", ["camia", "--mimir", "{tmp}/mimir", "--model", "{model}", "--domains",
                                        "pubmed_central", *_O], ("pubmed_central", "domains there: arxiv")),
    Case("camia-mimir-split-unknown", ["camia", "--mimir", "{tmp}/mimir", "--model", "{model}", "--split",
                                       "ngram_13_0.8", *_O], ("ngram_13_0.8", "domains there: arxiv")),
    Case("camia-mimir-without-model", ["camia", "--mimir", "{tmp}/mimir", *_O], ("--mimir needs --model",)),
    Case("camia-model-missing", ["camia", "--mimir", "{tmp}/mimir", "--model", "{tmp}/none", *_O],
         ("--model", "not found")),
    Case("camia-model-no-config", ["camia", "--mimir", "{tmp}/mimir", "--model", "{tmp}/e", *_O],
         ("--model", "config.json")),
    Case("camia-model-is-file", ["camia", "--mimir", "{tmp}/mimir", "--model", "{tmp}/f", *_O],
         ("--model", "is a file")),
    Case("camia-model-without-mimir", ["camia", "--model", "{model}", *_O], ("--model", "--mimir")),
    Case("camia-ref-model-no-config", ["camia", "--mimir", "{tmp}/mimir", "--model", "{model}", "--ref-model",
                                       "{tmp}/e", *_O], ("--ref-model", "config.json")),
    Case("camia-mlm-missing", ["camia", "--mlm", "{tmp}/none", *_O], ("--mlm", "not found")),
    # checkmiabench
    Case("cmb-preset-unknown", ["checkmiabench", "--preset", "huge", *_O], ("--preset", "huge")),
    Case("cmb-paper-and-smoke", ["checkmiabench", "--paper", "--preset", "smoke", *_O], ("--paper", "--preset smoke")),
    Case("cmb-out-under-file", ["checkmiabench", "--out", "{tmp}/f/o"], ("--out", "is a file")),
    Case("cmb-steps-text", ["checkmiabench", "--steps", "100,last", *_O], ("--steps", "'last'")),
    Case("cmb-steps-zero", ["checkmiabench", "--steps", "0", *_O], ("--steps",)),
    Case("cmb-steps-empty", ["checkmiabench", "--steps", ",", *_O], ("--steps",)),
    Case("cmb-steps-beyond-suite", ["checkmiabench", "--preset", "smoke", "--steps", "50,400", *_O],
         ("--steps 400", "(0, 100]")),
    Case("cmb-n-members-0", ["checkmiabench", "--n-members", "0", *_O], ("--n-members",)),
    Case("cmb-n-train-negative", ["checkmiabench", "--n-train", "-1", *_O], ("--n-train",)),
    Case("cmb-bins-0", ["checkmiabench", "--bins", "0", *_O], ("--bins",)),
    Case("cmb-gap-negative", ["checkmiabench", "--gap", "-2", *_O], ("--gap",)),
    Case("cmb-batch-size-0", ["checkmiabench", "--batch-size", "0", *_O], ("--batch-size",)),
    Case("cmb-end-step-0", ["checkmiabench", "--end-step", "0", *_O], ("--end-step",)),
    Case("cmb-memorize-negative", ["checkmiabench", "--memorize-epochs", "-1", *_O], ("--memorize-epochs",)),
    Case("cmb-memorize-huge", ["checkmiabench", "--memorize-epochs", "1001", *_O], ("--memorize-epochs", "1000]")),
    Case("camia-memorize-huge", ["camia", "--memorize-epochs", "1001", *_O], ("--memorize-epochs", "1000]")),
    Case("cmb-attack-param", ["checkmiabench", "--attacks", "mink:k=2", *_O], ("--attacks", "mink", "k")),
    Case("cmb-attack-unknown", ["checkmiabench", "--attacks", "loss,nosuch", *_O], ("--attacks", "nosuch")),
    Case("cmb-testbed-missing", ["checkmiabench", "--testbed", "{tmp}/none", *_O], ("--testbed", "not found")),
    Case("cmb-suite-dir-under-file", ["checkmiabench", "--suite-dir", "{tmp}/f/s", *_O], ("--suite-dir", "is a file")),
    Case("cmb-pythia-missing", ["checkmiabench", "--pythia", "{tmp}/none", *_O], ("--pythia", "not found")),
    Case("cmb-pythia-is-file", ["checkmiabench", "--pythia", "{tmp}/f", *_O], ("--pythia", "is a file")),
    Case("cmb-pythia-and-olmo", ["checkmiabench", "--pythia", "{tmp}/e", "--olmo", "{tmp}/e", *_O], ("not both",)),
    Case("cmb-pythia-without-idx", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", *_O],
         ("--idx missing",)),
    Case("cmb-data-missing", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", "{tmp}/none.bin", "--idx",
                              "{tmp}/f", *_O], ("--data", "none.bin", "not found")),
    Case("cmb-idx-directory", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", "--idx", "{tmp}/e", *_O],
         ("--idx", "is a directory")),
    Case("cmb-pythia-no-checkpoint-at-step", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", "--idx",
                                              "{tmp}/f", "--steps", "200", *_O],
         ("--pythia", "no size has a checkpoint at step 200", "pythia-70m-deduped: steps 100")),
    Case("cmb-pythia-size-missing", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", "--idx", "{tmp}/f",
                                     "--steps", "100", "--member", "1b", *_O],
         ("no checkpoint pythia-1b-deduped/step100",)),
    Case("cmb-pythia-size-unknown", ["checkmiabench", "--pythia", "{tmp}/py", "--data", "{tmp}/f", "--idx", "{tmp}/f",
                                     "--member", "7b", *_O], ("--member", "7b")),
    Case("cmb-olmo-missing", ["checkmiabench", "--olmo", "{tmp}/none", *_O], ("--olmo", "not found")),
    Case("cmb-global-indices-missing", ["checkmiabench", "--olmo", "{tmp}/e", "--global-indices", "{tmp}/none",
                                        "--data-paths", "{tmp}/f", *_O], ("--global-indices", "not found")),
    Case("cmb-olmo-no-checkpoint-at-step", ["checkmiabench", "--olmo", "{tmp}/e", "--global-indices", "{tmp}/f",
                                            "--data-paths", "{tmp}/f", "--steps", "7", *_O],
         ("--olmo", "no checkpoint at step 7")),
    # curves
    Case("curves-results-missing", ["curves", "{tmp}/none"], ("RESULTS_DIR", "not found")),
    Case("curves-results-is-file", ["curves", "{tmp}/f"], ("RESULTS_DIR", "is a file")),
    Case("curves-not-results", ["curves", "{tmp}/e"], ("no summary.json",)),
    Case("curves-bins-0", ["curves", "{tmp}/e", "--bins", "0"], ("--bins",)),
    Case("curves-seed-text", ["curves", "{tmp}/e", "--seed", "x"], ("--seed",)),
]
for c in EXPERIMENT_CASES:
    c.files = dict(_F, mimir=_mimir_files, py=_pythia_dir)


def _materialise(case: Case, tmp: Path, model: Path) -> list[str]:
    for name, content in case.files.items():
        if callable(content):
            content(tmp, model)
        elif isinstance(content, bytes):
            (tmp / name).write_bytes(content)
        else:
            (tmp / name).write_text(content)
    return [str(a).replace("{tmp}", str(tmp)).replace("{model}", str(model)) for a in case.argv]


def _ids(cases):
    return [c.id for c in cases]


@pytest.mark.parametrize("case", SCORE_CASES + BLIND_CASES, ids=_ids(SCORE_CASES + BLIND_CASES))
def test_mia_cli_bad_input(case, tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main

    argv = _materialise(case, tmp_path, tiny_neox_dir)
    code, lines, _ = run_main(main, argv, capsys)
    assert_one_error(code, lines, *case.names)
    assert not (tmp_path / "o.jsonl").exists() or case.id == "out-is-data"  # nothing written on an error


@pytest.mark.parametrize("case", TESTBED_CASES, ids=_ids(TESTBED_CASES))
def test_testbed_cli_bad_input(case, tmp_path, capsys):
    from mia.testbed.__main__ import main

    code, lines, _ = run_main(main, _materialise(case, tmp_path, tmp_path), capsys)
    assert_one_error(code, lines, *case.names)
    assert not (tmp_path / "tb").exists()  # nothing built


@pytest.mark.parametrize("case", CHECKMIA_CASES, ids=_ids(CHECKMIA_CASES))
def test_checkmia_cli_bad_input(case, tmp_path, capsys, monkeypatch):
    from experiments.checkmia import main

    monkeypatch.chdir(tmp_path)  # a default testbeds/ or results/ would land here, and must not appear
    code, lines, _ = run_main(main, _materialise(case, tmp_path, tmp_path) + ["--no-progress"], capsys)
    assert_one_error(code, lines, *case.names)
    assert not (tmp_path / "testbeds").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", EXPERIMENT_CASES, ids=_ids(EXPERIMENT_CASES))
def test_experiment_cli_bad_input(case, tiny_neox_dir, tmp_path, capsys, monkeypatch):
    """``python -m experiments.NAME``: one line naming the option, before any work: no default testbeds/ or
    results/ appear, nothing is written under --out."""
    import importlib

    main = importlib.import_module(f"experiments.{case.argv[0]}").main
    monkeypatch.chdir(tmp_path)
    argv = _materialise(dataclasses.replace(case, argv=case.argv[1:]), tmp_path, tiny_neox_dir)
    code, lines, _ = run_main(main, argv + ([] if case.argv[0] == "curves" else ["--no-progress"]), capsys)
    assert_one_error(code, lines, *case.names)
    assert not (tmp_path / "testbeds").exists() and not (tmp_path / "results").exists()
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case_id", ["conrecall-without-member-prefix", "dcpdd-without-freq-corpus"])
def test_missing_attack_data_stops_before_any_scoring(case_id, tiny_neox_dir, tmp_path, capsys, monkeypatch):
    """conrecall's member prefix and dcpdd's frequency corpus are checked before the first attack (loss) scores."""
    import mia.attacks.context
    from mia.cli import main

    def scored(*a, **k):
        raise AssertionError("an attack was scored before the missing input was reported")

    monkeypatch.setattr(mia.attacks.context, "compute_token_stats", scored)
    case = next(c for c in SCORE_CASES if c.id == case_id)
    code, lines, _ = run_main(main, _materialise(case, tmp_path, tiny_neox_dir), capsys)
    assert_one_error(code, lines, *case.names)


def test_unusable_cache_dir_is_one_error_before_the_compile_cache(tiny_neox_dir, tmp_path, monkeypatch, capsys):
    """MIA_CACHE_DIR a regular file and the score cache on: the one line is the error about the cache directory
    (checked before anything else), not a compilation-cache warning or a traceback."""
    from mia.cli import main

    (tmp_path / "f").write_text("x")
    (tmp_path / "d.jsonl").write_text(GOOD)
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "f"))
    monkeypatch.setenv("MIA_COMPILE_CACHE", "1")
    code, lines, _ = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out",
                                     tmp_path / "o.jsonl"], capsys)
    assert_one_error(code, lines, "MIA_CACHE_DIR", str(tmp_path / "f"), "is a file")


@pytest.mark.parametrize("cache_dir, reason", [("/proc/mia-cache", "cannot be used"),
                                               ("/dev/null/mia-cache", "is a file")])
def test_cache_dir_that_cannot_be_made_names_mia_cache_dir(cache_dir, reason, tiny_neox_dir, tmp_path, monkeypatch,
                                                           capsys):
    """MIA_CACHE_DIR where no directory can be made (/proc refuses new entries even to root, whatever the permission
    bits say): one line naming MIA_CACHE_DIR and the path, from ``mia score`` and from ``mia.score`` alike, before
    any scoring (was: ``error: [Errno 2] No such file or directory: '/proc/mia-cache'`` after the scoring pass)."""
    import mia
    from mia.cli import main

    (tmp_path / "d.jsonl").write_text(GOOD)
    monkeypatch.setenv("MIA_CACHE_DIR", cache_dir)
    code, lines, _ = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out",
                                     tmp_path / "o.jsonl"], capsys)
    assert_one_error(code, lines, "MIA_CACHE_DIR", cache_dir, reason)
    with pytest.raises(ValueError, match=f"MIA_CACHE_DIR {cache_dir}: .*{reason}"):
        mia.score(tiny_neox_dir, tmp_path / "d.jsonl", progress=False)


def test_unwritable_cache_dir_says_so(tiny_neox_dir, tmp_path, monkeypatch, capsys):
    """An existing --cache-dir that cannot be written (os.access says so: tests may run as root) is refused up
    front, naming --cache-dir and saying it is not writable."""
    import os

    from mia.cli import main

    (tmp_path / "c").mkdir()
    (tmp_path / "d.jsonl").write_text(GOOD)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if (Path(p) == tmp_path / "c" and mode & os.W_OK)
                        else real(p, mode, **k))
    code, lines, _ = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out",
                                     tmp_path / "o.jsonl", "--cache-dir", tmp_path / "c"], capsys)
    assert_one_error(code, lines, "--cache-dir", "not writable")


DOCTOR_CASES = [  # mia doctor: each refused before any check runs
    Case("doctor-checks-empty", ["doctor", "--checks", ""], ("--checks: empty; give some of platform, attention",)),
    Case("doctor-checks-commas", ["doctor", "--checks", " , "], ("--checks: empty",)),
    Case("doctor-check-unknown", ["doctor", "--checks", "platform,speeed"],
         ("--checks: unknown doctor check(s) speeed; expected some of platform",)),
    Case("doctor-families-empty", ["doctor", "--families", ","], ("--families: empty; give some of", "gpt2")),
    Case("doctor-family-unknown", ["doctor", "--families", "gpt3"], ("--families: unknown model family(-ies) gpt3",)),
    Case("doctor-json-directory", ["doctor", "--json", "{tmp}"], ("--json", "is a directory")),
    Case("doctor-json-under-file", ["doctor", "--json", "{tmp}/f/r.json"], ("--json", "is a file"), {"f": "x"}),
    Case("doctor-json-cannot-be-written", ["doctor", "--json", "/proc/mia-doctor/r.json"],
         ("--json /proc/mia-doctor/r.json: cannot be written",)),
]


@pytest.mark.parametrize("case", DOCTOR_CASES, ids=_ids(DOCTOR_CASES))
def test_doctor_cli_bad_input(case, tmp_path, capsys, monkeypatch):
    """``mia doctor``: an empty or unknown --checks / --families (an empty one ran nothing and printed "all checks
    passed") and a --json that cannot be written (found after a minute of checks, as a raw ``[Errno 2]`` on a
    temporary file name): one line naming the flag, before any check runs."""
    doctor_module = importlib.import_module("mia.doctor")  # the module; mia.doctor is the function
    from mia.cli import main

    def no_run(*a, **k):
        raise AssertionError("a check ran before the arguments were checked")

    monkeypatch.setattr(doctor_module, "_Run", no_run)
    code, lines, out = run_main(main, _materialise(case, tmp_path, tmp_path), capsys)
    assert_one_error(code, lines, *case.names)
    assert "all checks passed" not in out


def test_doctor_json_directory_is_made_and_python_api_refuses_empty(tmp_path, capsys):
    """--json in a directory that does not exist yet: made (as ``mia score --out``'s is) and written;
    ``mia.doctor(checks=())`` is refused, not an empty report that passed."""
    import mia
    from mia.cli import main

    out = tmp_path / "new" / "sub" / "r.json"
    code, lines, _ = run_main(main, ["doctor", "--checks", "platform", "--families", "gpt2", "--json", out], capsys)
    assert code == 0, lines
    assert json.loads(out.read_text())["ok"] is True
    with pytest.raises(ValueError, match="checks: empty"):
        mia.doctor(checks=())
    with pytest.raises(ValueError, match="families: empty"):
        mia.doctor(checks=("platform",), families=[])


def test_split_text_refuses_a_text_under_both_labels(tmp_path, capsys):
    """``mia split text`` used to write a split in which one text is a member and a non-member (only ``mia score``
    refused it, later): refused when the split is made, by mia score's rule, naming both rows' ids."""
    from mia.cli import main

    (tmp_path / "g.csv").write_text("text,label\nhello there,1\nother text,0\nhello there,0\n")
    code, lines, _ = run_main(main, ["split", "text", "--format", "generic", "--file", tmp_path / "g.csv", "--out",
                                     tmp_path / "s.jsonl"], capsys)
    assert_one_error(code, lines, "g.csv (id '2', label 0): the same text as", "g.csv (id '0', label 1)",
                     "one input cannot be both a member and a non-member")
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("name, content, where", [
    ("m.jsonl", '"a text"\n"another text"\n"broken\n', "m.jsonl:3: invalid JSON (Invalid control character at"),
    ("m.jsonl", '{"text": "a"}\n{"text": "b",}\n', "m.jsonl:2: invalid JSON (Expecting property name"),
    ("m.json", '[\n "a text",\n "b" "c"\n]\n', "m.json:3: invalid JSON (Expecting ',' delimiter"),
])
def test_mimir_bad_json_line_is_named(name, content, where, tmp_path, capsys):
    """A MIMIR file with a bad JSON line: the error names the line (it named only the file, in the datasets
    loader's words "An error occurred while generating the dataset")."""
    from mia.cli import main

    (tmp_path / name).write_text(content)
    (tmp_path / "n.jsonl").write_text('"x y"\n')
    code, lines, _ = run_main(main, ["split", "text", "--format", "mimir", "--member", tmp_path / name,
                                     "--nonmember", tmp_path / "n.jsonl", "--out", tmp_path / "s.jsonl"], capsys)
    assert_one_error(code, lines, where)


def test_corpus_bad_json_line_is_named(tmp_path):
    """The testbed's --corpus (a .jsonl read by datasets) likewise names the bad line."""
    from mia.data.corpus import CorpusError, table_corpus

    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(CorpusError, match=r"c\.jsonl:2: invalid JSON \(Expecting value, column 1\)"):
        table_corpus(tmp_path / "c.jsonl")


@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_integer_weight_is_refused_naming_tensor_and_file(form, tiny_neox_dir, tmp_path):
    """A float weight stored as an integer tensor (an int32 LayerNorm weight) was cast and scored without a word:
    refused naming the tensor and the file, in both weight formats (one function reads both: host_params_from_hf),
    and by ``mia.models.inspect.check_checkpoint`` alike."""
    import mia
    from mia.models.hub import CheckpointError
    from mia.models.inspect import check_checkpoint

    name = "gpt_neox.layers.0.input_layernorm.weight"
    m = _integer_weight(tmp_path, tiny_neox_dir, name, form)
    file = "model.safetensors" if form == "safetensors" else "pytorch_model.bin"
    for load in (lambda: mia.load(m, tokenizer=False), lambda: check_checkpoint(m, digest=False)):
        with pytest.raises(CheckpointError, match=rf"m/{file}: tensor '{name}' is int32; gpt_neox weights are "
                                                  r"floating point") as e:
            load()
        assert "\n" not in str(e.value)


def test_one_class_labels_say_why_there_is_no_table(tiny_neox_dir, tmp_path, capsys, monkeypatch):
    """Labels all one class: ``mia score`` writes the scores and prints one note saying why there is no metrics
    table (it printed nothing); ``run.metrics()`` raises saying the same, never a table of NaN."""
    import mia.api
    from mia.cli import main
    from mia.results import ScoreRun

    def fake_score(model, examples, *a, **k):  # the scoring itself is not what is tested: no model compiles
        return ScoreRun(examples, {"loss": np.arange(len(examples), dtype=np.float64)})

    monkeypatch.setattr(mia.api, "load", lambda *a, **k: None)
    monkeypatch.setattr(mia.api, "score", fake_score)
    (tmp_path / "d.jsonl").write_text(_jsonl({"text": "a b", "label": 1}, {"text": "c d", "label": 1}))
    out = tmp_path / "o.jsonl"
    code, lines, stdout = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out",
                                          out, "--no-cache", "--no-progress"], capsys)
    assert code == 0, lines
    assert "note: no metrics table: the labels are all 1 (members); AUC and TPR need both classes (members and " \
           "non-members)" in lines
    assert "auc" not in stdout.lower() and len(out.read_text().splitlines()) == 2
    run = ScoreRun(mia.api.read_data([{"text": "a", "label": 0}, {"text": "b", "label": 0}]), {"loss": np.zeros(2)})
    with pytest.raises(ValueError, match=r"no metrics: the labels are all 0 \(non-members\); AUC and TPR need both"):
        run.metrics()
    assert "no metrics (the labels are all 0 (non-members))" in repr(run)


def test_table_size():
    """The issue asks for at least 80 cases across the entry points."""
    assert len(SCORE_CASES) + len(BLIND_CASES) + len(TESTBED_CASES) + len(CHECKMIA_CASES) >= 80
    assert len({c.id for c in SCORE_CASES + BLIND_CASES + TESTBED_CASES + CHECKMIA_CASES + EXPERIMENT_CASES}) == \
        len(SCORE_CASES + BLIND_CASES + TESTBED_CASES + CHECKMIA_CASES + EXPERIMENT_CASES)  # ids are unique


# ============================================================================================= accepted inputs
def _torch_mean_nll(model_dir: Path, tokens: np.ndarray) -> float:
    """Independent reference: mean next-token NLL from transformers' PyTorch model."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    with torch.no_grad():
        logits = m(input_ids=torch.tensor(tokens[None], dtype=torch.long)).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1)
    return float(-logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:], dtype=torch.long)].mean())


def test_accepted_data_scores_right(tiny_neox_dir, tmp_path, capsys):
    """Edge cases that are fine: integer and string ids, tokens given directly, label as 1.0, partitions other than
    eval left out of the output, --max-length 2; the loss equals transformers' mean NLL."""
    from mia.cli import main

    rows = [{"id": 7, "tokens": [5, 9, 11, 3], "label": 1.0},
            {"id": "b", "text": "def f(x): return x", "label": 0, "partition": "eval"},
            {"id": "p", "text": "import os", "partition": "prefix"}]
    (tmp_path / "d.jsonl").write_text(_jsonl(*rows) + "\n   \n")  # blank lines are skipped
    out = tmp_path / "o.jsonl"
    code, lines, _ = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out", out,
                                     "--no-progress", "--no-cache", "--max-length", "3"], capsys)
    assert code == 0, lines
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["7", "b"] and got[0]["label"] == 1
    assert got[0]["n_tokens"] == 3 and got[0]["truncated"]
    ref = _torch_mean_nll(tiny_neox_dir, np.array([5, 9, 11]))
    assert got[0]["scores"]["loss"] == pytest.approx(-ref, abs=1e-4)


def test_member_and_nonmember_of_one_input(tiny_neox_dir, tmp_path, capsys):
    """A text labelled 1 and its token ids labelled 0: refused naming both lines. Texts that are only identical
    once truncated to --max-length are scored with a note; the same input twice with the same label is not a
    label conflict."""
    from mia.cli import main
    from mia.models.hub import load_tokenizer

    text = "def f(x):\n    return x + 1\n"
    ids = [int(i) for i in load_tokenizer(tiny_neox_dir)(text)["input_ids"]]
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    argv = ["score", "--model", tiny_neox_dir, "--data", data, "--out", out, "--no-progress", "--no-cache"]
    data.write_text(_jsonl({"id": "t", "text": text, "label": 1}, {"id": "k", "tokens": ids, "label": 0}))
    code, lines, _ = run_main(main, argv, capsys)
    assert_one_error(code, lines, "d.jsonl:2", "'k'", "d.jsonl:1", "'t'", "same token ids")
    data.write_text(_jsonl({"id": 1, "text": text + "a = 1", "label": 1}, {"id": 2, "text": text + "b = 2", "label": 0},
                           {"id": 3, "text": text, "label": 1}, {"id": 4, "text": "import os", "label": 0},
                           {"id": 5, "text": "import os", "label": 0}))
    code, lines, _ = run_main(main, argv + ["--max-length", "4"], capsys)
    assert code == 0, lines
    assert any(l.startswith("note:") and "identical to it once truncated" in l and "d.jsonl:2" in l for l in lines)


def test_long_line_is_cut_before_tokenizing(tiny_neox_dir, tmp_path, capsys):
    """A very long line is cut to max_length * 16 characters before tokenizing; the ids kept equal those of the
    whole text, and a note says so."""
    from mia.cli import main
    from mia.data.examples import CUT_CHARS_PER_TOKEN, bounded_token_ids
    from mia.models.hub import load_tokenizer

    tok = load_tokenizer(tiny_neox_dir)
    words = " ".join(f"value_{i % 97} = json.dumps({i})" for i in range(4000))
    for text in (words, "a" * 50_000, "\n" * 20_000 + words):
        ids, cut = bounded_token_ids(tok, text, 16)
        assert cut and len(text) > 16 * CUT_CHARS_PER_TOKEN
        full = np.asarray(tok(text)["input_ids"])
        np.testing.assert_array_equal(ids[:16], full[:16])
    short = "def f(x): return x"
    ids, cut = bounded_token_ids(tok, short, 16)
    assert not cut and list(ids) == tok(short)["input_ids"]

    (tmp_path / "d.jsonl").write_text(_jsonl({"id": 1, "text": words * 10}))  # ~1.3 MB on one line
    out = tmp_path / "o.jsonl"
    code, lines, _ = run_main(main, ["score", "--model", tiny_neox_dir, "--data", tmp_path / "d.jsonl", "--out", out,
                                     "--no-progress", "--no-cache", "--max-length", "32"], capsys)
    assert code == 0, lines
    assert any(l.startswith("note:") and "cut before tokenizing" in l for l in lines), lines
    row = json.loads(out.read_text())
    assert row["n_tokens"] == 32 and row["truncated"]


def test_all_nan_score_column_is_named_not_misreported():
    from mia.metrics import metric_rows
    from mia.report import metrics_table

    labels = np.array([1, 0, 1, 0, 1, 0])
    table = metrics_table(metric_rows({"good": np.array([3., 1., 4., 1., 5., 0.]), "broken": np.full(6, np.nan),
                                       "half": np.array([np.nan, 1., np.nan, 2., np.nan, 3.])}, labels,
                                      n_resamples=20))
    rows = {l.split()[0]: l for l in table.splitlines()[2:]}
    assert "all 6 scores are non-finite" in rows["broken"]
    assert "need both" not in table
    assert "non-members" in table.splitlines()[-1] and "no metrics" in table.splitlines()[-1]
    good = [l for l in table.splitlines() if l.startswith("good")][0]
    assert float(good.split()[1]) == pytest.approx(1.0)  # members 3,4,5 above non-members 1,1,0


def test_em_mia_scores_refuses_zero_iterations():
    from mia.attacks.em_mia import em_mia_scores
    from mia.attacks.registry import AttackError

    with pytest.raises(AttackError, match="iters"):
        em_mia_scores(np.zeros((3, 3)), np.zeros(3), iters=0)


def test_parse_attacks_accepts_what_it_should():
    from mia.attacks import parse_attacks

    two = "em_mia:prefix_score=kendall;em_mia:prefix_score=rankdist"
    assert [p["prefix_score"] for _, _, p in parse_attacks(two)] \
        == ["kendall", "rankdist"]  # every prefix score em_mia implements passes its declared limits
    got = parse_attacks("loss; mink:k=0.1,zlib,mink:k=1")
    assert [(l, n, p.get("k")) for l, n, p in got] == [("loss", "loss", None), ("mink:k=0.1", "mink", 0.1),
                                                        ("zlib", "zlib", None), ("mink:k=1", "mink", 1.0)]


def test_config_accepted_values(tiny_neox_dir, tmp_path):
    """null where HF writes null, an eos list, rotary fraction 1.0: loaded, not refused."""
    from mia.models.hub import load_config

    m = _model_copy(tmp_path, tiny_neox_dir, config=_set(eos_token_id=[0, 1], bos_token_id=None, rotary_pct=1.0,
                                                          rope_parameters=None, partial_rotary_factor=None))
    _, cfg, _ = load_config(m)
    assert cfg.rotary_pct == 1.0


def _damaged_weights(tmp: Path, model: Path, name: str, value: float) -> Path:
    """{tmp}/m: the tiny model with element [1, 2] of tensor ``name`` set to ``value`` (rewritten safetensors)."""
    from mia.models.hub import read_safetensors, write_safetensors

    tensors = {k: np.array(v) for k, v in read_safetensors(model / "model.safetensors").items()}
    tensors[name][1, 2] = value
    m = _model_copy(tmp, model)
    write_safetensors(tensors, m / "model.safetensors")
    return m


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weight_is_named(value, tiny_neox_dir, tmp_path, capsys):
    """A NaN or inf in one weight: ``mia.load`` refuses the checkpoint naming the tensor (its checkpoint name) and
    the file, and ``mia score`` stops with that one line instead of writing non-finite scores."""
    import mia
    from mia.cli import main
    from mia.models.hub import CheckpointError

    name = "gpt_neox.layers.0.attention.dense.weight"
    m = _damaged_weights(tmp_path, tiny_neox_dir, name, value)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}' holds 1 non-finite") as e:
        mia.load(m)
    assert "\n" not in str(e.value)
    (tmp_path / "d.jsonl").write_text(GOOD)
    code, lines, _ = run_main(main, ["score", "--model", m, "--data", tmp_path / "d.jsonl", "--out",
                                     tmp_path / "o.jsonl", "--no-progress", "--no-cache"], capsys)
    assert_one_error(code, lines, name, str(m / "model.safetensors"), "non-finite")
    assert not (tmp_path / "o.jsonl").exists()


def test_nan_filled_head_of_a_wider_model_is_refused(tiny_neox_dir, tmp_path, capsys):
    """The reported case: ``embed_out.weight`` of a GPT-NeoX full of NaN, large enough (1024 x 64) that XLA:CPU's
    vectorised max drops NaN. ``mia score`` stops with one line naming the tensor (it used to exit 0 with every score
    null)."""
    import shutil

    from transformers import GPTNeoXConfig

    from hf_tiny import save_tiny
    from mia.cli import main
    from mia.models.hub import read_safetensors, write_safetensors

    m = tmp_path / "m"
    save_tiny(GPTNeoXConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False), m)
    shutil.copy(tiny_neox_dir / "tokenizer.json", m / "tokenizer.json")
    tensors = {k: np.array(v) for k, v in read_safetensors(m / "model.safetensors").items()}
    tensors["embed_out.weight"][...] = np.nan
    write_safetensors(tensors, m / "model.safetensors")
    (tmp_path / "d.jsonl").write_text(_jsonl({"id": "a", "tokens": [1, 2, 3, 4], "label": 1},
                                             {"id": "b", "tokens": [5, 6, 7, 8], "label": 0}))
    code, lines, _ = run_main(main, ["score", "--model", m, "--data", tmp_path / "d.jsonl", "--out",
                                     tmp_path / "o.jsonl", "--no-progress", "--no-cache"], capsys)
    assert_one_error(code, lines, "embed_out.weight", "non-finite")
    assert not (tmp_path / "o.jsonl").exists()


def test_weight_overflowing_the_param_dtype_is_named(tiny_neox_dir, tmp_path):
    """A finite float32 weight beyond float16's range (1e6) loads in float32 but not with ``param_dtype="float16"``,
    where it would become inf: refused naming the parameter and the dtype."""
    import warnings

    import mia
    from mia.models.hub import CheckpointError

    m = _damaged_weights(tmp_path, tiny_neox_dir, "embed_out.weight", 1e6)
    mia.load(m, tokenizer=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the overflow is one error, not also a numpy warning
        with pytest.raises(CheckpointError, match=r"parameter .*embed_out.* non-finite once converted to float16"):
            mia.load(m, tokenizer=False, param_dtype="float16")


def test_validated_safetensors_round_trip(tmp_path):
    from mia.models.hub import read_safetensors, write_safetensors

    import ml_dtypes
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4), np.int64),
         "c": np.ones(3, ml_dtypes.bfloat16), "d": np.array(True)}
    write_safetensors(t, tmp_path / "x.safetensors")
    back = read_safetensors(tmp_path / "x.safetensors")
    assert sorted(back) == sorted(t)
    for k in t:
        assert back[k].dtype == t[k].dtype and back[k].shape == t[k].shape
        np.testing.assert_array_equal(np.asarray(back[k]), t[k])
    write_safetensors({"z": np.zeros(0, np.float32)}, tmp_path / "empty.safetensors")
    assert read_safetensors(tmp_path / "empty.safetensors")["z"].shape == (0,)


@pytest.mark.parametrize("kw", [{"dtype": "float8"}, {"dtype": "int8"}, {"param_dtype": "float64x"},
                                {"dtype": np.int32}])
def test_python_api_dtype_error_lists_the_supported_dtypes(kw, tiny_neox_dir):
    """``mia.load(path, dtype=...)`` with an unsupported dtype: one ValueError line naming it and listing
    float32, bfloat16, float16 (before any file is read: the path need not exist)."""
    import mia

    for path in (tiny_neox_dir, "/no/such/model"):
        with pytest.raises(ValueError, match="supported: auto, float32, bfloat16, float16") as e:
            mia.load(path, **kw)
        assert "\n" not in str(e.value) and next(iter(kw)) in str(e.value)


def test_validators_name_the_field():
    with pytest.raises(V.InputError, match="f must be an integer"):
        V.integer("3", "f")
    with pytest.raises(V.InputError, match=r"in \(0, 1\]"):
        V.number(0.0, "x", lo=0, hi=1, lo_open=True)
    assert V.number(1, "x", lo=0, hi=1, lo_open=True) == 1.0
    with pytest.raises(V.InputError, match="surrogate"):
        V.text("a\udfffb", "t")
    assert V.token_ids([0, V.INT32_MAX], "t").dtype == np.int32


# ============================================================================================= fuzzing
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                         st.text(max_size=12))
_json_value = st.recursive(_json_scalar, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                           max_leaves=12)
_field = st.sampled_from(["id", "text", "tokens", "label", "partition", "type"])
_record = st.dictionaries(_field, st.one_of(_json_value, st.lists(st.integers(-5, 2 ** 40), max_size=5),
                                            st.sampled_from(["eval", "prefix", "header", "evaluation", "\ud800"])),
                          max_size=6)


def _line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


_jsonl_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(_record.map(_line), _json_value.map(_line), st.binary(max_size=40)), max_size=6).map(b"".join),
)


def _check_jsonl(tmp_dir: Path, data: bytes):
    from mia.data.examples import DataError, Example, read_examples

    path = tmp_dir / "fuzz.jsonl"
    path.write_bytes(data)
    try:
        header, examples = read_examples(path)
    except DataError as e:
        assert "\n" not in str(e).strip() and str(path) in str(e)
        return
    assert isinstance(header, dict) and examples
    for ex in examples:
        assert isinstance(ex, Example) and isinstance(ex.id, str)
        assert ex.partition in ("eval", "prefix", "calib", "train")
        assert ex.label in (None, 0, 1)
        assert (ex.tokens is None or (ex.tokens.dtype == np.int32 and (ex.tokens >= 0).all())) and \
               (ex.text is None or isinstance(ex.text.encode("utf-8"), bytes))


_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(list(V.SAFETENSORS_DTYPE_BYTES) + ["F8", "x"]), _json_scalar),
    "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), _json_value),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 80), min_size=2, max_size=2), _json_value)})
_header = st.dictionaries(st.one_of(st.just("__metadata__"), st.text(max_size=4)), st.one_of(_entry, _json_value),
                          max_size=4)


@st.composite
def _safetensors_bytes(draw):
    kind = draw(st.sampled_from(["random", "structured", "length"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    head = json.dumps(draw(_header)).encode()
    n = len(head) if kind == "structured" else draw(st.integers(0, 2 ** 64 - 1))
    return n.to_bytes(8, "little") + head + draw(st.binary(max_size=80))


def _check_safetensors(data: bytes):
    try:
        header, start = V.safetensors_header("fuzz.safetensors", head=data)
    except V.InputError as e:
        assert "\n" not in str(e).strip() and "fuzz.safetensors" in str(e)
        return
    for name, (dtype, shape, (lo, hi)) in header.items():
        assert 0 <= lo <= hi <= len(data) - start
        assert hi - lo == math.prod(shape) * V.SAFETENSORS_DTYPE_BYTES[dtype]


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FUZZ_SLOW = settings(max_examples=5000, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(data=_jsonl_bytes)
def test_fuzz_jsonl_reader(tmp_path, data):
    _check_jsonl(tmp_path, data)


@FUZZ
@given(data=_safetensors_bytes())
def test_fuzz_safetensors_header(data):
    _check_safetensors(data)


@pytest.mark.slow
@FUZZ_SLOW
@given(data=_jsonl_bytes)
def test_fuzz_jsonl_reader_long(tmp_path, data):
    _check_jsonl(tmp_path, data)


@pytest.mark.slow
@FUZZ_SLOW
@given(data=_safetensors_bytes())
def test_fuzz_safetensors_header_long(data):
    _check_safetensors(data)


# ---------------------------------------------------------------------------------------------- config.json
@functools.lru_cache(maxsize=None)
def _family_configs() -> tuple[dict, ...]:
    """A valid, complete config.json object of every decoder family (as transformers writes it) and of BERT. Built
    on first use, not at collection: transformers' config classes take seconds to import on every worker."""
    import transformers as tf

    kw = dict(vocab_size=97, num_hidden_layers=2, num_attention_heads=4, intermediate_size=52)
    cfgs = [tf.GPTNeoXConfig(hidden_size=40, rotary_pct=0.5, **kw),
            tf.LlamaConfig(hidden_size=40, num_key_value_heads=2, **kw),
            tf.GPT2Config(vocab_size=97, n_embd=40, n_layer=2, n_head=4),
            tf.GPTNeoConfig(vocab_size=97, hidden_size=40, num_layers=2, num_heads=4, window_size=4,
                            attention_types=[[["global", "local"], 1]]),
            tf.OlmoConfig(hidden_size=40, clip_qkv=0.5, **kw), tf.Olmo2Config(hidden_size=40, **kw),
            tf.BertConfig(hidden_size=40, **kw)]
    return tuple(json.loads(c.to_json_string()) for c in cfgs)


def _config_fields() -> list[str]:
    extra = {"rope_parameters", "rope_scaling", "partial_rotary_factor"}
    return sorted({k for c in _family_configs() for k in c} | extra)


_out_of_range = st.one_of(st.integers(-3, 1), st.integers(2 ** 31 - 2, 2 ** 64), st.floats(-2, 3),
                          st.sampled_from([float("inf"), float("nan"), 1.7, -0.5, 0.0, 1e308, True, "96", "1e-5"]))


@st.composite
def _config_bytes(draw):
    """config.json bytes: a family's valid config with fields set to values of the wrong type or out of range,
    dropped or added (one to four edits, also inside rope_parameters), or any other JSON value, or any bytes."""
    kind = draw(st.sampled_from(["edit", "edit", "edit", "json", "bytes"]))
    if kind == "bytes":  # invalid UTF-8, truncated JSON, a lone surrogate escaped in JSON ...
        return draw(st.one_of(st.binary(max_size=120), st.sampled_from(
            [b'{"model_type": "gpt_neox", "hidden_size": 4\xff}', b'{"model_type": "\ud800"}', b'{"model_type": ',
             b"\xef\xbb\xbf{}", b"[" * 5000, b'{"hidden_size": 1' + b"0" * 5000 + b"}"])))
    if kind == "json":
        return json.dumps(draw(_json_value)).encode()
    hf = json.loads(json.dumps(draw(st.sampled_from(_family_configs()))))
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(_config_fields() + ["extra_field"]))
        how = draw(st.sampled_from(["type", "range", "drop", "rope"]))
        if how == "drop":
            hf.pop(key, None)
        elif how == "rope":
            rope = hf.setdefault("rope_parameters", {}) if isinstance(hf.get("rope_parameters"), dict) else {}
            rope[draw(st.sampled_from(["rope_theta", "partial_rotary_factor", "rope_type", "factor"]))] = \
                draw(st.one_of(_out_of_range, _json_value))
            hf["rope_parameters"] = rope
        else:
            hf[key] = draw(_out_of_range if how == "range" else _json_value)
    return json.dumps(hf).encode()


def _check_config(tmp_dir: Path, data: bytes):
    """load_config (decoders) and the encoder loader: a config of the family's class, every field checked, or one
    ValueError line naming config.json."""
    from mia.models.bert import load_encoder
    from mia.models.hub import CheckpointError, load_config

    d = tmp_dir / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(data)
    try:
        fam, cfg, hf = load_config(d)
    except ValueError as e:
        one_line = str(e).strip()
        assert "\n" not in one_line and "config.json" in one_line, (type(e).__name__, one_line)
    else:
        assert isinstance(hf, dict) and isinstance(cfg, fam.config_cls)
        V.check_config(cfg, "config.json")  # every field of its declared type and range
    try:  # a BERT directory with this config.json and no weights: the config is read (and refused) first
        load_encoder(d, tokenizer=False)
    except CheckpointError as e:
        if "model.safetensors is missing" in str(e):
            return  # the config was accepted
        assert "\n" not in str(e).strip() and "config.json" in str(e), str(e)
    except ValueError as e:
        assert "\n" not in str(e).strip() and "config.json" in str(e), (type(e).__name__, str(e))


@FUZZ
@given(data=_config_bytes())
def test_fuzz_config_json(tmp_path, data):
    _check_config(tmp_path, data)


@pytest.mark.slow
@FUZZ_SLOW
@given(data=_config_bytes())
def test_fuzz_config_json_long(tmp_path, data):
    _check_config(tmp_path, data)


def test_family_configs_are_accepted(tmp_path):
    """The fuzz's templates are valid: each loads (so the mutations start from a config that passes)."""
    from mia.models.hub import load_config

    for hf in _family_configs()[:-1]:
        (tmp_path / "config.json").write_text(json.dumps(hf))
        fam, _, _ = load_config(tmp_path)
        assert fam.model_type == hf["model_type"]


def test_safetensors_header_from_a_file_matches_bytes(tmp_path):
    """The file path and the in-memory path of the header reader agree (the fuzz test uses the latter)."""
    data = _st({"w": _F32, "__metadata__": {"format": "pt"}}, b"\0" * 8)
    (tmp_path / "x.safetensors").write_bytes(data)
    assert V.safetensors_header(tmp_path / "x.safetensors") == V.safetensors_header("x", head=data)


# ============================================================================================= experiments
class _RowsTestbed:
    """The few attributes of ``mia.testbed.Testbed`` a checkpoint split needs, over rows written here."""

    batch_size, epoch_steps, train_steps, steps = 4, 10, 10, [5, 10]

    def __init__(self, root: Path, rows: np.ndarray, vocab_size: int):
        from mia.data.indexed import write_indexed

        self.root = root
        write_indexed(root / "order", rows)
        self.config = type("Config", (), {"config_hash": "0" * 16})()
        self.manifest = {"tokenizer": {"vocab_size": vocab_size}, "corpus": {"sha256": "0" * 64}}

    def dataset(self):
        from mia.data.indexed import IndexedDataset

        return IndexedDataset(self.root / "order")

    def checkpoint_dir(self, step, create=True):
        return self.root / f"step{step}"


def test_testbed_split_checks_the_model_vocabulary(tmp_path):
    """``mia.data.draw.draw_testbed_split`` draws with the testbed model's vocabulary: one id outside it (row
    13, a member of step 5) stops the draw naming the row and the vocabulary; the same rows within it draw."""
    from mia.data.draw import SplitSizes, draw_testbed_split

    rows = np.random.default_rng(0).integers(0, 300, size=(40, 9)).astype(np.uint16)
    rows[13, 4] = 300
    sizes = SplitSizes(eval=20)  # every member row [0, 20) is drawn, row 13 among them
    with pytest.raises(ValueError, match=r"row 13 .*id 300, outside the model vocabulary \(300 ids\)"):
        draw_testbed_split(_RowsTestbed(tmp_path / "a", rows, 300), 5, sizes, seed=0)
    header, examples, _ = draw_testbed_split(_RowsTestbed(tmp_path / "b", rows, 301), 5, sizes, seed=0)
    assert sorted(e["index"] for e in examples if e["label"] == 1) == list(range(20))


def test_mimir_texts_beyond_the_model_vocabulary(tiny_neox_dir, tmp_path, capsys):
    """MIMIR texts are tokenized with --model's tokenizer; a tokenizer with an id the model's embedding does not have
    (an added token) stops with one line naming the domain file and the vocabulary, before any scoring."""
    import transformers

    from experiments.camia import main

    model = Path(shutil.copytree(tiny_neox_dir, tmp_path / "m"))
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok.add_tokens(["qqzzyy"])
    tok.save_pretrained(str(model))
    assert tok.convert_tokens_to_ids("qqzzyy") >= vocab
    _mimir_files(tmp_path, model)
    (tmp_path / "mimir" / "cache_100_200_1000_512" / "test" / "arxiv_ngram_7_0.2.jsonl").write_text(
        '"a text"\n"qqzzyy another text"\n')
    code, lines, _ = run_main(main, ["--mimir", tmp_path / "mimir", "--model", model, "--out", tmp_path / "o",
                                     "--no-progress", "--no-blind"], capsys)
    assert_one_error(code, lines, "arxiv/ngram_7_0.2", f">= the vocabulary size {vocab}", "--model")
    assert not (tmp_path / "o" / "summary.json").exists()
