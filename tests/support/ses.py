"""An SES v2 stand-in for tests: moto in server mode, and a fault-injecting proxy in front of it.

``MotoSes`` runs moto's server on a free local port, verifies the shop's sender identity and
reads back what moto holds. Moto keeps only source, destinations, subject and body of a
``SendEmail`` (no tags, reply-to, headers or attachments), so tests put the outbox key in the
subject, and the :class:`FaultServer` keeps the full request JSON of everything it forwards.

``FaultServer`` is an HTTP server that forwards every request to moto, except
``POST /v2/email/outbound-emails`` (``SendEmail``), where it draws one behaviour per request
from a :class:`FaultPlan` (seeded, changeable at runtime from the test):

* ``pass``: forward to moto and return its answer;
* ``throttle``: 429 ``TooManyRequestsException``;
* ``throttling_v1``: 400 ``Throttling`` "Maximum sending rate exceeded." (the SES v1 code);
* ``server_error``: 500 ``InternalFailure``;
* ``rejected``: 400 ``MessageRejected``;
* ``sending_paused``: 400 ``SendingPausedException`` (also answered to *every* send while
  ``plan.paused`` is on);
* ``hang``: forward to moto (so SES accepted it: it is delivered), then hold the response
  ``plan.hang_seconds`` (longer than the client's read timeout) and close without answering;
* ``reset``: forward to moto, then reset the connection (RST, ``SO_LINGER`` 0);
* ``reset_before``: reset the connection without forwarding;
* ``tls_corrupt`` (TLS mode only): forward to moto, then write one TLS record of random bytes
  under the TLS layer instead of the answer: the client's record check fails while it reads
  the answer (an ``SSLError`` after the whole request arrived, so SES took it).

Scoped refusals, answered to every matching send while set on the plan: a configuration set in
``plan.paused_sets`` gets 400 ``ConfigurationSetSendingPausedException``; a From address or
domain in ``plan.denied_identities`` gets 403 ``AccessDeniedException`` naming the identity's
resource, as SES words it.

Error answers are restJson1: an ``x-amzn-ErrorType`` header, a ``{"message": ...}`` body, the
status and a Content-Length, which is what botocore parses an error code from. Every
``SendEmail`` request is recorded as a :class:`SendRequest` (arrival time, behaviour, outbox
id from the ``outbox_message_id`` tag, recipient count, moto's MessageId if moto accepted it,
and when the client signed it by its own clock: ``X-Amz-Date``).

Events: ``FaultServer(upstream, plan, events=queue)`` (an
:class:`~tests.support.ses_events.EventQueue`, the ``event_queue`` fixture) publishes, for every
send moto accepted, the events SES would (Send, then each recipient's Delivery, Bounce or
Complaint as the mailbox simulator decides) to the queue's SNS topic, after the answer went
out, on a thread of their own; ``plan.events_*`` delay, drop or duplicate them.

TLS mode: ``FaultServer(upstream, plan, tls=context)`` serves HTTPS with a server-side
``ssl.SSLContext`` (a client trusts its certificate through ``AWS_CA_BUNDLE``); its URL is then
``https://``. The handshake runs on the connection's own thread.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import socket
import ssl
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import boto3

from relay.senders import OutgoingMessage
from tests.support.factories import email
from tests.support.ses_events import EventPublisher, EventQueue

__all__ = [
    "AWS_VARIABLES",
    "FAULTS",
    "IDENTITY",
    "REGION",
    "SEND_PATH",
    "FaultPlan",
    "FaultServer",
    "MotoSes",
    "SendRequest",
    "aws_env",
    "max_in_window",
    "outgoing",
]

REGION = "us-east-1"
IDENTITY = "shop@example.com"
SEND_PATH = "/v2/email/outbound-emails"
FAULTS = (
    "throttle",
    "throttling_v1",
    "server_error",
    "rejected",
    "sending_paused",
    "hang",
    "reset",
    "reset_before",
    "config_set_paused",
    "identity_denied",
    "tls_corrupt",
)
FORWARDED = frozenset({"pass", "hang", "reset", "tls_corrupt"})  # kinds whose request reaches moto

# kind -> (status, x-amzn-ErrorType, message)
ERRORS = {
    "throttle": (429, "TooManyRequestsException", "Too many requests."),
    "throttling_v1": (400, "Throttling", "Maximum sending rate exceeded."),
    "server_error": (500, "InternalFailure", "An internal failure occurred."),
    "rejected": (400, "MessageRejected", "Email address is on the suppression list."),
    "sending_paused": (400, "SendingPausedException", "Sending is paused for this account."),
    "config_set_paused": (
        400,
        "ConfigurationSetSendingPausedException",
        "Sending is paused for this configuration set.",
    ),
    "identity_denied": (
        403,
        "AccessDeniedException",
        "User `arn:aws:iam::123456789012:user/relay' is not authorized to perform "
        "`ses:SendEmail' on resource `arn:aws:ses:eu-west-1:123456789012:identity/{identity}'",
    ),
}
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}
)


def aws_env(
    endpoint_url: str, *, region: str = REGION, events_url: str | None = None
) -> dict[str, str]:
    """The environment a relay process needs to reach ``endpoint_url`` as SES v2 in ``region``,
    and only it (no profile or config file of the machine, no instance metadata lookups).
    SQS and SNS go to ``events_url`` (the moto server itself: pass ``moto.url`` when
    ``endpoint_url`` is a :class:`FaultServer`, so the event intake's calls are not counted
    among the proxy's requests), or to ``endpoint_url`` too when not given.

    Both region variables: botocore (1.44) reads only ``AWS_DEFAULT_REGION``, while other AWS
    SDKs, and ``build_client``'s own error message, name ``AWS_REGION``."""
    return {
        "AWS_REGION": region,
        "AWS_DEFAULT_REGION": region,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL_SESV2": endpoint_url,
        "AWS_ENDPOINT_URL_SQS": events_url or endpoint_url,
        "AWS_ENDPOINT_URL_SNS": events_url or endpoint_url,
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


# every variable of the standard AWS chain a test clears before it sets its own
AWS_VARIABLES = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_SESV2",
    "AWS_ENDPOINT_URL_SQS",
    "AWS_ENDPOINT_URL_SNS",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
)


def outgoing(n: int = 1, *, category: str = "default", **fields: Any) -> OutgoingMessage:
    """Message ``n`` as the relay hands it to a sender (id ``n``, key ``key-{n}``, first
    attempt): :func:`tests.support.factories.email` ``n`` with the key in its subject, since
    moto keeps the subject and not the tags; ``fields`` override any Email field."""
    return OutgoingMessage(
        id=n,
        key=f"key-{n}",
        category=category,
        attempt=1,
        email=email(n, **{"subject": f"msg key-{n}", **fields}),
    )


# -- moto -------------------------------------------------------------------------------


class MotoSes:
    """moto's server on 127.0.0.1 (a free port), for SES v1 and v2."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log per request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self.verify()
        # moto builds a service's app and request router on its first request, compiling rules
        # with ast; on Python 3.11 two threads doing that at once can fail a request
        # ("SystemError: AST constructor recursion depth mismatch"), which a relay's first
        # concurrent sends (a fresh server per xdist worker) met: one request each, first.
        self.client("sesv2").list_email_identities()
        self.client("sqs").list_queues()
        self.client("sns").list_topics()

    def client(self, service: str = "sesv2", *, region: str = REGION) -> Any:
        """A boto3 client of ``service`` in ``region``, straight to moto."""
        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=region,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def verify(self, identity: str = IDENTITY, *, region: str = REGION) -> None:
        """Verify an email address or a domain in ``region``. moto, like SES, refuses mail
        whose sender is neither a verified address nor in a verified domain of the region it
        is sent in; the email identity ``shop@example.com`` covers "Shop <shop@example.com>"
        (the display name is parsed away), as the domain ``example.com`` would."""
        ses = self.client("ses", region=region)
        if "@" in identity:
            ses.verify_email_identity(EmailAddress=identity)
        else:
            ses.verify_domain_identity(Domain=identity)

    def reset(self) -> None:
        """Forget everything (sent mail, identities), then verify the sender again."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
        self.verify()

    def messages(self) -> list[dict[str, Any]]:
        """Every message moto accepted since the last reset: ``id``, ``source``,
        ``destinations``, ``subject``, ``body`` (html if there was html, else text)."""
        with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=60) as answer:
            data = json.load(answer)
        ses = data.get("ses", {})
        return [*ses.get("Message", []), *ses.get("RawMessage", [])]

    def stop(self) -> None:
        self._server.stop()


