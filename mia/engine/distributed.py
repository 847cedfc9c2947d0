"""Several processes (hosts) under ``jax.distributed``: start-up with a clear timeout, and agreement between them.

``mia score --coordinator HOST:PORT --num-processes N --process-id I`` (or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) runs one process per host. Every process
reads the same inputs and makes the same global batch plan, so all of them run the same jitted calls with the same
shapes in the same order; each process builds and transfers only the rows its own devices hold (``put_rows``);
outputs come back replicated, so every process holds every result; process 0 alone writes the output file.

Start-up. ``jax.distributed.initialize`` aborts the whole process (a C++ fatal error, not an exception) when the
coordinator cannot be reached in time. So before calling it, the processes meet on the coordinator's port with
plain sockets: process 0 listens there until the N-1 others have said hello (or ``timeout`` passes), then closes the
socket and lets jax's coordination service bind the same port. A process that cannot reach the coordinator within
``timeout`` seconds stops with one line (``cannot reach coordinator HOST:PORT within 60 s``), not a hang.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import time
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

HELLO = b"mia-hello "
ACK = b"mia-ok\n"


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


def _rendezvous_coordinator(group: ProcessGroup, timeout: float) -> None:
    """Process 0: wait on the coordinator port until every other process has said hello."""
    host, port = _host_port(group.coordinator)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", port))
    except OSError as e:
        srv.close()
        raise DistributedError(f"cannot listen on coordinator port {port} ({e.strerror})") from None
    srv.listen(max(8, group.num_processes))
    deadline = time.monotonic() + timeout
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < group.num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedError(f"only {len(peers) + 1} of {group.num_processes} processes reached the "
                                       f"coordinator {group.coordinator} within {timeout:g} s")
            srv.settimeout(min(left, 1.0))
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            conn.settimeout(5.0)
            try:
                line = conn.recv(64)
            except OSError:
                conn.close()
                continue
            if not line.startswith(HELLO):
                conn.close()
                continue
            peers[int(line[len(HELLO):].split()[0])] = conn
        for conn in peers.values():
            conn.sendall(ACK)
        for conn in peers.values():  # the peers close first (so no TIME_WAIT is left on the coordinator's port)
            try:
                conn.recv(16)
            except OSError:
                pass
    finally:
        for conn in peers.values():
            conn.close()
        srv.close()


def _rendezvous_peer(group: ProcessGroup, timeout: float) -> None:
    """Process I > 0: say hello to the coordinator and wait for everyone, within ``timeout`` seconds."""
    host, port = _host_port(group.coordinator)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedError(f"cannot reach coordinator {group.coordinator} within {timeout:g} s")
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)) as conn:
                conn.sendall(HELLO + f"{group.process_id}\n".encode())
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                if conn.recv(16).startswith(ACK):
                    return
        except socket.gaierror:
            raise DistributedError(f"cannot resolve coordinator host {host!r}") from None
        except (OSError, socket.timeout):
            pass
        time.sleep(0.2)


def initialize(group: Optional[ProcessGroup], timeout: float = 60.0) -> None:
    """Start ``jax.distributed`` for ``group`` (no-op for None). Call before any other jax call.

    CPU collectives go through gloo. Raises DistributedError (one line) when the processes do not all meet within
    ``timeout`` seconds.
    """
    if group is None:
        return
    if group.process_id == 0:
        _rendezvous_coordinator(group, timeout)
    else:
        _rendezvous_peer(group, timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator, num_processes=group.num_processes, process_id=group.process_id,
                               initialization_timeout=max(10, int(timeout)))


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
