"""Several processes that fail cleanly (mia.engine.distributed): the authenticated rendezvous on the coordinator's
address, agreement on the inputs before any work, and the watchdog that turns a process's death into one line and
an exit on every other process.

The rendezvous tests run process 0 and its peers as threads of this process (plain sockets, no jax); the watchdog
runs in a subprocess (it ends its process with ``os._exit``); the slow tests run ``mia score`` on 2-3 local
processes and SIGKILL one of them mid-run.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from xla_env import device_flags

from mia.engine import distributed as D

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
INPUTS = {"--model": "m1", "--data": "d1", "--attacks": '"loss"'}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_thread(fn, *args):
    """Run ``fn(*args)`` in a thread; a dict that gets 'result' or 'error' when it ends."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except Exception as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _wait_listening(port, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1.0)
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the coordinator never listened")


def _hello(port, body, mac="0" * 64):
    """A hand-made hello (a stranger's); the coordinator's reply (None when it just closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        lines = D._Lines(c)
        assert lines.read()["challenge"]
        c.sendall(body if isinstance(body, bytes) else json.dumps(dict(body, mac=mac)).encode() + b"\n")
        try:
            return lines.read()
        except OSError:
            return None


def test_strangers_and_bad_lines_never_stop_the_coordinator_nor_take_a_process_id(capsys):
    port = _free_port()
    token = D.run_token(INPUTS, env={})
    coord = _in_thread(D._rendezvous_coordinator, D.ProcessGroup(f"127.0.0.1:{port}", 3, 0), 30, INPUTS, token)
    _wait_listening(port).close()  # a probe that says nothing: ignored silently
    # bound to the coordinator's address only, not every interface (127.0.0.2 is another loopback address)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    assert "malformed" in _hello(port, b"mia-hello 1\n")["reject"]  # not JSON
    assert "malformed" in _hello(port, {"process": "1"})["reject"]  # JSON of the wrong shape
    assert "longer than" in _hello(port, b"x" * (D.MAX_LINE + 10))["reject"]  # a line too long
    stranger = {"process": 1, "num_processes": 3, "inputs": INPUTS}
    assert "wrong token" in _hello(port, stranger)["reject"]  # well-formed but without the token
    assert _hello(port, stranger, mac=D._mac(D.run_token(INPUTS, env={"MIA_DIST_TOKEN": "guess"}), "x", stranger))
    assert "result" not in coord and "error" not in coord  # still waiting
    group = lambda pid: D.ProcessGroup(f"127.0.0.1:{port}", 3, pid)  # noqa: E731
    first = _in_thread(D._rendezvous_peer, group(1), 30, INPUTS, token)
    time.sleep(0.5)
    twin = _in_thread(D._rendezvous_peer, group(1), 30, INPUTS, token)  # a second process 1
    twin["thread"].join(20)
    assert "process id 1 is already taken" in str(twin["error"])
    last = _in_thread(D._rendezvous_peer, group(2), 30, INPUTS, token)
    for t in (coord, first, last):
        t["thread"].join(20)
    assert sorted(coord["result"]) == [1, 2], coord.get("error")
    assert isinstance(first["result"], socket.socket) and isinstance(last["result"], socket.socket)
    for s in [*coord["result"].values(), first["result"], last["result"]]:
        s.close()
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 6 and all(w.startswith("warning: coordinator: ") for w in warnings), warnings


@pytest.mark.parametrize("peer_n, peer_inputs, message", [
    (2, dict(INPUTS, **{"--attacks": '"loss,zlib"'}), "process 1 was started with other inputs than process 0: "
                                                      "--attacks differ"),
    (2, dict(INPUTS, **{"--data": "d2", "--seed": "1"}), "--data, --seed differ"),
    (3, INPUTS, "the processes disagree on --num-processes: process 0 has 2, process 1 has 3"),
])
def test_processes_that_disagree_all_stop_with_one_line_naming_the_difference(peer_n, peer_inputs, message):
    port = _free_port()
    coord = _in_thread(D._rendezvous_coordinator, D.ProcessGroup(f"127.0.0.1:{port}", 2, 0), 30, INPUTS,
                       D.run_token(INPUTS, env={}))
    _wait_listening(port).close()
    peer = _in_thread(D._rendezvous_peer, D.ProcessGroup(f"127.0.0.1:{port}", peer_n, 1), 30, peer_inputs,
                      D.run_token(peer_inputs, env={}))
    for t in (coord, peer):
        t["thread"].join(20)
        assert isinstance(t.get("error"), D.DistributedError) and message in str(t["error"]), t
        assert "\n" not in str(t["error"])


def test_the_token_comes_from_the_environment_or_the_model():
    assert D.run_token(INPUTS, env={}) == D.run_token(dict(INPUTS, **{"--data": "other"}), env={})
    assert D.run_token(INPUTS, env={}) != D.run_token(dict(INPUTS, **{"--model": "m2"}), env={})
    assert D.run_token(INPUTS, env={"MIA_DIST_TOKEN": "a"}) != D.run_token(INPUTS, env={"MIA_DIST_TOKEN": "b"})
    assert D.run_token(INPUTS, env={"MIA_DIST_TOKEN": "a"}) == D.run_token({"--model": "m2"},
                                                                           env={"MIA_DIST_TOKEN": "a"})
    assert D.differing_inputs({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b", "c"]


WATCHDOG = """
import socket, sys, time
from mia.engine import distributed as D
mode = sys.argv[1]
mine, theirs = socket.socketpair()
D._WATCH = D._Watchdog(D.ProcessGroup("127.0.0.1:1", 3, 1), {0: mine}, peer_timeout=2.0)
if mode == "raise":
    with D.guard(user_errors=(ValueError,)):
        raise ValueError("bad thing\\nsecond line")