# -- the fault plan ------------------------------------------------------------------------


class FaultPlan:
    """Which behaviour each ``SendEmail`` gets: shares per fault kind (the rest pass), drawn from
    a seeded RNG. Thread-safe; change it while relays run with :meth:`set` or ``paused``.

    The ``events_*`` attributes say how the SES events of accepted sends are published when the
    server has an event queue (see :class:`tests.support.ses_events.EventPublisher`); they draw
    from an RNG of their own, so turning them on leaves the faults' sequence unchanged."""

    def __init__(self, *, seed: int = 0, hang_seconds: float = 3.0, **shares: float) -> None:
        self._rng = random.Random(seed)
        self._events_rng = random.Random(f"events-{seed}")
        self._lock = threading.Lock()
        self.hang_seconds = hang_seconds
        self.events_envelope = "sns"  # or "eventbridge", "raw"
        self.events_delay = 0.0  # seconds before a send's events are published
        self.events_drop = 0.0  # share of events never published
        self.events_drop_sends = 0.0  # share of sends none of whose events is published
        self.events_duplicate = 0.0  # share of events published twice
        self.events_delivery_delay = 0.0  # share of delivered recipients delayed first
        self.events_reorder = 0.0  # share of sends whose Send event comes last
        self.paused = False
        # answered to every send with that ConfigurationSetName / From address (or domain)
        self.paused_sets: set[str] = set()
        self.denied_identities: set[str] = set()
        self._shares: dict[str, float] = {}
        self._script: list[str] = []
        self.set(**shares)

    def set(self, **shares: float) -> None:
        """Replace the shares: ``set(throttle=0.1, hang=0.02)``; kinds not named get 0."""
        unknown = set(shares) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault kinds: {sorted(unknown)}")
        if any(share < 0 for share in shares.values()) or sum(shares.values()) > 1:
            raise ValueError(f"shares must be >= 0 and sum to at most 1: {shares}")
        with self._lock:
            self._shares = {kind: float(share) for kind, share in shares.items() if share}

    def script(self, *kinds: str) -> None:
        """The next sends get exactly these behaviours, in order, before the shares apply."""
        for kind in kinds:
            if kind != "pass" and kind not in FAULTS:
                raise ValueError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._script.extend(kinds)

    def scoped(self, request: dict[str, Any]) -> tuple[str, str] | None:
        """The scoped refusal ``request`` gets, with the identity it names, if any."""
        if request.get("ConfigurationSetName") in self.paused_sets:
            return "config_set_paused", ""
        sender = str(request.get("FromEmailAddress", "")).rsplit("<", 1)[-1].rstrip(">").lower()
        for identity in (sender, sender.rpartition("@")[2]):
            if identity in self.denied_identities:
                return "identity_denied", identity
        return None

    def events_roll(self) -> float:
        """One draw in [0, 1) for the event publisher's choices."""
        with self._lock:
            return self._events_rng.random()

    def draw(self) -> str:
        with self._lock:
            if self.paused:
                return "sending_paused"
            if self._script:
                return self._script.pop(0)
            roll = self._rng.random()
            for kind, share in self._shares.items():
                if roll < share:
                    return kind
                roll -= share
            return "pass"


