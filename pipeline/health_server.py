"""A pool's ``/metrics`` and ``/health`` server (pipeline/prom.py starts it): a child
process, standard library only, that answers from what the pool last wrote into its
folder, so a hung or stopped pool is reported, not silent.

``python -m pipeline.health_server FD FOLDER PARENT_PID LINGER_S``: FD is the listening
socket the pool bound. ``/health``: 200 ``ok`` while the pool refreshes and its main loop
ticked within its deadline; 503 with the reason otherwise (loading, redis unreachable,
stalled, not refreshing). ``/metrics``: the pool's exposition plus ``nonstop_healthy``.
When the pool is gone the server answers ``LINGER_S`` more seconds (the final values for
the last scrape), then exits.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def judge(facts: dict, now: float) -> str:
    """'' when healthy, else the reason."""
    deadline = float(facts["deadline_s"])
    quiet = now - float(facts["written"])
    if quiet > deadline:
        return f"stalled: the pool has not refreshed for {quiet:.0f}s (stopped or hung)"
    if facts.get("error"):
        return facts["error"]
    if facts.get("tick") is None:
        return "loading: the main loop has not started"
    idle = now - float(facts["tick"])
    if idle > deadline:
        return f"stalled: the main loop last ticked {idle:.0f}s ago (deadline {deadline:.0f}s)"
    return ""


class Server(ThreadingHTTPServer):
    def __init__(self, sock: socket.socket, folder: str):
        self.folder = folder
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock

    def read(self, name: str) -> bytes:
        with open(os.path.join(self.folder, name), "rb") as f:
            return f.read()


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?")[0]
        try:
            facts = json.loads(self.server.read("health"))
        except (OSError, ValueError):
            facts = None
        reason = judge(facts, time.time()) if facts else "loading: no facts yet"
        if path == "/health":
            code, body = (503, reason) if reason else (200, "ok")
            self._send(code, (body + "\n").encode(), "text/plain; charset=utf-8")
        elif path == "/metrics":
            try:
                text = self.server.read("metrics")
            except OSError:
                text = b""
            if facts:
                labels = ",".join(f'{k}="{v}"' for k, v in facts["labels"].items())
                text += (
                    "# HELP nonstop_healthy 1 while /health answers 200\n"
                    "# TYPE nonstop_healthy gauge\n"
                    f"nonstop_healthy{{{labels}}} {0 if reason else 1}\n"
                ).encode()
            self._send(200, text, "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, b"/metrics or /health\n", "text/plain")

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:  # scrapes every few seconds: not logged
        pass


def main(argv: list[str]) -> None:
    fd, folder, parent, linger = int(argv[0]), argv[1], int(argv[2]), float(argv[3])
    sock = socket.socket(fileno=fd)
    server = Server(sock, folder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while os.getppid() == parent:
        time.sleep(0.2)
    time.sleep(linger)


if __name__ == "__main__":
    main(sys.argv[1:])
