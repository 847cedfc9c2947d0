"""Several processes (hosts) under ``jax.distributed``: start-up with a clear timeout, and agreement between them.

``mia score --coordinator HOST:PORT --num-processes N --process-id I`` (or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) runs one process per host. Every process
reads the same inputs and makes the same global batch plan, so all of them run the same jitted calls with the same
shapes in the same order; each process builds and transfers only the rows its own devices hold (``put_rows``);
outputs come back replicated, so every process holds every result; process 0 alone writes the output file.

Start-up. ``jax.distributed.initialize`` aborts the whole process (a C++ fatal error, not an exception) when the
coordinator cannot be reached in time. So before calling it, the processes meet on the coordinator's address with
plain sockets: process 0 listens there (that address only) until the N-1 others have said an authenticated hello
(an HMAC keyed with the run's token, ``run_token``) carrying the same process count and input digests (or
``timeout`` passes), then closes the listening socket and lets jax's coordination service bind the same address.
A process that cannot reach the coordinator within ``timeout`` seconds stops with one line (``cannot reach
coordinator HOST:PORT within 60 s``), not a hang; processes whose inputs differ all stop with one line naming them.

Failure. The hello connections stay open for the run: a watchdog thread on each process (``_Watchdog``) turns the
death or silence of another process into one ``error:`` line and an immediate exit, and ``guard`` does the same for
an exception on this process. jax's coordination service runs in a child of process 0 (``_start_service``) so that
process 0's death does not reach the others first as jax's C++ abort. Wire format: one JSON object per line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import sys
import threading
import time
import traceback
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..version import __version__

PROTOCOL = 2
TOKEN_ENV = "MIA_DIST_TOKEN"
MAX_LINE = 1 << 16  # bytes of one protocol line
PEER_TIMEOUT = 30.0  # seconds of silence after which the watchdog counts a process as gone
PING_EVERY = 1.0  # seconds between watchdog pings
JAX_HEARTBEAT = 60  # jax's own heartbeat limit (it aborts with a C++ trace): after the watchdog's
JAX_SHUTDOWN = 60  # seconds jax's shutdown barrier waits for the other processes
EXIT_GRACE = 3.0  # seconds process 0 waits for the peers to exit first
LOST_GRACE = 3.0  # seconds a failed collective waits for the watchdog to name a lost process
SERVICE_GRACE = 10.0  # seconds the coordination service outlives process 0 (the others exit first)


class DistributedError(ValueError):
    """Bad distributed settings or a coordinator that cannot be reached (one line for the user)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str  # HOST:PORT
    num_processes: int
    process_id: int


