"""``outbox.testing`` outside pytest: its module imports, and ``enqueued_messages`` works, in a
process where pytest cannot be imported (the plugin's fixtures exist only where it can)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["pytest"] = None  # any `import pytest` now fails

    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    import outbox.testing
    from outbox import Email, Outbox
    from outbox.schema import metadata

    engine = sa.create_engine("sqlite:///" + sys.argv[1])
    metadata.create_all(engine)
    with Session(engine) as session:
        Outbox().enqueue(
            session,
            Email(sender="shop@example.com", to=["ada@example.com"], subject="Hi", text="t"),
            key="welcome:1",
        )
        session.commit()
    [message] = outbox.testing.enqueued_messages(engine)
    print(message.key, message.status, message.email.to[0])
    print(sorted(outbox.testing.__all__))
    print(hasattr(outbox.testing, "outbox_relay"), sys.modules["pytest"])
    """
)


def test_outbox_testing_imports_and_reads_without_pytest(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "app.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "welcome:1 pending ada@example.com",
        "['EnqueuedMessage', 'empty_outbox', 'enqueued_messages']",
        "False None",
    ]


def test_with_pytest_the_module_carries_the_fixtures():
    import outbox.testing

    assert {"outbox_engine", "outbox_messages", "outbox_relay"} <= set(outbox.testing.__all__)
    assert all(hasattr(outbox.testing, name) for name in outbox.testing.__all__)
