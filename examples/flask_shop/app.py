"""A Flask + Flask-SQLAlchemy shop whose emails go through the outbox.

* ``POST /signup {"email": ...}`` creates a User; an ``on_insert`` rule writes its welcome
  email in the same transaction (the rule is installed on ``db.session``'s sessionmaker).
* ``POST /checkout {"user_id": ..., "item": ...}`` creates an Order and enqueues its
  confirmation with ``ob.enqueue(db.session, ...)``, keyed by the order id.

Run it: ``DATABASE_URL=postgresql+psycopg://... flask --app examples/flask_shop/app.py run``
(and ``outbox-relay migrate`` / ``outbox-relay run`` against the same database).
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import Email, Outbox
from outbox.sqlite import enable_savepoints

SHOP = "Shop <shop@example.com>"


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
ob = Outbox()


class User(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_shop_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255), unique=True)


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(sa.ForeignKey("flask_shop_users.id"))
    item: Mapped[str] = mapped_column(sa.String(255))


@ob.on_insert(User, name="welcome", category="transactional")
def welcome(user: User) -> Email:
    return Email(sender=SHOP, to=[user.email], subject="Welcome to the shop", text="Hi!")


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url or os.environ["DATABASE_URL"]
    db.init_app(app)
    with app.app_context():
        enable_savepoints(db.engine)  # SQLite only; a no-op elsewhere
    # Rules run after each flush of sessions made by this sessionmaker (idempotent).
    ob.install(db.session.session_factory)

    @app.post("/signup")
    def signup() -> tuple[dict[str, Any], int]:
        user = User(email=request.get_json()["email"])
        db.session.add(user)
        db.session.commit()  # the user and its welcome email, or neither
        return {"id": user.id}, 201

    @app.post("/checkout")
    def checkout() -> tuple[dict[str, Any], int]:
        body = request.get_json()
        user = db.get_or_404(User, body["user_id"])
        order = Order(user_id=user.id, item=body["item"])
        db.session.add(order)
        db.session.flush()  # the order id, for the key and the subject
        result = ob.enqueue(
            db.session,
            Email(
                sender=SHOP,
                to=[user.email],
                subject=f"Order {order.id} confirmed",
                text=f"Thanks for buying {order.item}.",
            ),
            key=f"order-confirmation:{order.id}",
            category="transactional",
        )
        db.session.commit()
        return {"id": order.id, "outbox_id": result.id}, 201

    return app
