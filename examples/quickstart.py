"""Quickstart: email written in the same transaction as the order it belongs to.

Runs on a SQLite file with no server: `python examples/quickstart.py [DATABASE_URL]`.
"""

from __future__ import annotations

import sys

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from outbox import Email, HeaderInjection, Outbox, migrations
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from relay.config import RelayConfig
from relay.senders.console import ConsoleSender
from relay.worker import Relay


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "quickstart_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(sa.String(255))


def confirmation(order: Order) -> Email:
    return Email(
        sender="Shop <shop@example.com>",
        to=[order.customer],
        subject=f"Order {order.id} confirmed",
        text=f"Thank you for order {order.id}.",
        html=f"<p>Thank you for order <b>{order.id}</b>.</p>",
    )


def main(url: str) -> None:
    engine = sa.create_engine(url)
    enable_savepoints(engine)  # SQLite only: make SAVEPOINT work (a no-op elsewhere)
    migrations.upgrade(engine)  # the outbox tables and views (same as `outbox-relay migrate`)
    Base.metadata.create_all(engine)
    with engine.begin() as conn:  # start from a clean slate so the demo can run again
        conn.execute(Order.__table__.delete())
        conn.execute(messages.delete())

    ob = Outbox()
    Session = sessionmaker(engine)

    # 1. An order and its email commit together.
    with Session.begin() as session:
        order = Order(id=1, customer="ada@example.com")
        session.add(order)
        ob.enqueue(
            session, confirmation(order), key="order-confirmation:1", category="transactional"
        )
    print("order 1 committed with its confirmation email")

    # 2. A rolled-back order leaves no email behind.
    with Session() as session:
        order = Order(id=2, customer="bob@example.com")
        session.add(order)
        ob.enqueue(session, confirmation(order), key="order-confirmation:2")
        session.rollback()
    print("order 2 rolled back: its email is gone with it")

    # 3. Repeating a key is harmless, and the transaction carries on.
    with Session.begin() as session:
        order = Order(id=3, customer="cy@example.com")
        session.add(order)
        first = ob.enqueue(session, confirmation(order), key="order-confirmation:3")
        again = ob.enqueue(session, confirmation(order), key="order-confirmation:3")
        session.add(Order(id=4, customer="dee@example.com"))
    print(
        f"order 3: first enqueue id={first.id}, repeat duplicate={again.duplicate} "
        f"(same id {again.id}); order 4 committed in the same transaction"
    )

    # 4. Bad input is refused before it reaches the database; the session stays usable.
    with Session.begin() as session:
        order = Order(id=5, customer="eve@example.com")
        session.add(order)
        try:
            Email(
                sender="shop@example.com",
                to=[order.customer],
                subject="Hello\r\nBcc: everyone@example.com",
                text="...",
            )
        except HeaderInjection as exc:
            print(f"refused: {exc}")
        ob.enqueue(session, confirmation(order), key="order-confirmation:5")
    print("order 5 committed with a valid email after the refusal")

    show(engine, "committed, waiting for the relay")
    with engine.connect() as conn:
        orders = conn.execute(sa.select(Order.id).order_by(Order.id)).scalars().all()
    print(f"quickstart_orders: {orders}")

    # 5. The relay delivers what committed: here to the console, in production with
    #    `outbox-relay run` as a separate process.
    print("\nrelay:")
    config = RelayConfig(database_url=url, exit_when_idle=True, relay_id="quickstart")
    Relay(engine=engine, sender=ConsoleSender(), config=config).run()
    show(engine, "after the relay")
    engine.dispose()


def show(engine: sa.Engine, title: str) -> None:
    columns = (messages.c.id, messages.c.idempotency_key, messages.c.status, messages.c.recipients)
    with engine.connect() as conn:
        print(f"\noutbox_messages ({title}):")
        for row in conn.execute(sa.select(*columns).order_by(messages.c.id)):
            print(f"  {row.id:>3}  {row.idempotency_key:<24} {row.status:<8} {row.recipients}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///quickstart.db")
