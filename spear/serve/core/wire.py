"""The engine core's messages on ZeroMQ: core/messages.py's Structs as msgpack, tagged by class and
signed with a secret of the server's.

Each frame is the HMAC-SHA256 of the payload under the secret (32 bytes), then the payload. The
secret travels to the core through multiprocessing's pipe (never in argv or the environment), so
another process, even of the same user, cannot make a message either side accepts; the socket
folder is private to the user and its names are removed once both sides are connected (core/process.py,
frontend/zmq_client.py), so no other process can connect to read one either. A frame that is not
signed with the secret, or does not decode to one of the protocol's types, raises ``Malformed``:
the receiver logs it and drops it.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

MAC_BYTES = hashlib.sha256().digest_size


class Malformed(Exception):
    """A frame that is not one of the protocol's messages, or not signed with this server's secret."""


class Wire:
    """Packs messages for one server's sockets and unpacks the messages of type ``decodes`` (a
    Struct or a Union of tagged Structs)."""

    def __init__(self, secret: bytes, decodes):
        if len(secret) < 16:
            raise ValueError(f"the secret must hold at least 16 bytes, got {len(secret)}")
        self._secret = secret
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decodes)

    def pack(self, message) -> bytes:
        """The signed frame of ``message``; raises what msgpack cannot carry (an OverflowError for an
        integer beyond 64 bits, a UnicodeEncodeError for a string that is not valid Unicode)."""
        payload = self._encoder.encode(message)
        return hmac.digest(self._secret, payload, "sha256") + payload

    def unpack(self, frame: bytes):
        mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if len(mac) < MAC_BYTES or not hmac.compare_digest(mac, hmac.digest(self._secret, payload, "sha256")):
            raise Malformed(f"a frame of {len(frame)} bytes not signed with this server's secret")
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Malformed(f"a message that is not one of the protocol's: {exc}") from None
