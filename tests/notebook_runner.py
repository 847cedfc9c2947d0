"""Run a notebook's code cells in this process, in order, in one namespace, as a kernel would, without starting one.

The tests then check what the notebook computed (its variables and what it displayed) against the results it reads,
not only that it printed a word. ``IPython.display.display`` is replaced by a recorder for the run; figures are
drawn with matplotlib's Agg backend; the working directory is ``notebooks/`` as in Jupyter. One real kernel run
(``test_quickstart_notebook_runs``, slow) checks that the notebooks also run under Jupyter.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


class Shown(list):
    """Everything a notebook displayed, in order."""

    def images(self) -> list:
        from IPython.display import Image

        return [o for o in self if isinstance(o, Image)]

    def text(self) -> str:
        return "\n".join(getattr(o, "data", None) if isinstance(getattr(o, "data", None), str) else repr(o)
                         for o in self)


def run_notebook(name: str, monkeypatch, env: dict | None = None) -> tuple[dict, Shown, str]:
    """Execute ``notebooks/<name>.ipynb`` -> (its namespace, what it displayed, what it printed)."""
    import IPython.display
    import matplotlib

    matplotlib.use("Agg")
    shown = Shown()
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.chdir(NOTEBOOKS)
    cells = [c for c in json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for k, cell in enumerate(cells):
            source = "".join(cell["source"])
            assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()), \
                f"{name}.ipynb cell {k}: IPython magics do not run here; use plain Python"
            exec(compile(source, f"{name}.ipynb[{k}]", "exec"), namespace)  # noqa: S102
    return namespace, shown, printed.getvalue()


def env_with_this_checkout() -> dict:
    """PYTHONPATH with this checkout first, for notebooks that start experiments in a subprocess."""
    root = str(NOTEBOOKS.parent)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