def settings_from(coordinator: Optional[str], num_processes: Optional[int], process_id: Optional[int],
                  env: Optional[dict] = None) -> Optional[ProcessGroup]:
    """Flags first, then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; None for one process."""
    env = os.environ if env is None else env
    where = "--coordinator" if coordinator else "JAX_COORDINATOR_ADDRESS"
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if coordinator is None and (num_processes is not None or process_id is not None):
        flags = " and ".join(f for f, v in (("--num-processes", num_processes), ("--process-id", process_id))
                             if v is not None)
        raise DistributedError(f"{flags} given without --coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS)")
    n_where = "--num-processes" if num_processes is not None else "JAX_NUM_PROCESSES"
    id_where = "--process-id" if process_id is not None else "JAX_PROCESS_ID"
    try:
        num_processes = num_processes if num_processes is not None else (
            int(env["JAX_NUM_PROCESSES"]) if env.get("JAX_NUM_PROCESSES") else None)
        process_id = process_id if process_id is not None else (
            int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID") else None)
    except ValueError as e:
        raise DistributedError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers ({e})") from None
    if coordinator is None and num_processes in (None, 1) and process_id in (None, 0):
        return None
    if coordinator is None or num_processes is None or process_id is None:
        raise DistributedError("several processes need all of --coordinator HOST:PORT, --num-processes N and "
                               "--process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    host, _, port = coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise DistributedError(f"{where} {coordinator[:300]}: expected HOST:PORT")
    number = int(port.lstrip("0")[:6] or "0")  # at most 6 digits read (int() refuses more than 4300)
    if not 1 <= number <= 65535:
        raise DistributedError(f"{where} {coordinator[:300]}: port {port[:12]} is out of range (1..65535)")
    coordinator = f"{host}:{number}"
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"{id_where} {process_id} must be in 0..{num_processes - 1} "
                               f"({n_where} {num_processes})")
    return ProcessGroup(coordinator, int(num_processes), int(process_id))


def _host_port(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port)


# ------------------------------------------------------------------------------------------------ the wire
def run_token(inputs: dict, env: Optional[dict] = None) -> bytes:
    """The secret every process of one run shares: ``$MIA_DIST_TOKEN`` when set, else one derived from the model's
    content address (a process without it cannot join, nor stop the others)."""
    env = os.environ if env is None else env
    given = env.get(TOKEN_ENV, "")
    return hashlib.sha256(b"mia-dist-token|" + (given.encode() if given else
                                                 ("model:" + str(inputs.get("--model", ""))).encode())).digest()


def _mac(token: bytes, nonce: str, body: dict) -> str:
    return hmac.new(token, (nonce + "|" + json.dumps(body, sort_keys=True)).encode(), hashlib.sha256).hexdigest()


def _send(conn: socket.socket, msg: dict) -> None:
    conn.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")


class _Lines:
    """Newline-framed JSON objects from a socket; a line over MAX_LINE bytes or that is not a JSON object is an
    error (``ValueError``), never a crash of the reader."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buf = conn, b""

    def _parse(self) -> dict:
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("not a JSON line") from None
        if not isinstance(msg, dict):
            raise ValueError("not a JSON object")
        return msg

    def read(self) -> Optional[dict]:
        """The next message; None at end of stream. Blocks per the socket's timeout (``socket.timeout``)."""
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
            chunk = self.conn.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        return self._parse()

    def read_ready(self) -> Optional[list]:
        """Every whole message after one ``recv`` (the socket is readable); None at end of stream. A malformed line
        is skipped and reported as a ValueError in the list."""
        chunk = self.conn.recv(65536)
        if not chunk:
            return None
        self.buf += chunk
        out: list = []
        while b"\n" in self.buf:
            try:
                out.append(self._parse())
            except ValueError as e:
                out.append(e)
        if len(self.buf) > MAX_LINE:
            self.buf = b""
            out.append(ValueError(f"a line longer than {MAX_LINE} bytes"))
        return out


def _check_hello(msg: dict) -> Optional[str]:
    """What is wrong with a hello's shape (None when it is well-formed)."""
    if not isinstance(msg.get("process"), int) or not isinstance(msg.get("num_processes"), int):
        return "no integer 'process' / 'num_processes'"
    if not isinstance(msg.get("inputs"), dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in msg["inputs"].items()):
        return "no 'inputs' object of strings"
    if not isinstance(msg.get("mac"), str):
        return "no 'mac'"
    return None


def differing_inputs(mine: dict, theirs: dict) -> list[str]:
    """Names of the inputs (flags, ``versions``) whose digests differ or that only one side has, sorted."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def _rendezvous_coordinator(group: ProcessGroup, timeout: float, inputs: dict, token: bytes) -> dict:
    """Process 0: listen on the coordinator's address until every other process has said an authenticated hello
    with the same process count and inputs; {process id: open socket} (kept open: the watchdog uses them).

    A connection that sends no well-formed hello in 5 s, or whose MAC is wrong, or that claims a process id already
    taken, is turned away with a warning line and process 0 keeps waiting. An authenticated process whose
    ``--num-processes`` or inputs differ stops every process that has arrived (``stop``) and raises."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or group.coordinator
    host, port = _host_port(bind)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        raise DistributedError(f"cannot resolve coordinator host {host!r}") from None
    srv = socket.socket(family, kind, proto)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(address)
    except OSError as e:
        srv.close()
        raise DistributedError(f"cannot listen on coordinator address {bind} ({e.strerror})") from None
    srv.listen(max(8, group.num_processes))
    deadline = time.monotonic() + timeout
    peers: dict[int, socket.socket] = {}

    def stop_all(reason: str):
        for conn in peers.values():
            try:
                _send(conn, {"stop": reason})
            except OSError:
                pass
        raise DistributedError(reason)

    try:
        while len(peers) < group.num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedError(f"only {len(peers) + 1} of {group.num_processes} processes reached the "
                                       f"coordinator {group.coordinator} within {timeout:g} s")
            srv.settimeout(min(left, 1.0))
            try:
                conn, addr = srv.accept()
            except socket.timeout:
                continue
            who = f"{addr[0]}:{addr[1]}"
            nonce = secrets.token_hex(16)
            try:
                conn.settimeout(5.0)
                _send(conn, {"mia": PROTOCOL, "challenge": nonce})
                msg = _Lines(conn).read()
            except ValueError as e:
                _reply_and_close(conn, {"reject": f"malformed hello: {e}"})
                _warn(f"coordinator: ignored a malformed hello from {who}: {e}")
                continue
            except socket.timeout:
                _warn(f"coordinator: ignored a connection from {who} (no hello within 5 s)")
                conn.close()
                continue
            except OSError:  # connected and left (a port probe)
                conn.close()
                continue
            if msg is None:  # connected and left without a word (a port probe)
                conn.close()
                continue
            bad = _check_hello(msg)
            if bad is None and not hmac.compare_digest(msg["mac"], _mac(token, nonce, {k: v for k, v in msg.items()
                                                                                     if k != "mac"})):
                bad = f"wrong token (${TOKEN_ENV}, or without it the model, differs from process 0's)"
                _reply_and_close(conn, {"reject": bad})
                _warn(f"coordinator: turned away a connection from {who} claiming process {msg.get('process')}: "
                      f"{bad}")
                continue
            if bad is not None:
                _reply_and_close(conn, {"reject": f"malformed hello: {bad}"})
                _warn(f"coordinator: ignored a malformed hello from {who}: {bad}")
                continue
            pid, n = msg["process"], msg["num_processes"]
            if pid in peers or pid == 0:
                _reply_and_close(conn, {"reject": f"process id {pid} is already taken"})
                _warn(f"coordinator: turned away a second process {pid} (from {who})")
                continue
            peers[pid] = conn
            if n != group.num_processes or not 0 < pid < group.num_processes:
                stop_all(f"the processes disagree on --num-processes: process 0 has {group.num_processes}, "
                         f"process {pid} has {n}")
            differ = differing_inputs(inputs, msg["inputs"])
            if differ:
                stop_all(f"process {pid} was started with other inputs than process 0: {', '.join(differ)} "
                         "differ")
        for conn in peers.values():
            _send(conn, {"ok": True})
            conn.settimeout(None)
        return peers
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        srv.close()


def _reply_and_close(conn: socket.socket, msg: dict) -> None:
    try:
        _send(conn, msg)
    except OSError:
        pass
    conn.close()


def _rendezvous_peer(group: ProcessGroup, timeout: float, inputs: dict, token: bytes) -> socket.socket:
    """Process I > 0: answer the coordinator's challenge with an authenticated hello and wait for everyone, within
    ``timeout`` seconds; the open socket to process 0 (the watchdog's)."""
    host, port = _host_port(group.coordinator)
    deadline = time.monotonic() + timeout
    answered_oddly = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            hint = " (something else answers on that port: the run may have started without this process)" \
                if answered_oddly else ""
            raise DistributedError(f"cannot reach coordinator {group.coordinator} within {timeout:g} s{hint}")
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except socket.gaierror:
            raise DistributedError(f"cannot resolve coordinator host {host!r}") from None
        except OSError:
            time.sleep(0.2)
            continue
        try:
            lines = _Lines(conn)
            challenge = lines.read()
            if challenge is None or challenge.get("mia") != PROTOCOL or not isinstance(challenge.get("challenge"), str):
                raise ValueError("not a mia coordinator")
            body = {"process": group.process_id, "num_processes": group.num_processes, "inputs": inputs}
            _send(conn, dict(body, mac=_mac(token, challenge["challenge"], body)))
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            reply = lines.read()
        except (OSError, ValueError):
            conn.close()
            answered_oddly = True
            time.sleep(0.2)
            continue
        if reply is not None and reply.get("ok") is True:
            conn.settimeout(None)
            return conn
        conn.close()
        if reply is not None and isinstance(reply.get("stop"), str):
            raise DistributedError(reply["stop"])
        if reply is not None and isinstance(reply.get("reject"), str):
            raise DistributedError(f"coordinator {group.coordinator} turned process {group.process_id} away: "
                                   f"{reply['reject']}")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ watchdog
class _Watchdog:
    """A daemon thread on the rendezvous sockets (process 0: one per peer; a peer: one to process 0) that turns a
    peer's death into one ``error:`` line and an immediate exit of every process, before jax's own heartbeat (which
    aborts with a C++ stack trace) or a collective that waits on the dead process.

    Each side sends ``{"ping"}`` every PING_EVERY s. A socket that closes before its side said ``{"done"}``, or that
    is silent for ``peer_timeout`` s, is a lost process. Process 0 tells the other peers (``{"abort"}``) and waits up
    to EXIT_GRACE s for them to go first (its death would otherwise reach them through jax's service as an abort)."""

    def __init__(self, group: ProcessGroup, conns: dict, peer_timeout: float):
        self.group, self.conns, self.timeout = group, dict(conns), peer_timeout
        self.lines = {pid: _Lines(c) for pid, c in conns.items()}
        self.heard = {pid: time.monotonic() for pid in conns}
        self.done: set[int] = set()
        self.lock = threading.Lock()  # one exit
        self.send_lock = threading.Lock()
        self.stopping = threading.Event()
        for c in conns.values():
            c.settimeout(1.0)
        self.thread = threading.Thread(target=self._run, name="mia-watchdog", daemon=True)
        self.thread.start()

    def _broadcast(self, msg: dict, skip: Optional[int] = None) -> None:
        with self.send_lock:
            for pid, c in list(self.conns.items()):
                if pid != skip:
                    try:
                        _send(c, msg)
                    except OSError:
                        pass

    def _run(self) -> None:
        last_ping = 0.0
        while True:
            now = time.monotonic()
            if now - last_ping >= PING_EVERY:
                self._broadcast({"ping": True})
                last_ping = now
            conns = dict(self.conns)
            try:
                ready, _, _ = select.select(list(conns.values()), [], [], PING_EVERY)
            except (OSError, ValueError):
                ready = []
            for pid, c in conns.items():
                if c in ready:
                    self._read(pid)
            now = time.monotonic()
            for pid in list(self.conns):
                if pid not in self.done and now - self.heard[pid] > self.timeout:
                    self.lost(pid, f"process {pid} sent nothing for {self.timeout:g} s")

    def _read(self, pid: int) -> None:
        try:
            msgs = self.lines[pid].read_ready()
        except socket.timeout:
            return
        except OSError:
            msgs = None
        if msgs is None:
            if pid in self.conns:
                self.conns.pop(pid).close()
            if pid not in self.done and not self.stopping.is_set():
                self.lost(pid, f"process {pid} stopped")
            return
        self.heard[pid] = time.monotonic()
        for msg in msgs:
            if isinstance(msg, ValueError):  # an authenticated peer never sends this; do not die of it either
                _warn(f"process {pid} sent a malformed watchdog message ({msg}); ignored")
            elif msg.get("done") is True:
                self.done.add(pid)
            elif "abort" in msg and not self.stopping.is_set():
                who, why = msg.get("abort"), " ".join(str(msg.get("why", "")).split())[:500]
                self.lost(who if isinstance(who, int) else pid, why or f"process {who} stopped")

    def lost(self, pid: int, why: str) -> None:
        """Process ``pid`` is gone or failed (``why``): one line, tell the rest, exit 1."""
        self.exit(pid, f"error: {why}", why, 1)

    def exit(self, pid: int, line: str, why: str, status: int) -> None:
        """Print ``line``, send ``why`` to the other live processes, and end this one with ``status``."""
        if not self.lock.acquire(blocking=False):
            time.sleep(3600)  # another thread is already exiting
        self.stopping.set()
        print(line, file=sys.stderr, flush=True)
        self._broadcast({"abort": pid, "why": why}, skip=pid)
        if self.group.process_id == 0:  # let the peers exit before process 0's jax service goes away
            end = time.monotonic() + EXIT_GRACE
            while self.conns and time.monotonic() < end:
                try:
                    ready, _, _ = select.select(list(self.conns.values()), [], [], 0.1)
                except (OSError, ValueError):
                    break
                for p, c in list(self.conns.items()):
                    if c in ready:
                        try:
                            gone = not c.recv(65536)
                        except socket.timeout:
                            gone = False
                        except OSError:
                            gone = True
                        if gone and p in self.conns:
                            self.conns.pop(p).close()
        sys.stdout.flush()
        os._exit(status)

    def finish(self) -> None:
        """This process is done (after the last barrier): its closing socket is no longer a death."""
        self._broadcast({"done": True})
        if self.group.process_id != 0:
            self.done.add(0)  # process 0 passed the same barrier: its exit is expected too


_WATCH: Optional[_Watchdog] = None

# The coordination service in a process of its own (process 0's child): when process 0 dies, the service (and the
# other processes' connections to it) lives on until the watchdog has stopped them with one line each; in-process,
# its death would reach every other process first as a C++ abort with a stack trace.
_SERVICE_CODE = """
import os, sys, time
from jaxlib import _jax
address, n, heartbeat, shutdown, parent, grace = sys.argv[1:7]
service = _jax.get_distributed_runtime_service(address, int(n), heartbeat_timeout=int(heartbeat),
                                               shutdown_timeout=int(shutdown))
print("ready", flush=True)
while os.getppid() == int(parent):
    time.sleep(0.2)
time.sleep(float(grace))
"""


class _NoService:
    """What jax holds as process 0's service when it runs in ``_start_service``'s process."""

    def shutdown(self) -> None:
        pass


def _start_service(bind: str, num_processes: int, heartbeat: int, shutdown: int, timeout: float):
    """Start jax's coordination service on ``bind`` in a child process that outlives this one by SERVICE_GRACE s
    (its own session: Ctrl-C in the terminal does not reach it); the child, once it listens."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", _SERVICE_CODE, bind, str(num_processes), str(heartbeat),
                              str(shutdown), str(os.getpid()), str(SERVICE_GRACE)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
    ready = select.select([child.stdout], [], [], max(10.0, timeout))[0]
    if not ready or child.stdout.readline().strip() != b"ready":
        child.kill()
        raise DistributedError(f"cannot start the coordination service on {bind} (is the port in use?)")
    return child


def initialize(group: Optional[ProcessGroup], timeout: float = 60.0, inputs: Optional[dict] = None,
               peer_timeout: float = PEER_TIMEOUT) -> None:
    """Start ``jax.distributed`` for ``group`` (no-op for None). Call before any other jax call.

    ``inputs``: {name: digest} of everything that must be the same on every process (``mia score`` passes its model
    fingerprint, input file hashes and settings); a difference stops every process with one line naming the names.
    CPU collectives go through gloo. Raises DistributedError (one line) when the processes do not all meet within
    ``timeout`` seconds. Afterwards a watchdog turns any process's death into one line and an exit on all of them
    (``guard``)."""
    global _WATCH
    if group is None:
        return
    inputs = dict(inputs or {})
    inputs.setdefault("versions", f"mia {_mia_version()}, jax {jax.__version__}")
    token = run_token(inputs)
    if group.process_id == 0:
        conns = _rendezvous_coordinator(group, timeout, inputs, token)
    else:
        conns = {0: _rendezvous_peer(group, timeout, inputs, token)}
    _WATCH = _Watchdog(group, conns, peer_timeout)
    heartbeat = max(JAX_HEARTBEAT, int(2 * peer_timeout))
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or group.coordinator
    from jax._src import distributed as jax_distributed

    own_service = group.process_id == 0 and hasattr(getattr(jax_distributed, "_jax", None),
                                                    "get_distributed_runtime_service")
    if own_service:
        _start_service(bind, group.num_processes, heartbeat, JAX_SHUTDOWN, timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_preemption_service", False)  # it would only print warnings when a process dies
    make_service = own_service and jax_distributed._jax.get_distributed_runtime_service
    try:
        if own_service:
            jax_distributed._jax.get_distributed_runtime_service = lambda *a, **k: _NoService()
        jax.distributed.initialize(group.coordinator, num_processes=group.num_processes, process_id=group.process_id,
                                   initialization_timeout=max(10, int(timeout)), coordinator_bind_address=bind,
                                   heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=JAX_SHUTDOWN)
    finally:
        if own_service:
            jax_distributed._jax.get_distributed_runtime_service = make_service


def _mia_version() -> str:
    return __version__


@contextlib.contextmanager
def guard(debug: bool = False, user_errors: tuple = (ValueError,)):
    """Around a multi-process command: an exception on this process becomes one ``error: process I: ...`` line, is
    told to the others (each prints one line) and ends the process at once with ``os._exit`` (status 2 for a user
    error, 130 for Ctrl-C, else 1), since jax's orderly shutdown would wait for processes stuck in a collective.
    When a collective failed because another process died, the watchdog's line about that process wins (the
    exception is not shown). Without ``jax.distributed`` (one process) it does nothing."""
    if _WATCH is None:
        yield
        return
    try:
        yield
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, *user_errors)) and _WATCH.stopping.wait(LOST_GRACE):
            time.sleep(3600)  # the watchdog is exiting with its own line
        if debug:
            traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            what, status = "interrupted", 130
        else:
            what = (str(e).strip().splitlines() or [type(e).__name__])[0]
            status = 2 if isinstance(e, user_errors) else 1
        me = _WATCH.group.process_id
        _WATCH.exit(me, f"error: process {me}: {what}", f"process {me} failed: {what}", status)


def finish() -> None:
    """After the last barrier of a successful run: this process's exit is expected by the others."""
    if _WATCH is not None:
        _WATCH.finish()


# ------------------------------------------------------------------------------------------------ agreement
def process_count() -> int:
    return jax.process_count()


def is_main() -> bool:
    return jax.process_index() == 0


def any_process(mask: np.ndarray) -> np.ndarray:
    """Element-wise OR of a bool array over all processes (identity with one process).

    Used so that every process plans the same work even when their on-disk caches differ: an item is computed
    when any process lacks it.
    """
    mask = np.asarray(mask, bool)
    if process_count() == 1:
        return mask
    digest = np.frombuffer(hashlib.sha256(np.packbits(mask).tobytes()).digest()[:8], np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest))
    if (digests == digests[0]).all():
        return mask
    packed = np.asarray(multihost_utils.process_allgather(np.packbits(mask.ravel())))
    return np.unpackbits(np.bitwise_or.reduce(packed, axis=0))[:mask.size].astype(bool).reshape(mask.shape)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if process_count() > 1:
        multihost_utils.sync_global_devices(name)
