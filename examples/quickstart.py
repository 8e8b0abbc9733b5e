"""Quickstart: email written in the same transaction as the order it belongs to, delivered to a
local SES emulator by the relay.

    pip install -e ".[quickstart]"
    python examples/quickstart.py [DATABASE_URL]      # default: sqlite:///quickstart.db

Everything runs in this one process: a SQLite file database, moto's SES emulator on a free
local port (never real AWS: the SES endpoint always points at the emulator), the outbox
migrations, a few orders, then the relay with the real SES sender until nothing is left to send.
Run it as often as you like: it starts from a clean slate each time.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

try:
    import boto3
    from moto.server import ThreadedMotoServer
except ImportError:
    sys.exit(
        "The quickstart needs boto3 and moto's SES emulator: "
        'pip install -e ".[quickstart]"  (or: pip install "moto[server]>=5.0" boto3)'
    )

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from outbox import Attachment, Email, HeaderInjection, Outbox, migrations
from outbox.schema import metadata as outbox_metadata
from outbox.sqlite import enable_savepoints
from relay.config import RelayConfig
from relay.senders.ses import SesSender, build_client
from relay.worker import Relay

SENDER = "shop@example.com"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "quickstart_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(sa.String(255))


def confirmation(order: Order, *, invoice: bool = False) -> Email:
    attachments = ()
    if invoice:
        attachments = (
            Attachment(
                filename=f"invoice-{order.id}.txt",
                content=f"Invoice for order {order.id}: 1 x teapot, 42.00 EUR\n".encode(),
                content_type="text/plain",
            ),
        )
    return Email(
        sender=f"Shop <{SENDER}>",
        to=[order.customer],
        subject=f"Order {order.id} confirmed",
        text=f"Thank you for order {order.id}.",
        html=f"<p>Thank you for order <b>{order.id}</b>.</p>",
        attachments=attachments,
    )


@contextmanager
def step(title: str) -> Iterator[None]:
    """A progress line for a step that takes a moment."""
    print(f"... {title}", flush=True)
    started = time.monotonic()
    yield
    print(f"    done in {time.monotonic() - started:.1f}s", flush=True)


@contextmanager
def ses_emulator() -> Iterator[str]:
    """moto's SES emulator on 127.0.0.1 (a free port), with the shop's sender verified."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # The relay builds its SES client from boto3's standard chain. Point that chain at the
    # emulator: the endpoint always (so nothing here can reach real AWS), a region and
    # throwaway credentials only where none are configured (moto accepts any).
    os.environ["AWS_ENDPOINT_URL_SESV2"] = url
    os.environ.setdefault("AWS_REGION", "us-east-1")
    os.environ.setdefault("AWS_DEFAULT_REGION", os.environ["AWS_REGION"])
    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        os.environ["AWS_ACCESS_KEY_ID"] = "quickstart"
        os.environ["AWS_SECRET_ACCESS_KEY"] = "quickstart"
        os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        # SES only sends from verified identities, and so does moto.
        ses = boto3.client("ses", endpoint_url=url, region_name=os.environ["AWS_DEFAULT_REGION"])
        ses.verify_email_identity(EmailAddress=SENDER)
        yield url
    finally:
        server.stop()


def main(url: str) -> None:
    with ExitStack() as stack:
        with step("starting the SES emulator (moto) on 127.0.0.1"):
            emulator = stack.enter_context(ses_emulator())
        print(f"    SES emulator at {emulator}, sender {SENDER} verified")
        run(url, emulator)


