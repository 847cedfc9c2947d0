"""pytest plugin: where a test run's JAX time goes, per test file (what docs/testing.md quotes).

    python -m pytest -q -n 2 --dist loadfile -p tests.jax_time_report   # then: python -m tests.jax_time_report DIR

Each process sums JAX's own monitoring events (jaxpr tracing, lowering to MLIR, XLA backend compile and the number
of programs compiled), the time Python's garbage collector ran (``gc.callbacks``) and the process CPU time of each
test file, and writes them as JSON under
``$MIA_JAX_TIME_DIR`` (default ``jax-time/``) at the end of its session; ``python -m tests.jax_time_report DIR``
adds the workers' files up and prints a table, longest file first."""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

EVENTS = {"jaxpr_trace_duration": "trace_s", "jaxpr_to_mlir_module_duration": "lower_s",
          "backend_compile_duration": "compile_s"}
_sums: dict = collections.defaultdict(collections.Counter)
_current = {"file": "<collection>"}
_gc_start: list = []


def _listen(event: str, duration: float, **_):
    key = EVENTS.get(event.rsplit("/", 1)[-1])
    if key:
        _sums[_current["file"]][key] += duration
        if key == "compile_s":
            _sums[_current["file"]]["programs"] += 1


def _gc_timer(phase: str, info: dict):
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start:
        _sums[_current["file"]]["gc_s"] += time.perf_counter() - _gc_start.pop()


def pytest_configure(config):
    import gc

    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)
    gc.callbacks.append(_gc_timer)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["file"] = Path(str(item.fspath)).name
    start = time.process_time()
    yield
    _sums[_current["file"]]["cpu_s"] += time.process_time() - start



def pytest_sessionfinish(session):
    out = Path(os.environ.get("MIA_JAX_TIME_DIR", "jax-time"))
    out.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{name}.json").write_text(json.dumps({f: dict(c) for f, c in _sums.items()}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    total: dict = collections.defaultdict(collections.Counter)
    for path in Path(argv[0] if argv else "jax-time").glob("*.json"):
        for f, c in json.loads(path.read_text()).items():
            total[f].update(c)
    keys = ("cpu_s", "trace_s", "lower_s", "compile_s", "gc_s", "programs")
    grand = sum(total.values(), collections.Counter())
    print("| file | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for f, c in sorted(total.items(), key=lambda kv: -kv[1]["cpu_s"]) + [("all files", grand)]:
        print(f"| {f} | " + " | ".join(f"{c[k]:.1f}" if k != "programs" else str(int(c[k])) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
