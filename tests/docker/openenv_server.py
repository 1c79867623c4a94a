"""A tiny OpenEnv-compatible environment server, on the standard library alone (it runs in the test base image).

It speaks what OpenEnv's own client (``openenv-core``'s ``GenericEnvClient``) speaks: ``GET /health``, ``GET
/schema`` (the action's JSON schema, which the trainer shows the model as a tool), and a WebSocket session on ``/ws``
per episode with ``reset``, ``step``, ``state`` and ``close`` messages, each answered with an ``observation`` (its
``observation``, ``reward`` and ``done``), a ``state`` or an ``error``.

The environment: ``reset(seed)`` draws a number from the seed and says it; the action ``{"guess": N}`` is answered
with whether it was right, a reward of 1 for it, and ``done`` after a right guess or three wrong ones. Every reset is
counted in /tmp/resets (the test reads it from the container).

    python3 openenv_server.py PORT
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import socket
import struct
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WEBSOCKET_MAGIC = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
ACTION = {
    "title": "GuessAction",
    "description": "Guess the hidden number.",
    "type": "object",
    "properties": {
        "guess": {"title": "Guess", "description": "The number, from 0 to 9.", "type": "integer"},
        "metadata": {"title": "Metadata", "type": "object"},
    },
    "required": ["guess"],
}


class Guessing:
    """One session's environment."""

    def __init__(self):
        self.number, self.tries, self.done = 0, 0, False

    def reset(self, data: dict) -> dict:
        self.number = random.Random(data.get("seed", 0)).randrange(10)
        self.tries, self.done = 0, False
        with open("/tmp/resets", "a", encoding="utf-8") as handle:
            handle.write(f"{data.get('seed')}\n")
        return {"observation": {"text": "Guess my number, from 0 to 9."}, "reward": None, "done": False}

    def step(self, data: dict) -> dict:
        guess = data.get("guess")
        if not isinstance(guess, int):
            raise ValueError("guess must be an integer")
        self.tries += 1
        right = guess == self.number
        self.done = right or self.tries >= 3
        said = "right" if right else ("higher" if guess < self.number else "lower")
        return {"observation": {"text": said}, "reward": 1.0 if right else 0.0, "done": self.done}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        sys.stderr.write("%s\n" % (format % args))

    def _json(self, value: dict) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - the base class's name
        if self.path == "/health":
            return self._json({"status": "healthy"})
        if self.path == "/schema":
            return self._json({"action": ACTION, "observation": {"type": "object"}, "state": {"type": "object"}})
        if self.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            return self._session()
        self.send_error(404)

    def _session(self) -> None:
        accept = base64.b64encode(
            hashlib.sha1((self.headers["Sec-WebSocket-Key"] + WEBSOCKET_MAGIC).encode()).digest()
        ).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        environment = Guessing()
        while True:
            opcode, payload = _read_frame(self.connection)
            if opcode is None or opcode == 0x8:
                _send_frame(self.connection, 0x8, b"")
                self.close_connection = True
                return
            if opcode == 0x9:
                _send_frame(self.connection, 0xA, payload)
                continue
            if opcode != 0x1:
                continue
            message = json.loads(payload)
            kind, data = message.get("type"), message.get("data") or {}
            if kind == "close":
                self.close_connection = True
                return
            try:
                if kind == "reset":
                    answer = {"type": "observation", "data": environment.reset(data)}
                elif kind == "step":
                    answer = {"type": "observation", "data": environment.step(data)}
                elif kind == "state":
                    answer = {"type": "state", "data": {"step_count": environment.tries}}
                else:
                    answer = {"type": "error", "data": {"message": f"unknown type {kind}", "code": "UNKNOWN_TYPE"}}
            except ValueError as error:
                answer = {"type": "error", "data": {"message": str(error), "code": "EXECUTION_ERROR"}}
            _send_frame(self.connection, 0x1, json.dumps(answer).encode())


def _read_exactly(connection: socket.socket, count: int) -> bytes | None:
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_frame(connection: socket.socket) -> tuple[int | None, bytes]:
    """One frame a client sent (clients mask theirs): its opcode and payload; None at the end of the stream."""
    head = _read_exactly(connection, 2)
    if head is None:
        return None, b""
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack(">H", _read_exactly(connection, 2))[0]
    elif length == 127:
        length = struct.unpack(">Q", _read_exactly(connection, 8))[0]
    mask = _read_exactly(connection, 4) if head[1] & 0x80 else b"\0\0\0\0"
    payload = _read_exactly(connection, length) or b""
    return opcode, bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))


def _send_frame(connection: socket.socket, opcode: int, payload: bytes) -> None:
    """One unmasked frame, as a server sends them."""
    length = len(payload)
    if length < 126:
        head = struct.pack(">BB", 0x80 | opcode, length)
    elif length < 1 << 16:
        head = struct.pack(">BBH", 0x80 | opcode, 126, length)
    else:
        head = struct.pack(">BBQ", 0x80 | opcode, 127, length)
    connection.sendall(head + payload)


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
