"""Before anything starts: can ``functitan rendezvous`` listen on its port, and does a node reach the store?

torchrun finds out late and loudly: an endpoint nobody answers on cost 111 s and a traceback (its store client's
60 s read timeout, then a retry), ``functitan rendezvous``
on a port in use printed C++ stack frames, and on a host that is not this machine's waited 75-93 s. These checks
answer in at most ``timeout_s`` (default ``REACH_TIMEOUT_S``) with one line that names the address and the fix.
"""

from __future__ import annotations

import errno
import socket
import time

__all__ = ["REACH_TIMEOUT_S", "listen_problem", "reach_problem"]

REACH_TIMEOUT_S = 30.0  # a store started together with the nodes (a SLURM batch host) is up within seconds


def _addresses(host: str, port: int) -> list[tuple]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def listen_problem(host: str, port: int) -> str | None:
    """Why a TCPStore cannot serve on ``host:port`` here (None: it can). It listens on every interface of this
    machine at ``port`` and then connects to ``host``, so ``host`` must be one of this machine's addresses."""
    try:
        infos = _addresses(host, port)
    except socket.gaierror as e:
        return f"the host {host!r} does not resolve ({e.strerror})"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: a closed store's port is free
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use on this machine (by another program or another store)"
            return f"port {port}: {e.strerror}"
    if host in ("", "0.0.0.0", "::"):
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((address[0], 0))
                return None
            except OSError:
                continue
    return f"{host} ({infos[0][4][0]}) is not an address of this machine"


def reach_problem(host: str, port: int, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why a node cannot use the rendezvous store at ``host:port`` (None: a store answers there). Tries until it
    answers or ``timeout_s`` has passed (a store starting at the same time as the nodes is waited for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        problem = _connect_problem(host, port, max(0.1, min(left, 5.0)))
        if problem is None:  # a TCP answer: torchrun's handshake takes it from here
            return None
        if time.monotonic() + 0.5 >= deadline:
            return problem
        time.sleep(0.5)


def _connect_problem(host: str, port: int, timeout_s: float) -> str | None:
    try:
        _addresses(host, port)
    except socket.gaierror as e:
        return f"the host {host!r} does not resolve ({e.strerror})"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host}"
    except TimeoutError:
        return f"{host} does not answer on port {port}"
    except OSError as e:
        return f"{host} is unreachable ({e.strerror or e})"
    return None