# -- the proxy -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SendRequest:
    """One ``SendEmail`` request as it arrived, and what the server did with it."""

    at: float  # time.monotonic() when the request reached the server's socket (the door)
    wall: float  # time.time() at the same moment (to compare with timestamps in the database)
    kind: str  # "pass" or one of FAULTS
    outbox_id: int | None
    category: str | None
    recipients: int
    subject: str | None
    request: dict[str, Any]
    status: int | None = None  # the HTTP status moto answered (forwarded kinds), else None
    message_id: str | None = None  # moto's MessageId when moto accepted it
    signed_at: float | None = None  # the request's X-Amz-Date (epoch s): the client's clock
    handled: float | None = None  # time.monotonic() when the server's thread got to it

    @property
    def accepted(self) -> bool:
        """SES (moto) took the message: it is delivered, whether the client heard so or not."""
        return self.message_id is not None


def _parse_send(body: bytes) -> tuple[dict[str, Any], int | None, str | None, int, str | None]:
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return {}, None, None, 0, None
    tags = {t.get("Name"): t.get("Value") for t in request.get("EmailTags", [])}
    outbox_id = tags.get("outbox_message_id")
    destination = request.get("Destination", {})
    recipients = sum(
        len(destination.get(key, [])) for key in ("ToAddresses", "CcAddresses", "BccAddresses")
    )
    simple = request.get("Content", {}).get("Simple", {})
    subject = simple.get("Subject", {}).get("Data")
    return (
        request,
        int(outbox_id) if outbox_id is not None else None,
        tags.get("outbox_category"),
        recipients,
        subject,
    )


