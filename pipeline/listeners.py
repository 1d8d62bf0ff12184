"""Every socket the project listens on, bound to the configured address and nothing else;
and the listening sockets of a set of processes (what tests and operators check).

::

    reads   /proc/<pid>/fd, /proc/<pid>/net/tcp and tcp6 (listing only)
    writes  nothing
    blocks  never

torch's ``TCPStore`` server binds its own socket on every interface (``*:PORT``,
IPv4 and IPv6) whatever host name it is given; it takes over a socket the caller
has already bound through ``master_listen_fd`` (both its libuv and its classic
backend, torch 2.13), and from then on owns and closes that descriptor.
:func:`serve_store` binds one to the configured address and hands it over: the
weight-transfer store (pipeline/transfer) and the trainer ranks' rendezvous store
(trainer/ranks.py) are made here and nowhere else.

gloo's TCP devices listen too, on the address they are created for: the transports
name it (``create_device(hostname=...)``); the groups torch creates itself bind the
interface named by ``GLOO_SOCKET_IFNAME`` (else whatever this host's name resolves
to, which on a cluster node is its network address), which :func:`gloo_interface`
finds for an address: the trainer ranks' groups, the interface of the rank's address
towards MASTER_ADDR (trainer/ranks.py); vLLM's worker groups, loopback
(actor/engines/vllm/client.py). A value the operator set wins.

To see what a machine listens on: ``ss -ltnp`` (every process), or
:func:`listening` for given processes.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


def family(host: str) -> socket.AddressFamily:
    """AF_INET or AF_INET6: the family of ``host`` (an address, or a name's first one)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"cannot resolve {host!r} to an address to listen on ({e}); name an address of "
            "this machine (trainer.transfer_host / MASTER_ADDR), e.g. 127.0.0.1"
        ) from e
    return infos[0][0]


def bound_socket(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free one), IPv4 or IPv6
    by the host's address family. Raises ValueError when ``host`` is no address of
    this machine."""
    fam = family(host)
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:  # this address only, never the IPv4 ones beside it
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(
                    f"{host!r} is not an address of this machine, so nothing can listen on "
                    "it; set trainer.transfer_host (or MASTER_ADDR) to one of its addresses"
                ) from e
            raise
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


STORE_START_S = 30.0  # the least time a store's start may take (its own client's connect)


def serve_store(
    host: str,
    timeout_s: float,
    port: int = 0,
    *,
    world_size: int | None = None,
    wait_for_workers: bool = False,
    multi_tenant: bool = False,
):
    """A TCPStore server listening on ``host:port`` only (port 0: a free one), through a
    socket bound here; returns ``(store, port)``. ``timeout_s`` is the store's timeout
    for its operations (gets and waits without their own); the store's start, where its
    own client connects to the server it just opened, gets at least
    :data:`STORE_START_S`: a short operation timeout (``trainer.transfer_timeout_s=0.001``)
    made that local connect fail and the trainer exit at start."""
    import torch.distributed as dist

    sock = bound_socket(host, port)
    port = sock.getsockname()[1]
    inode = os.fstat(sock.fileno()).st_ino
    fd = sock.detach()  # the store owns it from here (it closes it)
    try:
        store = dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=max(timeout_s, STORE_START_S)),
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            master_listen_fd=fd,
        )
    except BaseException:
        # the libuv backend leaves the descriptor open when it fails, the classic one
        # closes it: close it only if it is still our socket (not a reused number)
        try:
            if os.fstat(fd).st_ino == inode:
                os.close(fd)
        except OSError:
            pass
        raise
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store, port


def _interface_networks() -> dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    """Interface name -> its IPv4 and IPv6 addresses with their networks."""
    import psutil

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        nets = []
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.netmask:
                mask = a.netmask
                if a.family == socket.AF_INET6:  # ffff:ffff:... -> prefix length
                    mask = str(bin(int(ipaddress.IPv6Address(mask))).count("1"))
                nets.append(ipaddress.ip_interface(f"{a.address.split('%')[0]}/{mask}"))
        out[name] = nets
    return out


def gloo_interface(address: str) -> str:
    """The network interface holding ``address``, else the one whose network holds it
    (127.0.1.1 is on the loopback's 127.0.0.0/8): what ``GLOO_SOCKET_IFNAME`` names so
    that the gloo groups torch makes itself listen there. ValueError when none does."""
    want = ipaddress.ip_address(socket.getaddrinfo(address, None)[0][4][0])
    nets = _interface_networks()
    for match in (lambda n: n.ip == want, lambda n: want in n.network):
        for name, addrs in sorted(nets.items()):
            if any(match(n) for n in addrs):
                return name
    raise ValueError(
        f"no network interface of this machine holds {address} ({want}); MASTER_ADDR must "
        "be an address of rank 0's machine that every rank reaches (127.0.0.1 on one "
        "machine), or set GLOO_SOCKET_IFNAME to the interface the ranks talk over"
    )


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # "127.0.0.1", "::1", "0.0.0.0", "::", ...
    port: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} (pid {self.pid} {_comm(self.pid)})"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _decode(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian 32-bit words)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listen_table(pid: int) -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket in LISTEN state in the
    network namespace of ``pid``."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            addr, port = fields[1].split(":")
            table[int(fields[9])] = (_decode(addr), int(port, 16))
    return table


def listening(pids) -> list[Listener]:
    """Every TCP socket in LISTEN state held by the processes ``pids`` (those gone or not
    ours to read are skipped), sorted by pid and port."""
    found, tables = set(), {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        inodes = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
        if not inodes:
            continue
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            netns = ""
        if netns not in tables:
            tables[netns] = _listen_table(pid)
        table = tables[netns]
        found |= {Listener(pid, *table[i]) for i in inodes if i in table}
    return sorted(found, key=lambda x: (x.pid, x.port, x.address))
