"""`llmc hook serve` under load, on loopback: ~1,100 idle connections against a server held to 1,024 descriptors,
slow clients dribbling their headers, a flood of signed deliveries beyond the queue bound, and JSON nested a million
deep. Throughout, `/health` and a correctly signed delivery are answered within ANSWER_WITHIN_S.

The server is the real `llmc hook serve` in a child process with the default `server` limits. The test holds the
state folder's worker lock, so the hook's worker never starts a job: every queued job stays queued and the queue
bound is exact. The limits' own timing (idle, header and request timeouts, shedding past the connection limit) is
checked on an in-process server with short limits. Each part is bounded (counts and deadlines); the whole file runs
in 12-14 s on a shared 2-core machine, 5 s of it the child importing llmc.
"""

from __future__ import annotations

import http.client
import os
import resource
import select
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from llmc.hook.config import load_hook_config
from llmc.hook.queue import JobQueue
from tests.unit.hook_helpers import (hook_config, signed_delivery, signed_headers, start_hook, tiny_recipe,
                                     version_created)

SERVER_NOFILE = 1024  # the descriptor limit the server runs under (the common default)
IDLE_CONNECTIONS = 1100
SLOW_CLIENTS = 100
FLOOD = 40
MAX_QUEUED = 3
ANSWER_WITHIN_S = 5.0  # stated bound for /health and a signed delivery under each load (loopback, shared 2-core box)