def _signed_at(header: str | None) -> float | None:
    """SigV4's ``X-Amz-Date`` (``20240131T120000Z``) as epoch seconds."""
    if not header:
        return None
    try:
        return datetime.strptime(header, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; the module may not name it


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    arrived: float | None = None  # time.time(): when this request's bytes reached the socket

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # here, not in the accepting thread
        else:
            self.request.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        super().setup()
        self.server.track(self.connection, True)

    def handle_one_request(self) -> None:
        self.arrived = self._kernel_arrival()
        super().handle_one_request()

    def _kernel_arrival(self) -> float | None:
        """When the next request's bytes reached this socket, by the kernel's receive stamp:
        the door's own time, however long this process took to get to them (on a loaded
        machine its threads wait for the CPU and the GIL). Peeks, so the request stays to
        be read. None on TLS or a closed connection: then the thread's own time serves.
        The clients here never pipeline, so nothing of the next request is buffered yet."""
        if isinstance(self.connection, ssl.SSLSocket):
            return None
        try:
            data, ancillary, _, _ = self.connection.recvmsg(
                1, socket.CMSG_SPACE(16), socket.MSG_PEEK
            )
        except OSError:
            return None
        for level, kind, stamp in ancillary:
            if data and level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                seconds, nanoseconds = struct.unpack("qq", stamp[:16])
                return seconds + nanoseconds / 1e9
        return None

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        body = self._body()
        fault = self.server.owner
        try:
            if self.command == "POST" and self.path.split("?", 1)[0] == SEND_PATH:
                fault.handle_send(self, body)
            else:
                self._relay(*fault.forward(self.command, self.path, self.headers.items(), body))
        except Exception as exc:
            fault.record_error(f"{self.command} {self.path}: {type(exc).__name__}: {exc}")
            raise

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    def _relay(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, kind: str, identity: str = "") -> None:
        status, code, message = ERRORS[kind]
        body = json.dumps({"message": message.format(identity=identity)}).encode()
        headers = [
            ("Content-Type", "application/json"),
            ("x-amzn-ErrorType", code),
            ("x-amzn-RequestId", f"fault-{kind}-{time.monotonic_ns()}"),
        ]
        self._relay(status, headers, body)

    def _reset(self) -> None:
        """Close with an RST, not a FIN: SO_LINGER on with a zero timeout, then close."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _hang(self, seconds: float) -> None:
        self.server.stopping.wait(seconds)
        self.close_connection = True  # close without ever answering

    def _corrupt_tls(self) -> None:
        """Write one TLS application-data record of random bytes on the raw socket, under the
        TLS layer, then keep the connection until the client hangs up (a few seconds at most):
        the client's record check fails while it reads the answer."""
        self.close_connection = True
        with socket.socket(fileno=os.dup(self.connection.fileno())) as raw:
            raw.sendall(bytes([0x17, 0x03, 0x03, 0x00, 0x40]) + os.urandom(0x40))
            raw.settimeout(5.0)
            with contextlib.suppress(OSError):
                while raw.recv(65536):
                    pass


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 overflows when relays open their pools at once
    owner: FaultServer

    def __init__(self, owner: FaultServer, tls: ssl.SSLContext | None = None) -> None:
        self.owner = owner
        self.tls = tls
        self.stopping = threading.Event()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:  # the handshake waits for the connection's thread
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def track(self, conn: socket.socket, opened: bool) -> None:
        with self._open_lock:
            if opened:
                self._open.add(conn)
            else:
                self._open.discard(conn)

    def close_all(self) -> None:
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request is business as usual here; stay quiet."""


class FaultServer:
    """A SES v2 endpoint that forwards to ``upstream`` (moto) and injects faults into
    ``SendEmail`` according to ``plan``. Use as a context manager, or start()/stop().
    With ``tls`` (a server-side context) it serves HTTPS. With ``events`` (an
    :class:`~tests.support.ses_events.EventQueue`) it publishes the SES events of every send
    moto accepted, answered or not (``hang``, ``reset``, ``tls_corrupt`` too), to that queue's
    topic: :attr:`events` is the publisher, ``events.records`` what it published."""

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        events: EventQueue | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.plan = plan if plan is not None else FaultPlan()
        self._lock = threading.Lock()
        self._sends: list[SendRequest] = []
        self._errors: list[str] = []
        self.other_requests = 0
        self._server = _ProxyServer(self, tls)
        host, port = self._server.server_address[:2]
        self.url = f"{'https' if tls is not None else 'http'}://{host}:{port}"
        self._thread: threading.Thread | None = None
        self.events = (
            EventPublisher(events, self.plan, self.record_error) if events is not None else None
        )

    # lifecycle

    def start(self) -> FaultServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.stopping.set()  # ends hangs at once
        self._server.shutdown()
        self._server.close_all()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)
        if self.events is not None:
            self.events.stop()

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # what happened

    @property
    def sends(self) -> list[SendRequest]:
        """Every SendEmail request that arrived, in arrival order."""
        with self._lock:
            return sorted(self._sends, key=lambda send: send.at)

    @property
    def ledger(self) -> list[SendRequest]:
        """The SendEmail requests moto accepted: what SES took, answered or not."""
        return [s for s in self.sends if s.accepted]

    @property
    def faults(self) -> list[SendRequest]:
        """The SendEmail requests that got a fault instead of a plain pass."""
        return [s for s in self.sends if s.kind != "pass"]

    @property
    def errors(self) -> list[str]:
        """Exceptions the server itself ran into (moto unreachable, a client gone): a test
        that sees any cannot trust what the ledger says."""
        with self._lock:
            return list(self._errors)

    def record_error(self, error: str) -> None:
        with self._lock:
            self._errors.append(error)

    def accepted_per_message(self) -> Counter[int]:
        return Counter(s.outbox_id for s in self.ledger if s.outbox_id is not None)

    def clear(self) -> None:
        with self._lock:
            self._sends.clear()
            self._errors.clear()
            self.other_requests = 0

    # the proxy

    def forward(
        self, method: str, path: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        with self._lock:
            self.other_requests += 1
        return self._upstream_call(method, path, headers, body)

    def _upstream_call(
        self, method: str, path: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self._upstream, timeout=60)
        try:
            sent_headers = {k: v for k, v in headers if k.lower() not in _HOP_BY_HOP}
            sent_headers["Content-Length"] = str(len(body))
            conn.request(method, path, body=body, headers=sent_headers)
            answer = conn.getresponse()
            return answer.status, answer.getheaders(), answer.read()
        finally:
            conn.close()

    def handle_send(self, handler: _Handler, body: bytes) -> None:
        handled, now = time.monotonic(), time.time()
        wall = handler.arrived if handler.arrived is not None else now
        arrived = handled - max(0.0, now - wall)
        kind = self.plan.draw()
        if kind == "tls_corrupt" and not isinstance(handler.connection, ssl.SSLSocket):
            raise ValueError("tls_corrupt needs a FaultServer in TLS mode")
        request, outbox_id, category, recipients, subject = _parse_send(body)
        scoped = self.plan.scoped(request)
        identity = ""
        if scoped is not None:
            kind, identity = scoped
        status = message_id = None
        answer: tuple[int, list[tuple[str, str]], bytes] | None = None
        if kind in FORWARDED:
            answer = self._upstream_call(
                handler.command, handler.path, handler.headers.items(), body
            )
            status = answer[0]
            if status == 200:
                message_id = json.loads(answer[2]).get("MessageId")
        send = SendRequest(
            at=arrived,
            wall=wall,
            handled=handled,
            kind=kind,
            outbox_id=outbox_id,
            category=category,
            recipients=recipients,
            subject=subject,
            request=request,
            status=status,
            message_id=message_id,
            signed_at=_signed_at(handler.headers.get("X-Amz-Date")),
        )
        with self._lock:
            self._sends.append(send)
        # SES took it: its events are queued before the answer leaves (queueing returns at once;
        # the publisher's thread sends them), so a client that has its answer and then waits
        # for the publisher (``events.flush``) finds them queued. Answered or not: hang, reset
        # and tls_corrupt never answer, and a client gone before the answer changes nothing.
        self._publish_events(send)
        if kind == "pass":
            assert answer is not None
            handler._relay(*answer)
            return
        if kind == "hang":
            handler._hang(self.plan.hang_seconds)
        elif kind in ("reset", "reset_before"):
            handler._reset()
        elif kind == "tls_corrupt":
            handler._corrupt_tls()
        else:
            handler._error(kind, identity)

    def _publish_events(self, send: SendRequest) -> None:
        if self.events is None or send.message_id is None:
            return
        try:
            self.events.submit(
                request=send.request,
                message_id=send.message_id,
                outbox_id=send.outbox_id,
                wall=send.wall,
            )
        except Exception as exc:  # the answer path never breaks on an event
            self.record_error(f"ses events for {send.message_id}: {type(exc).__name__}: {exc}")


# -- analysis ------------------------------------------------------------------------------


def max_in_window(events: Iterable[tuple[float, int]], window: float = 1.0) -> tuple[int, float]:
    """The largest total weight of events in any half-open window ``[t, t + window)``, and the
    ``t`` where it starts (each window worth checking starts at an event)."""
    points = sorted(events)
    best, start, total, lo = 0, 0.0, 0, 0
    for at, weight in points:
        total += weight
        while points[lo][0] <= at - window:
            total -= points[lo][1]
            lo += 1
        if total > best:
            best, start = total, points[lo][0]
    return best, start
