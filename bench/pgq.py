"""The peer: pgqueuer (the ``bench`` extra) draining the same number of jobs on the same
PostgreSQL, in a process of its own.

``python -m bench.pgq --dsn postgresql://... --jobs N --batch-size 50`` installs pgqueuer's
schema afresh, enqueues ``N`` jobs carrying the outbox's own stored payload (in chunks, not
measured), then drains them with pgqueuer's ``QueueManager`` in drain mode and a handler
that does nothing. It prints one JSON line: jobs, seconds, the process's CPU seconds over the
drain, the statements pgqueuer sent through its driver during the drain, and the WAL
positions before and after it (the caller sums the WAL of its own database between them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import timedelta
from typing import Any

__all__ = ["drain", "main"]

_ENTRYPOINT = "bench"
_CHUNK = 5000


async def drain(dsn: str, jobs: int, batch_size: int, payload: bytes) -> dict[str, Any]:
    """Enqueue ``jobs`` jobs, then drain them with pgqueuer; the drain's measures."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    class CountingDriver(AsyncpgDriver):
        statements = 0

        async def fetch(self, query: str, *args: object) -> list[dict[str, object]]:
            self.statements += 1
            return await super().fetch(query, *args)

        async def execute(self, query: str, *args: object) -> str:
            self.statements += 1
            return await super().execute(query, *args)

    setup = await asyncpg.connect(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        driver = CountingDriver(conn)
        queries = Queries(driver)
        if await queries.schema_is_installed():
            await queries.uninstall()
        await queries.install()
        for start in range(0, jobs, _CHUNK):
            k = min(_CHUNK, jobs - start)
            await queries.enqueue([_ENTRYPOINT] * k, [payload] * k, [0] * k)
        await setup.execute("ANALYZE")

        qm = QueueManager(queries)
        handled = 0

        @qm.entrypoint(_ENTRYPOINT)
        async def handle(job: Job) -> None:
            nonlocal handled
            handled += 1

        driver.statements = 0
        wal_start = await setup.fetchval("SELECT pg_current_wal_lsn()::text")
        cpu = time.process_time()
        began = time.perf_counter()
        await qm.run(
            batch_size=batch_size,
            mode=QueueExecutionMode.drain,
            dequeue_timeout=timedelta(seconds=1),
        )
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
        statements = driver.statements
        wal_end = await setup.fetchval("SELECT pg_current_wal_lsn()::text")
        left = await setup.fetchval("SELECT count(*) FROM pgqueuer")
    finally:
        await conn.close()
        await setup.close()
    if handled != jobs or left:
        raise RuntimeError(f"pgqueuer handled {handled} of {jobs} jobs, {left} left queued")
    return {
        "jobs": jobs,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "statements": statements,
        "wal_start": wal_start,
        "wal_end": wal_end,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pgq", description=__doc__)
    parser.add_argument("--dsn", required=True, help="postgresql://... (asyncpg)")
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--payload-file", default=None, help="bytes each job carries")
    args = parser.parse_args(argv)
    payload = b"{}"
    if args.payload_file:
        with open(args.payload_file, "rb") as f:
            payload = f.read()
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    result = runner(drain(args.dsn, args.jobs, args.batch_size, payload))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
