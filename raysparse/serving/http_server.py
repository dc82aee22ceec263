"""uvicorn serving the OpenAI-compatible application (``openai_api.create_app``) from a thread of its own.

``raysparse serve --http-port`` runs it beside the gRPC server on the same engine. The socket is bound in
``start`` (so a busy port fails there, and port 0 gets a free one at once); ``stop`` stops accepting and
gives the requests in flight ``grace_s`` to end before uvicorn cancels them (a cancelled stream aborts
its engine request).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from raysparse.serving.openai_api import create_app
from raysparse.serving.openai_frontend import OpenAIFrontend


class OpenAIHTTPServer:
    def __init__(self, frontend: OpenAIFrontend, host: str = "127.0.0.1", port: int = 8000,
                 metrics_registry: Any = None, grace_s: float = 5.0) -> None:
        self.frontend, self.host, self.grace_s = frontend, host, grace_s
        self._requested_port = port
        self.port = 0
        self.app = create_app(lambda: frontend, metrics_registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self, timeout: float = 30.0) -> OpenAIHTTPServer:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._requested_port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self._requested_port} (HTTP): {e.strerror or e}") from None
        sock.listen(2048)
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=max(1, int(self.grace_s + 0.999)), timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="raysparse-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server failed to start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        return self

    def begin_stop(self) -> None:
        """Stops accepting; requests in flight go on until ``stop`` (at most ``grace_s`` after this)."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self) -> None:
        self.begin_stop()
        if self._thread is not None:
            self._thread.join(timeout=self.grace_s + 10)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._server = None
