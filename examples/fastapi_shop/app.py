"""A FastAPI shop on async SQLAlchemy sessions whose emails go through the outbox.

(No ``from __future__ import annotations`` here: FastAPI reads the annotations of the
routes, and ``Db`` below is local to ``create_app``.)

* ``POST /signup {"email": ...}`` creates a User; an ``on_insert`` rule writes its welcome
  email in the same transaction (``ob.install(async_sessionmaker)``).
* ``POST /checkout {"user_id": ..., "item": ...}`` creates an Order and enqueues its
  confirmation with ``await ob.enqueue_async(session, ...)``, keyed by the order id.

Run it: ``DATABASE_URL=postgresql+psycopg://... uvicorn examples.fastapi_shop.app:app``
(and ``outbox-relay migrate`` / ``outbox-relay run`` against the same database).
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import Email, Outbox
from outbox.sqlite import enable_savepoints

SHOP = "Shop <shop@example.com>"
ob = Outbox()


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "fastapi_shop_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255), unique=True)


class Order(Base):
    __tablename__ = "fastapi_shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(sa.ForeignKey("fastapi_shop_users.id"))
    item: Mapped[str] = mapped_column(sa.String(255))


@ob.on_insert(User, name="welcome", category="transactional")
def welcome(user: User) -> Email:
    return Email(sender=SHOP, to=[user.email], subject="Welcome to the shop", text="Hi!")


class SignUp(BaseModel):
    email: str


class Checkout(BaseModel):
    user_id: int
    item: str


def create_app(database_url: str | None = None) -> FastAPI:
    """``database_url`` uses an async driver (``postgresql+psycopg``, ``sqlite+aiosqlite``)."""
    engine = create_async_engine(database_url or os.environ["DATABASE_URL"])
    enable_savepoints(engine)  # SQLite only; a no-op elsewhere
    Session = async_sessionmaker(engine, expire_on_commit=False)
    ob.install(Session)  # rules run after each flush of these sessions

    async def session() -> AsyncIterator[AsyncSession]:
        async with Session() as s:
            yield s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.dispose()

    Db = Annotated[AsyncSession, Depends(session)]
    app = FastAPI(lifespan=lifespan)

    @app.post("/signup", status_code=201)
    async def signup(body: SignUp, db: Db) -> dict[str, Any]:
        async with db.begin():  # the user and its welcome email, or neither
            user = User(email=body.email)
            db.add(user)
        return {"id": user.id}

    @app.post("/checkout", status_code=201)
    async def checkout(body: Checkout, db: Db) -> dict[str, Any]:
        async with db.begin():
            user = await db.get(User, body.user_id)
            if user is None:
                raise HTTPException(404, "no such user")
            order = Order(user_id=user.id, item=body.item)
            db.add(order)
            await db.flush()  # the order id, for the key and the subject
            result = await ob.enqueue_async(
                db,
                Email(
                    sender=SHOP,
                    to=[user.email],
                    subject=f"Order {order.id} confirmed",
                    text=f"Thanks for buying {order.item}.",
                ),
                key=f"order-confirmation:{order.id}",
                category="transactional",
            )
        return {"id": order.id, "outbox_id": result.id}

    return app


if os.environ.get("DATABASE_URL"):
    app = create_app()
