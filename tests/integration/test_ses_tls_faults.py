"""``SesSender`` through real boto3 against wire faults the fault proxy cannot make: TLS that
breaks before or after the request went out, and answers that are not SES's own.

Each test runs a small server on 127.0.0.1 (over TLS with a certificate made here with
``cryptography``, trusted through ``AWS_CA_BUNDLE`` as an operator would trust a private CA)
that reads every request whole before it misbehaves, and records what it read. So "the
request reached the server" is a fact of the test, and the outcome is checked against it:
whatever may have arrived is ambiguous, only what provably never left may be retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable

import pytest

from relay.senders import Accepted, Ambiguous, Permanent, Transient
from relay.senders.ses import SesSender, build_client
from tests.support.ses import AWS_VARIABLES, SEND_PATH, aws_env, outgoing
from tests.support.tls import Certificate, make_certificate

SEND_TIMEOUT = 2.0  # the client's read timeout: moto answers within it on a loaded machine
IO_TIMEOUT = 5.0  # how long the server waits on a client that went quiet


# -- TLS material ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Certificate]:
    """``trusted``: the endpoint's certificate, in the client's CA bundle; ``stranger``: one
    the client has never seen."""
    folder = tmp_path_factory.mktemp("ses-tls")
    return {name: make_certificate(folder, name) for name in ("trusted", "stranger")}


# -- the server ------------------------------------------------------------------------------


def read_request(conn: socket.socket) -> bytes | None:
    """One whole HTTP request (head and Content-Length body), or None if the client stopped
    before the end of it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body


def wait_for_close(conn: socket.socket) -> None:
    """Keep the connection until the client hangs up (or IO_TIMEOUT passes)."""
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass


Behaviour = Callable[[socket.socket], bytes | None]  # what it read, if a whole request


class WireServer:
    """A TCP server on 127.0.0.1 that hands each connection (TLS-wrapped when ``tls`` is
    given) to ``behaviour``; records every whole request a behaviour read, and every TLS
    handshake that failed."""

    def __init__(self, behaviour: Behaviour, tls: ssl.SSLContext | None = None) -> None:
        self.behaviour = behaviour
        self.tls = tls
        self.requests: list[bytes] = []
        self.handshake_failures: list[str] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> WireServer:
        self._threads.append(threading.Thread(target=self._accept, daemon=True))
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(IO_TIMEOUT + 5)
        self._listener.close()

    @property
    def sends(self) -> list[dict]:
        """The SendEmail request bodies that arrived whole."""
        with self._lock:
            requests = list(self.requests)
        return [
            json.loads(r.partition(b"\r\n\r\n")[2])
            for r in requests
            if r.startswith(f"POST {SEND_PATH} ".encode())
        ]

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT)
        try:
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    with self._lock:
                        self.handshake_failures.append(f"{type(exc).__name__}: {exc}")
                    return
            request = self.behaviour(conn)
            if request is not None:
                with self._lock:
                    self.requests.append(request)
        except Exception as exc:
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()


def answer(status: str, headers: dict[str, str], body: bytes) -> Behaviour:
    """Read the request, answer with this status line, headers and body."""

    def behave(conn: socket.socket) -> bytes | None:
        request = read_request(conn)
        if request is None:
            return None
        head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        wait_for_close(conn)
        return request

    return behave


def corrupt_record_after_the_request(conn: socket.socket) -> bytes | None:
    """Read the whole request over TLS, then write one TLS application-data record of random
    bytes on the raw socket, under the TLS layer: the client's record check fails while it
    reads the answer."""
    request = read_request(conn)
    if request is None:
        return None
    with socket.socket(fileno=os.dup(conn.fileno())) as raw:
        raw.sendall(bytes([0x17, 0x03, 0x03, 0x00, 0x40]) + os.urandom(0x40))
        wait_for_close(raw)
    return request


