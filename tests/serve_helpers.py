"""A real `specgraft serve` app on a free 127.0.0.1 port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import torch
import uvicorn

from specgraft.heads import PromptLookup

HOST = "127.0.0.1"  # tests never send traffic anywhere else
START_TIMEOUT_S = 30.0


class ServerThread:
    """uvicorn serving ``app`` on a socket bound to a free port; `stop` drains it as SIGTERM would."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server on {self.url} did not become healthy in {START_TIMEOUT_S}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def spawn_server(*flags: str, timeout: float = 90.0):
    """`specgraft serve` over stories260K on a free 127.0.0.1 port in a process of its own (one thread), once it
    answers /health: (the process, its URL). Its stderr is a pipe; the caller stops it."""
    import subprocess
    import sys

    from conftest import STORIES

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    url = f"http://{HOST}:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specgraft.cli", "serve", "--target", str(STORIES), "--port", str(port), "--threads", "1",
         *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the server did not answer /health in {timeout}s: {proc.communicate()[1][-3000:]}")


class Boom(PromptLookup):
    """Prompt lookup that fails on prompts holding ``trigger``: a drafter failing on one request's input."""

    def __init__(self, trigger: int) -> None:
        super().__init__()
        self.trigger = trigger

    def start(self, prompt_ids: torch.Tensor, hidden):
        if self.trigger in prompt_ids.tolist():
            raise RuntimeError(f"drafter failure on token {self.trigger}")
        return super().start(prompt_ids, hidden)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
