"""llama.cpp's RPC backend (ggml-rpc): endpoints checked before llama.cpp sees them, the remote devices a model's
layers go to, and the server that lends this machine's device to another one.

ggml-rpc aborts the calling process (SIGABRT: nothing to catch) on an unparsable endpoint, a refused connection, a
failed handshake, and a server that dies or answers garbage mid-computation. So `check` parses every endpoint and
makes the protocol's HELLO itself, and a model on RPC devices lives in a child process (isolated.py) whose death
the caller survives. Only that child calls `devices`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
import sys
import time
from dataclasses import dataclass
from functools import cache

import llama_cpp

from .errors import EndpointError, RPCError
from .ggml_api import DEV_CPU, DEV_GPU, DEV_IGPU, ggml, proc
from .ggml_api import devices as ggml_devices

# ggml-rpc.h (llama.cpp as llama-cpp-python 0.3.36 vendors it): a client accepts a server of its major version
# and of a minor version no higher than its own
PROTO_MAJOR, PROTO_MINOR = 7, 0
_HELLO = 14  # RPC_CMD_HELLO: "must be always 14"
_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities, all zero for plain TCP
DEFAULT_PORT = 50052  # llama.cpp's rpc-server
BUILD_HINT = ('reinstall llama-cpp-python with RPC: CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall '
              '--no-cache-dir llama-cpp-python==0.3.36 (with Metal: "-DGGML_RPC=on -DGGML_METAL=on", with CUDA: '
              '"-DGGML_RPC=on -DGGML_CUDA=on")')
NO_AUTH_WARNING = ("WARNING: the RPC protocol has no authentication and no encryption: never expose this server to an "
                   "open network. Keep it on 127.0.0.1 and reach it through an SSH tunnel (README).")


@dataclass(frozen=True)
class Endpoint:
    """host:port of a llama.cpp RPC server (IPv4 or a host name: ggml-rpc resolves names with gethostbyname)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> tuple[Endpoint, ...]:
    """"host:port,host:port" (or a list of such strings), as llama-server's --rpc; EndpointError (a usage error)
    names the bad one."""
    parts = [p.strip() for item in ([text] if isinstance(text, str) else text) for p in item.split(",")]
    if not any(parts):
        raise EndpointError("--rpc needs at least one HOST:PORT.")
    out: list[Endpoint] = []
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not part or not sep or not host:
            raise EndpointError(f"RPC endpoint {part!r} is not HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}).")
        if host.startswith("[") or ":" in host:
            raise EndpointError(f"RPC endpoint {part!r}: llama.cpp's RPC client speaks IPv4 only; give an IPv4 "
                                "address or a host name.")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise EndpointError(f"RPC endpoint {part!r}: the port must be a number from 1 to 65535.")
        ep = Endpoint(host, int(port))
        if ep in out:
            raise EndpointError(f"RPC endpoint {part} is given twice.")
        out.append(ep)
    if len(out) > 16:  # GGML_RPC_MAX_SERVERS
        raise EndpointError(f"at most 16 RPC servers, got {len(out)}.")
    return tuple(out)


def hello(ep: Endpoint, timeout: float = 5.0) -> float:
    """Connect to `ep` and make the protocol's HELLO; the round trip in seconds. RPCError says what is there instead.

    A twin of ggml-rpc's negotiate_hello, since its failure aborts the process. An rpc-server serves one client at
    a time: while another client is connected, the handshake waits, here until `timeout`."""
    try:
        sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
    except socket.gaierror:
        raise RPCError(f"RPC endpoint {ep}: cannot resolve host {ep.host!r}.") from None
    except ConnectionRefusedError:
        raise RPCError(f"RPC endpoint {ep}: connection refused; start `ggufspec rpc-server --port {ep.port}` on "
                       f"that machine.") from None
    except OSError as e:  # timeout, unreachable network
        raise RPCError(f"RPC endpoint {ep}: cannot connect ({e.strerror or e}).") from None
    with sock:
        try:
            start = time.perf_counter()
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            reply = _recv(sock, 8 + 4 + _CAPS)
            rtt = time.perf_counter() - start
        except socket.timeout:
            reply = _line_end_answer(sock, min(timeout, 1.0))
            if reply:
                raise _not_rpc(ep, reply) from None
            raise RPCError(f"RPC endpoint {ep}: no answer to the RPC handshake within {timeout:g} s (not an RPC "
                           "server, or one busy with another client: an rpc-server serves one at a time).") from None
        except OSError as e:
            raise RPCError(f"RPC endpoint {ep}: the connection failed during the handshake ({e.strerror or e}).") from None
    size = struct.unpack("<Q", reply[:8])[0] if len(reply) >= 8 else None
    if size != 4 + _CAPS:
        raise _not_rpc(ep, reply)
    major, minor, patch = reply[8], reply[9], reply[10]
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise RPCError(f"RPC endpoint {ep} speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp speaks "
                       f"{PROTO_MAJOR}.{PROTO_MINOR}: run the same ggufspec and llama-cpp-python on both machines.")
    return rtt


