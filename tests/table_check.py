"""Table determinism on fixed rows: an experiment's report and tables rendered again, in a fresh process with another
string-hash seed, from the rows its run saved, must equal the files the run wrote byte for byte.

Set and dict iteration that depends on ``hash()`` would show up here; the whole-run determinism (same seed, same
tables, from nothing) is checked once per experiment under ``@pytest.mark.slow``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import json, sys
from pathlib import Path
from importlib import import_module
from mia.report import csv_text
exp = import_module(sys.argv[1])
out = Path(sys.argv[2])
s = json.loads((out / "summary.json").read_text())
same = {"report.md": exp.report_markdown(s) == (out / "report.md").read_text()}
for stem in sys.argv[3:]:
    rows = json.loads((out / f"{stem}.json").read_text())["rows"]
    same[f"{stem}.csv"] = csv_text(rows) == (out / f"{stem}.csv").read_text()
print(json.dumps(same))
"""


def rendered_again(module: str, out: Path, stems: list[str], hash_seed: int = 12345) -> dict:
    """{file name: True when re-rendered identically} for report.md and each ``stem``.csv of a results dir."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, module, str(out), *stems], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
