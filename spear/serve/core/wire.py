"""The link between the HTTP server and the engine core (``spear serve``): core/messages.py's Structs
as msgpack, signed and numbered, on sockets that have no name.

The link. Before it starts the core the server makes two pairs of connected sockets
(``socket.socketpair``), one for the requests and the outputs, one for the core's heartbeats; the
core's process gets its ends as descriptors passed to it and to no other process (under ``spear
serve`` over the zygote's own socket pair, core/zygote.py; where a core is spawned, inherited
through multiprocessing), and the server closes them on its side. A socket pair has no
address in the file system or in the abstract namespace: no other process can connect to it, bind
in its place or read it. The only ways to another process's descriptors or memory are ptrace,
pidfd_getfd, process_vm_readv and /proc/<pid>/mem, and each needs the right to ptrace it.

Not dumpable. Both processes are non-dumpable (core/process.py ``forbid_inspection``: Linux's
prctl(PR_SET_DUMPABLE, 0)). The server makes itself so as the first thing the ``spear`` command
does for ``serve``, before its imports (spear/cli ``_seal_if_serving``; again as it makes the
link). Its core is born so: the command line forks it from the sealed process at once, before
anything heavy is imported (core/zygote.py), and a forked child inherits the flag from its first
instruction, in an address space of its own. A core spawned instead (a server embedded without
the command line) makes itself so before it imports anything of the engine (core/process.py
``sealed_start``: the first lines multiprocessing runs in its process). A process of the same user
without CAP_SYS_PTRACE then cannot ptrace either of them, open their /proc/<pid>/mem (to read or
to write), take a descriptor of theirs (pidfd_getfd) or read their /proc/<pid>/environ, maps or
fd/. The price: neither leaves a core dump, and a profiler of the same user (py-spy, gdb) needs
CAP_SYS_PTRACE to attach.

The frames. Each is its signature (32 bytes: its sequence number, 8 bytes big-endian, then the
HMAC-SHA256 of the number and the payload cut to 24 bytes), then the payload; on the socket it
follows its length (4 bytes). The key is the server's secret (32 random bytes, which reach the
core inside the zygote's socket pair or multiprocessing's pipe, never argv or the environment)
bound to the frame's channel, so a frame of one direction is not one of the other. The sequence number counts up from 1 on each
channel; the receiver drops a frame whose number is not above the last one it accepted
(``Replayed``), so a frame sent once is taken once. A frame not signed for its channel, or whose
payload is not one of the protocol's messages, raises ``Malformed``; the receiver logs it (once a
minute, with a count), counts it, drops it and goes on. The counts reach ``/metrics`` as
``spear_core_frames_dropped_total{side, reason}`` (side "server": frames the server dropped;
"core": frames the core dropped, reported with its heartbeat).

What holds, then, against a process of the same user without CAP_SYS_PTRACE that comes once both
processes run their own code: there is no name to connect to or bind at, and it can neither read
a frame, nor send or replay one that either side accepts, nor read either process's memory. It
can still stop or end either process (signals), which the server reports (/health 503).
What does not hold:
- root, or any process with CAP_SYS_PTRACE over the user's namespace: it reads and writes either
  process's memory, the secret and every prompt with it;
- the server's start, until it is non-dumpable: the interpreter's start and the import of
  spear.cli, up to ``_seal_if_serving`` (milliseconds). What a process of the user opens then it
  keeps, since /proc/<pid>/mem and maps are checked when opened only: the server's memory, to read
  and to write, and with it the secret and every prompt later; a ptrace attachment too, though the
  server looks for a tracer once non-dumpable and logs a warning naming it (a tracer that follows
  forks holds the core as well, whose start warns of it in turn). The link does not exist yet
  then: a descriptor taken in that time is none of its sockets. ``spear serve``'s core has no such
  moment: it is non-dumpable from its first instruction, and a /proc/<pid>/mem of the server
  opened before reaches its address space only through what was written into the server before
  the fork (a process that writes the server's memory has its secret and prompts already);
- a core spawned rather than forked, that is a server embedded without the command line
  (``MPClient`` without a zygote, as the tests' in-process servers run it; spear.cli's ``main``
  called by a program that runs threads already): the interpreter's and
  multiprocessing's start until ``sealed_start``'s first lines, with the link's descriptors
  inherited already (0.1-0.4 s on a 2-core CPU, in which a watching process took both sockets and
  read frames). benchmarks/attack_core_sockets.py measures what a process that watches for the
  start takes. A process of the same user can also change what the server runs (its code, its
  virtual environment, its model); where such a process must be expected, run the server as a user
  of its own;
- the tensor-parallel ranks 1..N-1 (model/workers.py, GPU only) are processes of their own that
  are not made non-dumpable here;
- elsewhere than Linux there is no PR_SET_DUMPABLE: the sockets still have no name, but the
  processes' memory is as open as the system leaves it.
"""

from __future__ import annotations

import hmac
import queue
import select
import socket
import struct
import threading

import msgspec