def _line_end_answer(sock: socket.socket, timeout: float) -> bytes:
    """What a server silent after HELLO answers to a blank line, within `timeout`: b"" when nothing. A line-based
    server (HTTP, SMTP, Redis...) waits for a line end, which HELLO's bytes lack; a blank line gets an answer out
    of it. An rpc-server busy with another client has not read HELLO yet, and this connection closes before it
    does."""
    try:
        sock.settimeout(timeout)
        sock.sendall(b"\r\n\r\n")
        return sock.recv(256)
    except OSError:  # socket.timeout included
        return b""


def _not_rpc(ep: Endpoint, reply: bytes) -> RPCError:
    """The error for a server at `ep` that answered the handshake with `reply`, not as an RPC server does."""
    if not reply:
        return RPCError(f"RPC endpoint {ep} is not a llama.cpp RPC server (it closed the connection at the "
                        "handshake).")
    shown = reply[:24].decode("latin-1").splitlines()[0]
    head = reply.lstrip().lower()
    what = ": an HTTP server" if head.startswith((b"http/", b"<!doctype html", b"<html")) else ""  # HTTP/0.9: a page
    return RPCError(f"RPC endpoint {ep} is not a llama.cpp RPC server (it answered the handshake with {shown!r}"
                    f"{what}).")


def _recv(sock: socket.socket, n: int) -> bytes:
    """Up to n bytes: fewer where the peer closes first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def check(endpoints: tuple[Endpoint, ...], timeout: float = 5.0) -> dict[Endpoint, float]:
    """Every endpoint's handshake round trip in seconds (this build must have RPC); RPCError at the first bad one."""
    require()
    return {ep: hello(ep, timeout) for ep in endpoints}


@cache
def available() -> bool:
    """Whether this llama.cpp build has the RPC backend (built with -DGGML_RPC=on)."""
    return bool(llama_cpp.llama_supports_rpc())


def require() -> None:
    if not available():
        raise RPCError(f"this llama.cpp was built without its RPC backend: {BUILD_HINT}.")


def _rpc_function(name: str, restype, *argtypes):
    """A function of ggml-rpc, found through the "RPC" backend registry."""
    require()
    fn = proc(ggml().ggml_backend_reg_by_name(b"RPC"), name, restype, *argtypes)
    if fn is None:
        raise RPCError(f"this llama.cpp's RPC backend has no {name}.")
    return fn


def devices(endpoints: tuple[Endpoint, ...]) -> list[int]:
    """The devices of these servers (one or more each, in order), as ggml_backend_dev_t addresses.

    Connects through ggml-rpc, which aborts this process if a server is gone: only for a process that may die."""
    add_server = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    g = ggml()
    out: list[int] = []
    for ep in endpoints:
        reg = add_server(str(ep).encode())
        if not reg:
            raise RPCError(f"RPC endpoint {ep} offers no device.")
        out += [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))]
    return out


def local_gpus() -> list[int]:
    """This build's GPU devices (ggml_backend_dev_t addresses), RPC ones excluded (they are added, not built in)."""
    return [d for d in ggml_devices() if ggml().ggml_backend_dev_type(d) in (DEV_GPU, DEV_IGPU)]


def serve(ep: Endpoint, threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's GPUs, or its CPU where it has none (llama.cpp's rpc-server's choice), at `ep`, until
    the process ends. Blocks in llama.cpp (call it from a thread that Ctrl-C need not interrupt). RPCError if the
    address cannot be bound; llama.cpp prints its banner on stdout."""
    try:
        ipaddress.IPv4Address(ep.host)
    except ValueError:
        raise EndpointError(f"rpc-server listens on an IPv4 address (llama.cpp's), not {ep.host!r}: e.g. "
                            "127.0.0.1.") from None
    with socket.socket() as probe:  # llama.cpp only prints "Failed to create server socket"
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ep.host, ep.port))
        except OSError as e:
            raise RPCError(f"cannot listen at {ep}: {e.strerror or e}.") from None
    start = _rpc_function("ggml_backend_rpc_start_server", None,
                          ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)
    chosen = local_gpus() or [ggml().ggml_backend_dev_by_type(DEV_CPU)]
    array = (ctypes.c_void_p * len(chosen))(*chosen)
    sys.stdout.flush()
    start(str(ep).encode(), cache_dir.encode() if cache_dir else None, threads, len(chosen), array)
    raise RPCError(f"llama.cpp's RPC server at {ep} stopped (see its message above).")