def plain_http_refusal(conn: socket.socket) -> bytes | None:
    """A plain HTTP server where TLS was expected: it reads the ClientHello as a garbled
    request and answers 400, which the client reads as a broken handshake."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    wait_for_close(conn)
    return None


def reset_in_the_handshake(conn: socket.socket) -> bytes | None:
    """Read the ClientHello, then close with an RST."""
    conn.recv(65536)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return None


def silent(conn: socket.socket) -> bytes | None:
    """Accept the connection, never say a word (no ServerHello)."""
    wait_for_close(conn)
    return None


# -- the client ------------------------------------------------------------------------------


@pytest.fixture
def sender_for(monkeypatch, tmp_path) -> Callable[..., SesSender]:
    """``sender_for(url, ca=cert)``: a SesSender built by ``build_client`` from the standard
    chain, pointed at ``url`` and trusting ``ca`` (``AWS_CA_BUNDLE``)."""
    for name in (*AWS_VARIABLES, "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)

    def make(url: str, *, ca: Certificate | None = None) -> SesSender:
        for name, value in aws_env(url).items():
            monkeypatch.setenv(name, value)
        if ca is not None:
            monkeypatch.setenv("AWS_CA_BUNDLE", str(ca.cert_file))
        return SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))

    return make


# -- TLS ---------------------------------------------------------------------------------------


def test_a_tls_error_after_the_whole_request_arrived_is_ambiguous(certs, sender_for):
    """botocore raises the same ``SSLError`` for a broken record in the answer as for a
    failed handshake; here the server holds the complete request, so SES may have it."""
    tls = certs["trusted"].server_context()
    with WireServer(corrupt_record_after_the_request, tls) as server:
        outcome = sender_for(server.url, ca=certs["trusted"]).send(outgoing(1))

    [arrived] = server.sends  # the whole request, as the sender built it
    assert {"Name": "outbox_message_id", "Value": "1"} in arrived["EmailTags"]
    assert server.errors == []
    assert isinstance(outcome, Ambiguous), outcome
    assert outcome.code == "SSLError"
    assert "bad record mac" in outcome.message.lower()


def test_a_certificate_the_client_does_not_trust_is_transient_nothing_was_sent(certs, sender_for):
    tls = certs["stranger"].server_context()
    with WireServer(answer("200 OK", {}, b"{}"), tls) as server:
        outcome = sender_for(server.url, ca=certs["trusted"]).send(outgoing(2))

    assert server.requests == []
    assert len(server.handshake_failures) == 1  # it got as far as the handshake, no further
    assert isinstance(outcome, Transient), outcome
    assert outcome.code == "SSLError"
    assert "certificate verify failed" in outcome.message


@pytest.mark.parametrize(
    ("behaviour", "code"),
    [
        pytest.param(plain_http_refusal, "SSLError", id="plain-http-where-tls-was-expected"),
        pytest.param(reset_in_the_handshake, "ConnectionClosedError", id="reset-in-handshake"),
        pytest.param(silent, "ReadTimeoutError", id="no-server-hello-before-the-read-timeout"),
    ],
)
def test_a_handshake_that_fails_is_transient_the_request_was_never_written(
    sender_for, behaviour, code
):
    """The request is written only once the handshake is done: a handshake that breaks or
    times out (botocore calls the latter a read timeout) cannot have delivered it."""
    with WireServer(behaviour) as server:
        https = server.url.replace("http://", "https://")
        outcome = sender_for(https).send(outgoing(3))

    assert server.requests == []
    assert server.errors == []
    assert isinstance(outcome, Transient), outcome
    assert outcome.code == code


# -- answers that are not SES's -----------------------------------------------------------------

BAD_GATEWAY = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        pytest.param("502 Bad Gateway", {"Content-Type": "text/html"}, BAD_GATEWAY, id="502-html"),
        pytest.param("504 Gateway Timeout", {}, b"", id="504-empty"),
        pytest.param(
            "503 Service Unavailable",
            {"Content-Type": "application/json"},
            b'{"message": "upstream unavailable"}',
            id="503-json-without-request-id",
        ),
        pytest.param(
            "400 Bad Request",
            {"Content-Type": "text/plain"},
            b"request header too large",
            id="400-text",
        ),
        pytest.param(
            "200 OK", {"Content-Type": "text/html"}, b"<html>sign in</html>", id="200-html"
        ),
    ],
)
def test_an_answer_that_is_not_from_ses_is_ambiguous(sender_for, status, headers, body):
    """A proxy or load balancer between the relay and SES answers for itself, possibly after
    SES took the message: without SES's request id and error code (or, for a 200, its
    MessageId) the answer says nothing about the message."""
    with WireServer(answer(status, headers, body)) as server:
        outcome = sender_for(server.url).send(outgoing(4))

    assert len(server.sends) == 1
    assert isinstance(outcome, Ambiguous), outcome


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        ("503 Service Unavailable", "ServiceUnavailable", Transient),
        ("400 Bad Request", "MessageRejected", Permanent),
    ],
)
def test_the_same_status_in_ses_own_shape_is_its_answer(sender_for, status, code, expected):
    """What SES sends: its error code in ``x-amzn-ErrorType``, its request id, a JSON body."""
    headers = {
        "Content-Type": "application/json",
        "x-amzn-ErrorType": f"{code}:http://internal.amazon.com/coral/com.amazon.sesv2/",
        "x-amzn-RequestId": "b2c0e8a4-1111-4f6e-9c51-7c1f0f2d0a11",
    }
    with WireServer(answer(status, headers, b'{"message": "from SES"}')) as server:
        outcome = sender_for(server.url).send(outgoing(5))

    assert len(server.sends) == 1
    assert type(outcome) is expected
    assert (outcome.code, outcome.message) == (code, "from SES")


def test_a_success_with_ses_message_id_is_accepted(sender_for):
    headers = {"Content-Type": "application/json", "x-amzn-RequestId": "5e1d-req"}
    with WireServer(answer("200 OK", headers, b'{"MessageId": "0100-abc"}')) as server:
        outcome = sender_for(server.url).send(outgoing(6))

    assert len(server.sends) == 1
    assert outcome == Accepted(provider_message_id="0100-abc")