def _request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             timeout: float = ANSWER_WITHIN_S) -> tuple[int, bytes, dict, float]:
    """(status, body, headers, seconds) of one request on a fresh connection; fails past `timeout`."""
    parts = urlsplit(url)
    started = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        answer = conn.getresponse()
        data = answer.read()
    except OSError as e:
        raise AssertionError(f"{method} {path} not answered within {timeout} s: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    elapsed = time.monotonic() - started
    assert elapsed < timeout, f"{method} {path} took {elapsed:.1f} s"
    return answer.status, data, dict(answer.getheaders()), elapsed


def _still_answering(url: str) -> tuple[float, float]:
    """A signed delivery for tiny v1 is 202 (queued, or its duplicate) and /health is 200, each in time;
    (delivery seconds, health seconds)."""
    body, headers = signed_delivery(version_created("tiny", "1"))
    status, text, _, delivery_s = _request(url, "POST", "/webhooks/mlflow", body, headers)
    assert status == 202, (status, text)
    status, _, _, health_s = _request(url, "GET", "/health")
    assert status == 200
    return delivery_s, health_s


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    """(URL, queue, log) of `llmc hook serve` at SERVER_NOFILE descriptors, its worker held off."""
    tmp = tmp_path_factory.mktemp("hook-load")
    recipe = tiny_recipe(tmp / "recipe.yaml", tmp / "registry")
    config_path = hook_config(tmp / "hook.yaml", "http://127.0.0.1:9", recipe, max_queued=MAX_QUEUED)
    queue = JobQueue(load_hook_config(config_path).state, MAX_QUEUED)
    with queue.worker_lock():
        proc, url = start_hook(config_path, None, tmp / "hook.log", nofile=SERVER_NOFILE)
        try:
            yield url, queue, tmp / "hook.log"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def descriptors():
    """Raise this process's soft descriptor limit (within the hard limit) for the client sockets; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE_CONNECTIONS + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard descriptor limit {hard} is below the {wanted} this test opens")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_idle(url: str, count: int, batch: int = 100, pause_s: float = 0.1) -> list[socket.socket]:
    """`count` connections that never send a byte, opened `batch` at a time, each batch established (at most 2 s)
    before a short pause: paced so that a server's accept queue does not overflow and the kernel does not drop the
    handshakes itself, which would spare the server the load (werkzeug's queue holds 128)."""
    parts = urlsplit(url)
    sockets: list[socket.socket] = []
    established = 0
    for start in range(0, count, batch):
        pending = [socket.socket() for _ in range(min(batch, count - start))]
        sockets += pending
        for s in pending:
            s.setblocking(False)
            s.connect_ex((parts.hostname, parts.port))
        deadline = time.monotonic() + 2
        while pending and time.monotonic() < deadline:
            poller = select.poll()
            for s in pending:
                poller.register(s, select.POLLOUT)
            ready = {fd for fd, _ in poller.poll(100)}
            established += sum(s.fileno() in ready for s in pending)
            pending = [s for s in pending if s.fileno() not in ready]
        time.sleep(pause_s)
    print(f"\n{established} of {count} idle connections established")
    return sockets


def test_a_signed_delivery_is_answered_with_1100_idle_connections_open(hook, descriptors) -> None:
    url, _, log = hook
    idle = _open_idle(url, IDLE_CONNECTIONS)
    try:
        delivery_s, health_s = _still_answering(url)
    finally:
        for s in idle:
            s.close()
    assert "idle longest first" in log.read_text()  # answered because idle connections were shed
    print(f"\n{IDLE_CONNECTIONS} idle connections: /health {health_s:.3f} s, signed delivery {delivery_s:.3f} s")


def test_slow_clients_do_not_hold_the_server(hook, descriptors) -> None:
    url, _, _ = hook
    parts = urlsplit(url)
    slow, stop = [], threading.Event()
    for _ in range(SLOW_CLIENTS):
        s = socket.create_connection((parts.hostname, parts.port), timeout=ANSWER_WITHIN_S)
        s.sendall(b"POST /webhooks/mlflow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n")
        slow.append(s)

    def dribble() -> None:  # one header byte per client every 0.1 s: never idle, never finished
        while not stop.wait(0.1):
            for s in slow:
                try:
                    s.send(b"x")
                except OSError:
                    pass

    dribbler = threading.Thread(target=dribble, daemon=True)
    dribbler.start()
    try:
        time.sleep(0.3)
        delivery_s, health_s = _still_answering(url)
    finally:
        stop.set()
        dribbler.join(5)
        for s in slow:
            s.close()
    print(f"\n{SLOW_CLIENTS} slow clients: /health {health_s:.3f} s, signed delivery {delivery_s:.3f} s")


def test_a_flood_beyond_the_queue_bound_is_503_with_retry_after_and_health_stays_up(hook) -> None:
    url, queue, _ = hook
    free = MAX_QUEUED - sum(j["state"] in ("queued", "running") for j in queue.jobs())

    def deliver(version: int) -> tuple[int, dict]:
        body, headers = signed_delivery(version_created("tiny", str(version)))
        status, _, answer_headers, _ = _request(url, "POST", "/webhooks/mlflow", body, headers, timeout=30)
        return status, answer_headers

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(deliver, range(1000, 1000 + FLOOD)))
        health = _request(url, "GET", "/health")
    statuses = [s for s, _ in answers]
    assert statuses.count(202) == free and statuses.count(503) == FLOOD - free, statuses
    assert all(h.get("Retry-After") == "60" for s, h in answers if s == 503)
    assert health[0] == 200
    assert len(queue.jobs()) == sum(j["state"] == "queued" for j in queue.jobs()) <= MAX_QUEUED


@pytest.mark.parametrize("body", [b"[" * 1_000_000, b'{"entity": "model_version", "action": "created", "data": '
                                  + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001],
                         ids=["list-1e6-deep", "object-1e5-deep"])
def test_json_nested_a_million_deep_is_a_400_and_the_server_stays_up(hook, body: bytes) -> None:
    url, _, _ = hook
    status, text, _, _ = _request(url, "POST", "/webhooks/mlflow", body, signed_headers(body))
    assert status == 400, (status, text[:300])
    assert b"nests deeper" in text
    _still_answering(url)



# --------------------------------------------------------------------------- the limits themselves, in-process

SHORT = dict(connection_limit=5, idle_timeout_s=0.5, header_timeout_s=0.5, request_timeout_s=1.5,
             max_header_bytes=2048, max_body_bytes=4096)


@pytest.fixture
def short_limits():
    """(HookServer with SHORT limits on a trivial app, its URL), its event loop in a thread; closed after."""
    from llmc.hook.config import ServerSection
    from llmc.hook.http_server import HookServer

    def app(environ, start_response):
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = HookServer(app, ServerSection(**SHORT), "127.0.0.1", 0)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    yield server, f"http://127.0.0.1:{server.effective_port}"

    def close_all() -> None:  # in the loop's thread: the loop ends once nothing is left to watch
        for channel in list(server.active_channels.values()):
            channel.handle_close()
        server.close()

    server.trigger.pull_trigger(close_all)
    loop.join(10)
    server.task_dispatcher.shutdown()


def _closed_after(s: socket.socket, started: float, dribble: bytes = b"", every_s: float = 0.1,
                  within_s: float = 5.0) -> float:
    """Seconds from `started` until the server closed `s` (sending `dribble` every `every_s` meanwhile)."""
    s.setblocking(False)
    deadline = started + within_s
    while time.monotonic() < deadline:
        if select.select([s], [], [], every_s)[0]:
            try:
                if s.recv(4096) == b"":
                    return time.monotonic() - started
            except ConnectionResetError:
                return time.monotonic() - started
        if dribble:
            try:
                s.send(dribble)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
    raise AssertionError(f"still open after {within_s} s")


def test_idle_header_and_request_timeouts_close_connections(short_limits) -> None:
    _, url = short_limits
    parts = urlsplit(url)
    idle, headers, body = (socket.create_connection((parts.hostname, parts.port)) for _ in range(3))
    headers.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # then a header byte every 0.1 s, never the blank line
    body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")  # then a body byte every 0.1 s
    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        closed = list(pool.map(lambda args: _closed_after(*args),
                               [(idle, started), (headers, started, b"x"), (body, started, b"x")]))
    for s in (idle, headers, body):
        s.close()
    # each closed by its own timeout: dribbling keeps the other two from firing; maintenance runs once a second
    assert SHORT["idle_timeout_s"] <= closed[0] < SHORT["idle_timeout_s"] + 2, closed
    assert SHORT["header_timeout_s"] <= closed[1] < SHORT["header_timeout_s"] + 2, closed
    assert SHORT["request_timeout_s"] <= closed[2] < SHORT["request_timeout_s"] + 2, closed


def test_past_the_connection_limit_the_idlest_connection_is_shed(short_limits) -> None:
    server, url = short_limits
    parts = urlsplit(url)
    oldest = [socket.create_connection((parts.hostname, parts.port)) for _ in range(3)]
    time.sleep(0.1)
    newer = [socket.create_connection((parts.hostname, parts.port)) for _ in range(SHORT["connection_limit"])]
    try:
        started = time.monotonic()
        assert all(_closed_after(s, started, within_s=2) < 0.3 for s in oldest)  # shed at once, not at the timeout
        status, text, _, _ = _request(url, "GET", "/")  # one more: sheds another idle one, and is answered
        assert (status, text) == (200, b"ok")
        assert len(server.active_channels) <= SHORT["connection_limit"]
    finally:
        for s in oldest + newer:
            s.close()


def test_bodies_and_headers_past_their_caps_are_refused(short_limits) -> None:
    _, url = short_limits
    assert _request(url, "POST", "/", b"x" * (SHORT["max_body_bytes"] + 1))[0] == 413
    assert _request(url, "GET", "/", headers={"X-Big": "y" * SHORT["max_header_bytes"]})[0] == 431
    assert _request(url, "POST", "/", b"x" * SHORT["max_body_bytes"])[0] == 200