if mode == "closed":
    theirs.close()
elif mode == "abort":
    theirs.sendall(b'{"abort": 2, "why": "process 2 stopped"}\\n')
elif mode == "garbage":
    theirs.sendall(b"\\xff not json\\n")
    time.sleep(1.5)
    theirs.close()
time.sleep(30)
"""


@pytest.mark.parametrize("mode, line", [
    ("closed", "error: process 0 stopped"),
    ("raise", "error: process 1: bad thing"),  # this process's own error (status 2): one line, then the exit
    # (each case starts jax in a subprocess: ~3 s on 2 busy cores; the default run keeps two)
    pytest.param("abort", "error: process 2 stopped", marks=pytest.mark.slow),
    pytest.param("silent", "error: process 0 sent nothing for 2 s", marks=pytest.mark.slow),
    pytest.param("garbage", "error: process 0 stopped", marks=pytest.mark.slow),
])
def test_the_watchdog_turns_a_lost_process_into_one_line_and_an_exit(mode, line):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", WATCHDOG, mode], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == (2 if mode == "raise" else 1) and time.monotonic() - start < 25
    err = r.stderr.strip().splitlines()
    if mode == "garbage":  # a malformed line is one warning, then the real loss
        assert err[0].startswith("warning: process 0 sent a malformed watchdog message"), err
        err = err[1:]
    assert err == [line], r.stderr


def test_the_watchdog_stops_on_another_process_failing_with_that_process_reason(monkeypatch):
    """In this process (the exit recorded, not taken; the subprocess cases above take it): a peer's ``{"abort"}``,
    which its ``guard`` sends when a command fails there (an attention kernel that failed in that process alone, say),
    becomes this process's one line with the peer's reason and exit status 1."""
    seen, gone = [], threading.Event()

    def exit(self, pid, line, why, status):
        seen.append((pid, line, status))
        gone.set()
        threading.Event().wait()  # the watchdog's thread ends here: a daemon, blocked for good

    monkeypatch.setattr(D._Watchdog, "exit", exit)
    mine, theirs = socket.socketpair()
    watchdog = D._Watchdog(D.ProcessGroup("127.0.0.1:1", 2, 0), {1: mine}, peer_timeout=1e9)
    try:
        theirs.sendall(b'{"abort": 1, "why": "process 1 failed: attention kernel splash failed"}\n')
        assert gone.wait(10), "the watchdog never heard process 1"
        assert seen == [(1, "error: process 1 failed: attention kernel splash failed", 1)]
    finally:  # whatever happened, a thread still watching must never end this process (os._exit) later
        watchdog.done.add(1)
        watchdog.stopping.set()


# ------------------------------------------------------------------------------------------------ mia score
def _env():
    return dict(os.environ, XLA_FLAGS=device_flags(2), JAX_PLATFORMS="cpu",
                MIA_COMPILE_CACHE="0", PYTHONPATH=str(ROOT) + os.pathsep + str(TESTS))


def _data(tmp_path, n, max_len, seed=5):
    rng = np.random.default_rng(seed)
    path = tmp_path / f"d{n}.jsonl"
    path.write_text("".join(json.dumps({"id": i, "tokens": rng.integers(0, 300, int(rng.integers(3, max_len))).tolist(),
                                        "label": i % 2}) + "\n" for i in range(n)))
    return path


def _start(model, data, tmp_path, port, n, attacks="loss", extra=(), per_process=None, ids=None):
    procs = []
    for i in range(n) if ids is None else ids:
        more = list(per_process(i)) if per_process else []
        args = [sys.executable, "-m", "mia", "score", "--attacks", attacks, "--no-progress", "--model", str(model),
                "--data", str(data), "--out", str(tmp_path / f"o{i}.jsonl"), "--cache-dir", str(tmp_path / f"c{i}"),
                "--batch-tokens", "256", "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                "--process-id", str(i), *extra, *more]
        procs.append(subprocess.Popen(args, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _finish(procs, timeout):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    return outs


KERNEL_FAILS = """
import sys
import jax
from mia.models import attention as A

