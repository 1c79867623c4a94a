"""A judge server for the tests, on 127.0.0.1: an OpenAI-compatible chat completions endpoint and a scoring endpoint
in OpenRLHF's remote reward model's shape, which answers as a test tells it to (late, failing, malformed) and keeps
every request it got."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JudgeServer:
    """``score(prompt, completion) -> float`` gives each completion's score; ``behave`` (a list, consumed one per
    request; empty: answer) says what to do instead: ``("status", 503)``, ``("sleep", seconds)``, ``("text", body)``,
    ``("close", None)`` (drop the connection)."""

    def __init__(self, score=lambda prompt, completion: float(len(completion)), delay: float = 0.0):
        self.score, self.delay = score, delay
        self.behave: list[tuple[str, object]] = []
        self.requests: list[dict] = []
        """Each request's path, headers and JSON body, in the order they came."""
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real server
            disable_nagle_algorithm = True  # headers and body go out at once, as a real server sends them

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                server._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *args) -> None:
        self.close()

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length", 0))
        body = json.loads(handler.rfile.read(length) or b"{}")
        with self._lock:
            self.requests.append({"path": handler.path, "headers": dict(handler.headers), "body": body})
            action = self.behave.pop(0) if self.behave else ("answer", None)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            kind, value = action
            if kind == "close":
                handler.close_connection = True
                handler.wfile.flush()
                handler.connection.shutdown(2)
                return
            if kind == "sleep":
                time.sleep(value)
            if kind == "status":
                self._send(handler, value, b'{"error": "try again"}')
                return
            if kind == "text":
                self._send(handler, 200, value.encode())
                return
            self._send(handler, 200, json.dumps(self._answer(handler.path, body)).encode())
        finally:
            with self._lock:
                self.in_flight -= 1

    def _answer(self, path: str, body: dict) -> dict:
        if "query" in body:  # the scoring endpoint
            prompt = body["prompts"][0]
            return {"rewards": [self.score(prompt, body["query"][0][len(prompt) :])]}
        content = body["messages"][0]["content"]
        prompt, _, completion = content.partition("\nRESPONSE:\n")
        return {"choices": [{"message": {"role": "assistant", "content": f"Score: {self.score(prompt, completion)}"}}]}

    @staticmethod
    def _send(handler, status: int, payload: bytes) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a client that gave up waiting (a timeout the test asked for)