def run(url: str, emulator: str) -> None:
    engine = sa.create_engine(url)
    enable_savepoints(engine)  # SQLite only: make SAVEPOINT work (a no-op elsewhere)
    migrations.upgrade(engine)  # the outbox tables and views (same as `outbox-relay migrate`)
    Base.metadata.create_all(engine)
    with engine.begin() as conn:  # start from a clean slate so the demo can run again
        conn.execute(Order.__table__.delete())
        for table in reversed(outbox_metadata.sorted_tables):
            conn.execute(table.delete())

    ob = Outbox()
    Session = sessionmaker(engine)
    print("\norders:")

    # 1. An order and its email commit together.
    with Session.begin() as session:
        order = Order(id=1, customer="ada@example.com")
        session.add(order)
        ob.enqueue(
            session, confirmation(order), key="order-confirmation:1", category="transactional"
        )
    print("  order 1 committed with its confirmation email")

    # 2. A rolled-back order leaves no email behind.
    with Session() as session:
        order = Order(id=2, customer="bob@example.com")
        session.add(order)
        ob.enqueue(session, confirmation(order), key="order-confirmation:2")
        session.rollback()
    print("  order 2 rolled back: its email is gone with it")

    # 3. Repeating a key is harmless, and the transaction carries on.
    with Session.begin() as session:
        order = Order(id=3, customer="cy@example.com")
        session.add(order)
        first = ob.enqueue(session, confirmation(order), key="order-confirmation:3")
        again = ob.enqueue(session, confirmation(order), key="order-confirmation:3")
        # 4. An email with an attachment, in the same transaction.
        order4 = Order(id=4, customer="dee@example.com")
        session.add(order4)
        ob.enqueue(session, confirmation(order4, invoice=True), key="order-confirmation:4")
    print(
        f"  order 3: first enqueue id={first.id}, repeat duplicate={again.duplicate} "
        f"(same id {again.id})\n"
        "  order 4 committed in the same transaction, its email with an invoice attached"
    )

    # 5. Bad input is refused before it reaches the database; the session stays usable.
    with Session.begin() as session:
        order = Order(id=5, customer="eve@example.com")
        session.add(order)
        try:
            Email(
                sender=SENDER,
                to=[order.customer],
                subject="Hello\r\nBcc: everyone@example.com",
                text="...",
            )
        except HeaderInjection as exc:
            print(f"  refused: {exc}")
        ob.enqueue(session, confirmation(order), key="order-confirmation:5")
    print("  order 5 committed with a valid email after the refusal")

    with engine.connect() as conn:
        orders = conn.execute(sa.select(Order.id).order_by(Order.id)).scalars().all()
    print(f"\nquickstart_orders: {orders}")
    show_summary(engine, "committed, waiting for the relay")

    # 6. The relay delivers what committed, through the real SES sender (here to the emulator).
    #    In production it is its own process: `outbox-relay run --sender ses`.
    config = RelayConfig(database_url=url, sender="ses", exit_when_idle=True, relay_id="quickstart")
    client = build_client(send_timeout=config.send_timeout, concurrency=config.concurrency)
    if client.meta.endpoint_url != emulator:  # belt and braces: never real AWS from here
        raise SystemExit(f"refusing to send: SES endpoint is {client.meta.endpoint_url}")
    with step("running the relay until nothing is left to send"):
        Relay(engine=engine, sender=SesSender(client), config=config).run()

    show_received(emulator)
    show_summary(engine, "after the relay")
    engine.dispose()


def show_summary(engine: sa.Engine, title: str) -> None:
    query = sa.text(
        "SELECT category, status, message_count FROM outbox_status_summary "
        "ORDER BY category, status"
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    print(f"\noutbox_status_summary ({title}):")
    print(f"  {'category':<14} {'status':<16} messages")
    for row in rows:
        print(f"  {row.category:<14} {row.status:<16} {row.message_count}")


def show_received(emulator: str) -> None:
    with urllib.request.urlopen(f"{emulator}/moto-api/data.json", timeout=30) as answer:
        data: dict[str, Any] = json.load(answer)
    ses = data.get("ses", {})
    received = [*ses.get("Message", []), *ses.get("RawMessage", [])]
    print(f"\nthe SES emulator received {len(received)} emails (moto keeps no attachments):")
    lines = []
    for item in received:
        subject = item.get("subject")
        to = ", ".join(item.get("destinations", {}).get("ToAddresses", []) or [])
        lines.append(f"  {item.get('source')} -> {to}: {subject!r}")
    print("\n".join(sorted(lines)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///quickstart.db")