if sys.argv[1] == "fail":  # in this process alone auto picks splash, and its program does not compile here
    def unregistered(*args, scale, window=None):
        out = A.blocked_attention(*args, scale=scale, window=window)
        return jax.ffi.ffi_call("mia_kernel_nobody_registered", jax.ShapeDtypeStruct(out.shape, out.dtype),
                                vmap_method="sequential")(out)
    A.auto_kernel = lambda *a, **k: "splash"
    A.KERNELS["splash"] = unregistered
from mia.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # 2 processes that start jax and load a model: ~20 s on 2 busy cores (the default run keeps the
# watchdog's own checks above and tests/test_failsafe.py's one-process check of the error)
def test_a_kernel_failing_in_one_process_stops_every_process_with_one_line(tiny_neox_dir, tmp_path):
    """Two real processes under jax.distributed: auto's kernel fails to compile in process 1 alone. Process 1 does
    not fall back alone (the other would run another program): one ``error:`` line naming the kernel, the process and
    MIA_ATTENTION=blocked, exit 2. Process 0, waiting for process 1 in the step's collective, hears it from the
    watchdog: one ``error:`` line with process 1's reason, exit 1, within seconds. (Without the watchdog process 0
    would learn of it only from gloo or jax's heartbeat: another line, or a minute.)"""
    data = _data(tmp_path, 8, 40)
    port = _free_port()
    procs = []
    for i in range(2):
        args = ["score", "--attacks", "loss", "--no-progress", "--model", str(tiny_neox_dir), "--data", str(data),
                "--out", str(tmp_path / f"o{i}.jsonl"), "--cache-dir", str(tmp_path / f"c{i}"), "--coordinator",
                f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(subprocess.Popen([sys.executable, "-c", KERNEL_FAILS, "fail" if i else "ok", *args], env=_env(),
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    end = time.monotonic() + 240
    while procs[1].poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    failed = time.monotonic()
    (_, err0), (_, err1) = _finish(procs, 60)
    took = time.monotonic() - failed
    lines = [[x for x in e.splitlines() if x.startswith("error:")] for e in (err0, err1)]
    reason = ("attention kernel splash failed on this backend in process 1 of 2 (", "rerun every process with "
              "MIA_ATTENTION=blocked")
    assert procs[1].returncode == 2 and len(lines[1]) == 1, err1[-3000:]
    assert lines[1][0].startswith(f"error: process 1: {reason[0]}") and reason[1] in lines[1][0], lines[1]
    assert procs[0].returncode == 1 and len(lines[0]) == 1, err0[-3000:]
    assert lines[0][0].startswith(f"error: process 1 failed: {reason[0]}") and reason[1] in lines[0][0], lines[0]
    assert "Traceback" not in err0 + err1 and not list(tmp_path.glob("o*.jsonl"))
    assert took < 15, took  # the watchdog's EXIT_GRACE is 3 s
    print(json.dumps({"seconds_to_exit": round(took, 2)}))


@pytest.mark.slow  # 3 processes that start jax and compile: ~40 s on 2 busy cores
@pytest.mark.parametrize("victim", [2, 0])
def test_a_process_killed_mid_run_stops_the_others_with_one_line(tiny_neox_dir, tmp_path, victim):
    """SIGKILL one of 3 processes once scoring has begun (its first cache part is written): every other process
    prints exactly ``error: process V stopped`` (no traceback, no jax log) and exits 1 within 60 s."""
    data = _data(tmp_path, 300, 250)
    procs = _start(tiny_neox_dir, data, tmp_path, _free_port(), 3, attacks="loss,mope:n=4")
    end = time.monotonic() + 300
    while not list((tmp_path / f"c{victim}").rglob("part-*")) and time.monotonic() < end:
        assert all(p.poll() is None for p in procs), _finish(procs, 10)
        time.sleep(0.2)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivors = [p for i, p in enumerate(procs) if i != victim]
    outs = _finish(survivors, 120)
    took = time.monotonic() - killed
    procs[victim].wait(10)
    for p, (_, err) in zip(survivors, outs):
        assert p.returncode == 1, err[-3000:]
        assert err.strip().splitlines() == [f"error: process {victim} stopped"], err[-3000:]
    assert took < 60, took
    print(json.dumps({"victim": victim, "seconds_to_exit": round(took, 2), "lines": 1}))


@pytest.mark.slow  # 2-3 processes that import jax and hash their inputs: ~15 s
def test_mismatched_inputs_or_process_counts_stop_every_process_before_any_work(tiny_neox_dir, tmp_path):
    data = _data(tmp_path, 4, 20)
    procs = _start(tiny_neox_dir, data, tmp_path, _free_port(), 2,
                   per_process=lambda i: ["--seed", str(i)])  # process 1 has another --seed
    for p, (_, err) in zip(procs, _finish(procs, 120)):
        assert p.returncode == 2
        assert err.strip().splitlines() == ["error: process 1 was started with other inputs than process 0: "
                                            "--seed differ"], err[-3000:]
    port = _free_port()
    procs = _start(tiny_neox_dir, data, tmp_path, port, 2)  # process 0 and 1 of 2 ...
    procs[1].kill()
    procs[1].wait()
    procs[1:] = _start(tiny_neox_dir, data, tmp_path, port, 3, ids=[1])  # ... and a process 1 that says 3
    for p, (_, err) in zip(procs, _finish(procs, 120)):
        assert p.returncode == 2
        assert err.strip().splitlines() == ["error: the processes disagree on --num-processes: process 0 has 2, "
                                            "process 1 has 3"], err[-3000:]
    assert not list(tmp_path.glob("o*.jsonl"))
