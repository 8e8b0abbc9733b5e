"""A stand-in for your app in the deploy examples (compose.yaml runs it from the relay image).

Every ``APP_ORDER_INTERVAL`` seconds it commits one transaction holding an order confirmation
email, written with ``Outbox.enqueue`` exactly as a real app does next to its own rows, and
repeats the key once to show that a duplicate is harmless. It connects with the app role of
``grants-*.sql``, which may only INSERT and SELECT outbox_messages: a real app uses its own
database user, with those grants added.

    APP_DATABASE_URL    SQLAlchemy URL of the app's database (required)
    APP_ORDER_INTERVAL  seconds between orders (default 5)
    APP_ORDERS          stop after this many orders (default: until SIGTERM)
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import uuid
from types import FrameType

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox
from outbox.sqlite import enable_savepoints


def confirmation(order: str) -> Email:
    return Email(
        sender="Shop <shop@example.com>",
        to=[f"customer-{order}@example.com"],
        subject=f"Order {order} confirmed",
        text=f"Thank you for order {order}.",
    )


def main() -> None:
    engine = sa.create_engine(os.environ["APP_DATABASE_URL"], pool_pre_ping=True)
    enable_savepoints(engine)  # only does something on SQLite
    interval = float(os.environ.get("APP_ORDER_INTERVAL", "5"))
    limit = int(os.environ["APP_ORDERS"]) if os.environ.get("APP_ORDERS") else None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    outbox, Session = Outbox(), sessionmaker(engine)
    for n in itertools.count(1):
        order = uuid.uuid4().hex[:12]
        with Session.begin() as session:  # your business rows would be added here too
            first = outbox.enqueue(session, confirmation(order), key=f"order-confirmation:{order}")
            again = outbox.enqueue(session, confirmation(order), key=f"order-confirmation:{order}")
        assert again.duplicate
        assert again.id == first.id
        print(f"order {order} committed with email {first.id}", flush=True)
        if (limit is not None and n >= limit) or stop.wait(interval):
            break
    engine.dispose()


if __name__ == "__main__":
    main()