SEQ = struct.Struct("!Q")
TAG_BYTES = 24      # HMAC-SHA256 cut to 192 bits
MAC_BYTES = SEQ.size + TAG_BYTES  # a frame's signature: its sequence number, then its tag
LENGTH = struct.Struct("!I")
# the channels' names, bound into their keys
TO_CORE, FROM_CORE, HEARTBEAT = "to-core", "from-core", "heartbeat"


class Malformed(Exception):
    """A frame that is not one of the protocol's messages, or not signed for its channel with this
    server's secret. ``reason`` is what the receivers count it as."""

    reason = "malformed"


class Replayed(Malformed):
    """A signed frame whose sequence number is not above the last one accepted on its channel."""

    reason = "replayed"


class Wire:
    """Packs the messages of one channel (``sends``) and unpacks those of another (``receives``) of
    one server's link: messages of type ``decodes`` (a Struct or a Union of tagged Structs). Each
    channel's frames are numbered by the packer and checked by the unpacker; one Wire is used by
    one thread."""

    def __init__(self, secret: bytes, decodes, *, sends: str = "", receives: str = ""):
        if len(secret) < 16:
            raise ValueError(f"the secret must hold at least 16 bytes, got {len(secret)}")
        self._send_key = hmac.digest(secret, b"spear-core-link/" + sends.encode(), "sha256")
        self._receive_key = hmac.digest(secret, b"spear-core-link/" + receives.encode(), "sha256")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decodes)
        self._sent = 0       # the last sequence number packed
        self._accepted = 0   # the last sequence number unpacked

    def pack(self, message) -> bytes:
        """The signed frame of ``message``; raises what msgpack cannot carry (an OverflowError for an
        integer beyond 64 bits, a UnicodeEncodeError for a string that is not valid Unicode), and a
        ValueError for a frame the link cannot carry (4 GiB or more). Nothing is numbered then."""
        payload = self._encoder.encode(message)
        if len(payload) + MAC_BYTES >= 1 << (8 * LENGTH.size):
            raise ValueError(f"a frame of {len(payload) + MAC_BYTES} bytes is longer than the link carries")
        self._sent += 1
        seq = SEQ.pack(self._sent)
        return seq + _tag(self._send_key, seq, payload) + payload

    def unpack(self, frame: bytes):
        seq, tag, payload = frame[:SEQ.size], frame[SEQ.size:MAC_BYTES], frame[MAC_BYTES:]
        if len(frame) < MAC_BYTES or not hmac.compare_digest(tag, _tag(self._receive_key, seq, payload)):
            raise Malformed(f"a frame of {len(frame)} bytes not signed with this server's secret")
        (number,) = SEQ.unpack(seq)
        if number <= self._accepted:
            raise Replayed(f"a replayed frame (sequence number {number}, {self._accepted} already accepted)")
        try:
            message = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Malformed(f"a message that is not one of the protocol's: {exc}") from None
        self._accepted = number
        return message


def _tag(key: bytes, seq: bytes, payload: bytes) -> bytes:
    return hmac.digest(key, seq + payload, "sha256")[:TAG_BYTES]


# ------------------------------------------------------------------------------ frames on a socket
class FrameWriter:
    """Writes frames, each after its length, on a connected stream socket (blocking)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, frame: bytes) -> None:
        self.sock.sendall(LENGTH.pack(len(frame)) + frame)


class FrameSender(FrameWriter):
    """A FrameWriter behind a queue of no limit, written by a thread of its own: ``send`` never waits
    for the reader (the engine core never waits on the server; a slow server costs memory here).
    ``close`` writes what is queued for up to ``linger`` seconds."""

    _END = object()

    def __init__(self, sock: socket.socket, name: str):
        super().__init__(sock)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, frame: bytes) -> None:
        self._queue.put(frame)

    def _run(self) -> None:
        while (frame := self._queue.get()) is not self._END:
            try:
                self.write(frame)
            except OSError:  # the reader is gone (the server exited): nothing more can reach it
                return

    def close(self, linger: float) -> None:
        self._queue.put(self._END)
        self._thread.join(linger)


class FrameReader:
    """Reads the frames of a connected stream socket without blocking beyond ``wait``. ``frames``
    raises EOFError once the other end is closed and every frame before it has been read."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self._buffer = bytearray()
        self._eof = False

    def wait(self, timeout: float) -> bool:
        """Whether a frame (or the end) may be read now, waiting up to ``timeout`` seconds for one."""
        if self._complete() or self._eof:
            return True
        return bool(select.select([self.sock], [], [], timeout)[0])

    def frames(self) -> list[bytes]:
        """Every complete frame that can be read now (possibly none)."""
        while not self._eof:
            try:
                chunk = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionError:
                chunk = b""
            if not chunk:
                self._eof = True
                break
            self._buffer += chunk
        out = []
        while self._complete():
            (n,) = LENGTH.unpack_from(self._buffer)
            out.append(bytes(self._buffer[LENGTH.size:LENGTH.size + n]))
            del self._buffer[:LENGTH.size + n]
        if not out and self._eof:
            raise EOFError("the other end of the link is closed")
        return out

    def _complete(self) -> bool:
        return (len(self._buffer) >= LENGTH.size
                and len(self._buffer) >= LENGTH.size + LENGTH.unpack_from(self._buffer)[0])
