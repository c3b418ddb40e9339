"""The rendezvous store's server, bound to one address.

``torch.distributed.TCPStore(is_master=True)`` listens on every interface. The
server here binds one address (the node's, as Ray knows it, or one the user
sets) and hands the listening socket to the TCPStore, so the store is not
reachable through other interfaces. Everything read from it is authenticated
anyway (:mod:`elastic_ring.core.auth`); binding narrows who can even connect.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from ..core.errors import CommError
from ..core.spec import StoreAddress


class StoreServer:
    """A TCPStore server listening on ``host`` only (``port=0``: any free port)."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 300.0) -> None:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(1024)
        except OSError as exc:
            raise CommError(f"cannot listen on {host}:{port} for the rendezvous store: {exc}; set the address to one "
                            "of this machine's interfaces") from exc
        self.address = StoreAddress(host, sock.getsockname()[1])
        self._store = dist.TCPStore(host, self.address.port, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno(),
                                    use_libuv=True)
        sock.detach()  # the store owns (and closes) the descriptor now

    @property
    def store(self) -> dist.TCPStore:
        """The server's own client connection."""
        return self._store

    def connect(self, timeout_s: float) -> dist.TCPStore:
        """A new client connection (a blocking wait on one connection does not hold up another)."""
        return connect(self.address, timeout_s)

    def close(self) -> None:
        self._store = None  # type: ignore[assignment]


def connect(address: StoreAddress, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``address``; :class:`CommError` if it cannot be reached in ``timeout_s``."""
    try:
        return dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise CommError(f"cannot reach the rendezvous store at {address.host}:{address.port} within "
                        f"{timeout_s} s: {exc}") from exc
