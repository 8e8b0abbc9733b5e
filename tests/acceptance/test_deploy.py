"""The deployment files, tested without Docker: what the image runs, run here.

The Dockerfile and examples/deploy are parsed, the build context that ``.dockerignore`` lets
through is copied and built into a wheel like the image's build stage does, and that wheel
(not the checkout) runs the image's commands as subprocesses: ENTRYPOINT + the init step's
arguments, then ENTRYPOINT + CMD with the image's ENV, against SQLite and moto's SES server.
The HEALTHCHECK's one-liner is run against a relay's ``--http-port``. The compose file's
services run the same way on SQLite; the Kubernetes manifest's shutdown timing is checked
against the relay's drain.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox, migrations
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from relay.cli import main as cli_main
from relay.testing import read_deliveries
from tests.support.relays import FAKE_SENDER, clean_env
from tests.support.ses import MotoSes, aws_env
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "examples" / "deploy"
VENV_BIN = Path(sys.executable).parent
REGION = "eu-west-1"
SENDER = "shop@example.com"


# -- the Dockerfile ---------------------------------------------------------------------------


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [rest for word, rest in self.instructions if word == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"no {keyword} in the stage FROM {self.image}"
        return found[-1]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for rest in self.all("ENV"):
            for pair in shlex.split(rest):
                name, sep, value = pair.partition("=")
                assert sep, f"ENV {rest!r}: use the NAME=value form"
                values[name] = value
        return values


@dataclass
class Dockerfile:
    text: str
    stages: list[Stage]

    @property
    def runtime(self) -> Stage:
        return self.stages[-1]

    def exec_form(self, keyword: str) -> list[str]:
        value = json.loads(self.runtime.last(keyword))
        assert isinstance(value, list), f"{keyword} must be in exec (JSON array) form"
        return value

    @property
    def entrypoint(self) -> list[str]:
        return self.exec_form("ENTRYPOINT")

    @property
    def cmd(self) -> list[str]:
        return self.exec_form("CMD")

    @property
    def healthcheck(self) -> list[str]:
        _options, _, command = self.runtime.last("HEALTHCHECK").partition(" CMD ")
        assert command, "HEALTHCHECK must run a command"
        value = json.loads(command)
        assert isinstance(value, list)
        return value


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions by stage, with continuation lines joined and ``${ARG}`` in FROM resolved."""
    text = path.read_text()
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].strip() + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for word, rest in instructions:
        if word == "FROM":
            image, _, name = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], rest).partition(" AS ")
            stages.append(Stage(image.strip(), name.strip() or None))
        elif not stages and word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append((word, rest))
    return Dockerfile(text, stages)


DOCKERFILE = parse_dockerfile(REPO / "Dockerfile")


def command_envvars() -> set[str]:
    """Every OUTBOX_* variable a command of ``outbox-relay`` reads."""
    return {
        param.envvar
        for command in cli_main.commands.values()
        for param in command.params
        if isinstance(param.envvar, str)
    }


# -- .dockerignore and the image's build ----------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match on "/"-separated paths, with Docker's ``**``."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


@dataclass
class DockerIgnore:
    rules: list[tuple[bool, str, re.Pattern[str]]]  # (exception, pattern, regex)

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        rules = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            pattern = line.removeprefix("!").strip().strip("/")
            rules.append((exception, pattern, _glob_regex(pattern)))
        return cls(rules)

    def excluded(self, path: str) -> bool:
        """Docker's rule: the last pattern matching the path or one of its parents decides."""
        parts = path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for exception, _, regex in self.rules:
            if any(regex.match(p) for p in prefixes):
                result = not exception
        return result

    def may_include_below(self, directory: str) -> bool:
        return any(exc and pattern.startswith(directory + "/") for exc, pattern, _ in self.rules)


def build_context(destination: Path) -> set[str]:
    """Copy what Docker would send as the build context; the relative paths copied. A symlink
    is sent as a link (``outbox/_migrations``), as Docker sends it."""
    ignore = DockerIgnore.read(REPO / ".dockerignore")
    sent: set[str] = set()
    for root, dirs, files in os.walk(REPO):
        here = Path(root).relative_to(REPO).as_posix()
        prefix = "" if here == "." else here + "/"
        links = [d for d in dirs if (Path(root) / d).is_symlink()]  # os.walk does not enter
        dirs[:] = [
            d
            for d in dirs
            if not ignore.excluded(prefix + d) or ignore.may_include_below(prefix + d)
        ]
        for name in [*files, *links]:
            rel = prefix + name
            if not ignore.excluded(rel):
                target = destination / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, target, follow_symlinks=False)
                sent.add(rel)
    return sent


@dataclass
class Image:
    """The image, as far as it can be had without Docker: the build context, the wheel built
    from it, and that wheel installed in a directory of its own."""

    context: set[str]
    wheel: Path
    site: Path

    def env(self, **deployment: str) -> dict[str, str]:
        """The image's ENV, then what the deployment sets, in a clean environment whose Python
        imports the wheel (PYTHONPATH comes before the checkout's editable install)."""
        env = {k: v for k, v in clean_env().items() if not k.startswith(("AWS_", "PYTHON"))}
        env.update(DOCKERFILE.runtime.env())
        env["PATH"] = os.pathsep.join([str(self.site / "bin"), str(VENV_BIN), "/usr/bin", "/bin"])
        env["PYTHONPATH"] = str(self.site)
        env.update(deployment)
        return env

    def run(
        self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Image:
    root = tmp_path_factory.mktemp("image")
    context = build_context(root / "context")
    wheels, site = root / "wheels", root / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), root / "context"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("sqlalchemy_outbox-*.whl")
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    return Image(context, wheel, site)


# -- SES (moto's server) ------------------------------------------------------------------------


@pytest.fixture
def moto(moto: MotoSes) -> MotoSes:
    """The suite's ``moto`` (emptied), the sender verified in the examples' region too."""
    moto.verify(SENDER, region=REGION)
    return moto


def ses_env(
    moto: MotoSes, *, region_variables: tuple[str, ...] = ("AWS_REGION", "AWS_DEFAULT_REGION")
) -> dict[str, str]:
    """What a deployment gives the relay to reach SES, pointed at moto: the region in
    ``region_variables`` only."""
    regions = {"AWS_REGION", "AWS_DEFAULT_REGION"} - set(region_variables)
    return {k: v for k, v in aws_env(moto.url, region=REGION).items() if k not in regions}


# -- helpers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'shop.db'}"


def migrate(url: str) -> None:
    engine = sa.create_engine(url)
    migrations.upgrade(engine)
    engine.dispose()


def enqueue(url: str, count: int) -> list[int]:
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    ob, Sessions, ids = Outbox(), sessionmaker(engine), []
    with Sessions.begin() as session:
        for n in range(count):
            email = Email(
                sender=f"Shop <{SENDER}>",
                to=[f"c{n}@example.com"],
                subject=f"Order {n}",
                text=f"Thanks for order {n}.",
            )
            ids.append(ob.enqueue(session, email, key=f"deploy:{n}").id)
    engine.dispose()
    return ids


def message_rows(url: str) -> dict[int, Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return {row.id: row for row in conn.execute(sa.select(messages))}
    finally:
        engine.dispose()


def seconds(duration: str | int | float) -> float:
    """A compose duration ("1m30s", "60s", "45") in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s)?", duration)
    assert duration, "empty duration"
    assert parts, f"not a duration: {duration!r}"
    h, m, s = parts.groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str | None) -> str | None:
    """Compose's ``${NAME:-default}`` with nothing set in the shell."""
    if value is None:
        return None
    return re.sub(r"\$\{\w+:-([^}]*)\}", lambda m: m[1], str(value))


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as compose passes it when the shell sets nothing."""
    env = {k: interpolate(v) for k, v in (service.get("environment") or {}).items()}
    return {k: v for k, v in env.items() if v is not None}


def k8s_deployment() -> dict[str, Any]:
    (deployment,) = (
        doc
        for doc in yaml.safe_load_all((DEPLOY / "k8s-sidecar.yaml").read_text())
        if doc and doc.get("kind") == "Deployment"
    )
    return deployment


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def drain_seconds(env: dict[str, str]) -> float:
    return float(
        env.get("OUTBOX_DRAIN_SECONDS") or DOCKERFILE.runtime.env()["OUTBOX_DRAIN_SECONDS"]
    )


# -- the Dockerfile, read ---------------------------------------------------------------------


def test_the_dockerfile_builds_a_slim_wheel_image_that_runs_the_relay_as_a_fixed_non_root_user():
    stages = DOCKERFILE.stages
    assert len(stages) >= 2, "multi-stage: build the wheel in one stage, run it in another"
    assert {s.image for s in stages} == {"python:3.11-slim"}
    build, runtime = stages[0], DOCKERFILE.runtime
    assert build.name is not None
    wheel = " ".join(build.all("RUN"))
    assert "pip wheel --no-index --no-deps --no-build-isolation" in wheel
    install = " ".join(runtime.all("RUN"))
    assert f"from={build.name}" in install
    assert '"sqlalchemy-outbox[ses,postgres,mysql]"' in install
    assert "--no-index" in install  # only the wheels built in the first stage

    user = runtime.last("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), f"USER {user}: a fixed numeric uid"
    assert int(uid) >= 1000, f"USER {user}: not root, nor a system account"
    assert gid.isdigit()
    assert int(gid) != 0
    assert f"--uid {uid}" in install

    assert DOCKERFILE.entrypoint == ["outbox-relay"]
    assert DOCKERFILE.cmd == ["run"]
    assert runtime.last("STOPSIGNAL") == "SIGTERM"
    env = runtime.env()
    assert runtime.last("EXPOSE") == env["OUTBOX_HTTP_PORT"] == "8080"
    assert float(env["OUTBOX_DRAIN_SECONDS"]) >= 20.0  # the default --send-timeout


def _base_guard() -> str:
    """The build stage's RUN that checks the base image's pin, as the shell runs it."""
    (guard,) = [run for run in DOCKERFILE.stages[0].all("RUN") if "@sha256:" in run]
    return guard


@pytest.mark.parametrize(
    ("image", "allow", "refused"),
    [
        ("python:3.11-slim", "", True),
        ("docker.io/library/python:3.11-slim", "", True),
        ("python:3.11-slim@sha256:" + "0" * 64, "", False),
        ("python@sha256:" + "ab" * 32, "", False),
        ("python:3.11-slim", "1", False),  # a local try, said out loud
        ("python:3.11-slim", "0", True),  # any other value is no
        ("python:3.11-slim", "false", True),
    ],
)
def test_the_build_refuses_a_base_image_not_pinned_by_digest(image, allow, refused):
    assert DOCKERFILE.stages[0].image == "python:3.11-slim"  # the ARG's default: a bare tag
    ran = subprocess.run(
        ["sh", "-c", _base_guard()],
        env={"PATH": "/usr/bin:/bin", "PYTHON_IMAGE": image, "ALLOW_UNPINNED_BASE": allow},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert (ran.returncode != 0) is refused, ran.stderr
    if refused:
        (line,) = ran.stderr.splitlines()
        assert f"PYTHON_IMAGE={image} is not pinned by digest" in line
        assert "ALLOW_UNPINNED_BASE=1" in line


def _locked() -> dict[str, tuple[str, list[str]]]:
    """image-requirements.txt: name -> (pinned version, sha256 hashes)."""
    from packaging.utils import canonicalize_name

    text = (REPO / "image-requirements.txt").read_text()
    logical = re.sub(r"\\\n", " ", re.sub(r"(?m)^\s*#.*\n", "", text))
    locked = {}
    for line in logical.splitlines():
        if not line.strip():
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep, f"{requirement}: every line pins one version"
        assert version, requirement
        hashes = [o.removeprefix("--hash=sha256:") for o in options]
        assert hashes, line
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
        locked[canonicalize_name(name)] = (version, hashes)
    return locked


def test_the_image_installs_only_locked_files_checked_against_their_hashes():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    locked = _locked()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [
        *project["project"]["dependencies"],
        *(
            r
            for extra in ("ses", "postgres", "mysql")
            for r in project["project"]["optional-dependencies"][extra]
        ),
        *project["build-system"]["requires"],
    ]
    for spec in wanted:
        requirement = Requirement(spec)
        assert requirement.marker is None or requirement.marker.evaluate()
        name = canonicalize_name(requirement.name)
        if name == "sqlalchemy-outbox":
            continue
        assert name in locked, f"{spec} is not in image-requirements.txt: regenerate it"
        version, _ = locked[name]
        assert requirement.specifier.contains(version, prereleases=True), (spec, version)

    build, runtime = DOCKERFILE.stages[0], DOCKERFILE.runtime
    assert "image-requirements.txt" in " ".join(build.all("COPY"))
    fetches = [run for run in build.all("RUN") if "image-requirements.txt" in run]
    assert fetches
    for run in fetches:
        for pip in re.split(r"&&", run):
            assert "--require-hashes" in pip, pip
    download = next(run for run in fetches if "pip download" in run)
    assert "--only-binary=:all:" in download  # no sdist runs code at build time
    # the runtime stage reaches no index: only the build stage's checked wheels
    assert all("--no-index" in run for run in runtime.all("RUN") if "pip install" in run)


def test_the_image_is_configured_only_through_documented_outbox_variables():
    env = DOCKERFILE.runtime.env()
    readable = command_envvars()
    relay_settings = {name for name in env if not name.startswith(("PIP_", "PYTHON"))}
    assert relay_settings, "the image sets its relay defaults through ENV"
    assert all(name in readable for name in relay_settings), relay_settings - readable
    assert not {n for n in env if re.search("PASSWORD|SECRET|DATABASE_URL|AWS_", n)}
    # the comments name only variables that exist, and name the ones a deployment must know
    named = set(re.findall(r"\bOUTBOX_[A-Z_]*[A-Z]\b", DOCKERFILE.text))
    assert named <= readable, named - readable
    assert {
        "OUTBOX_DATABASE_URL",
        "OUTBOX_SENDER",
        "OUTBOX_HTTP_PORT",
        "OUTBOX_DRAIN_SECONDS",
    } <= named


def test_dockerignore_keeps_tests_venvs_and_caches_out_and_the_wheel_ships_the_migrations(image):
    build = DOCKERFILE.stages[0]
    for copy in build.all("COPY"):
        *sources, _destination = copy.split()
        for source in sources:
            assert any(p == source or p.startswith(source + "/") for p in image.context), source
    assert "migrations/versions/0001_outbox_initial.py" in image.context
    assert "outbox/_migrations" in image.context  # the symlink to migrations/, as a link
    for path in image.context:
        top = path.split("/", 1)[0]
        assert top in {
            "pyproject.toml",
            "image-requirements.txt",
            "README.md",
            "LICENSE",
            "outbox",
            "migrations",
            "relay",
        }, path
        assert "__pycache__" not in path
        assert not path.endswith((".pyc", ".pyo"))

    ignore = DockerIgnore.read(REPO / ".dockerignore")  # paths this checkout may not have now
    for path in (
        "tests/conftest.py",
        ".venv/bin/python",
        ".venv-ci/bin/python",
        ".git/HEAD",
        "examples/deploy/compose.yaml",
        "outbox/__pycache__/enqueue.cpython-311.pyc",
        "relay/senders/__pycache__/ses.cpython-311.pyc",
        "migrations/versions/__pycache__/x.cpython-311.pyc",
        "relay/.mypy_cache/3.11/relay.json",
        ".pytest_cache/v/cache/lastfailed",
        ".hypothesis/examples/x",
        "build/lib/relay/cli.py",
        "dist/sqlalchemy_outbox-0.1.0-py3-none-any.whl",
        "shop.db",
    ):
        assert ignore.excluded(path), path
    assert not ignore.excluded("relay/senders/ses.py")

    names = set(zipfile.ZipFile(image.wheel).namelist())
    assert "outbox/_migrations/versions/0001_outbox_initial.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the MIT text ships"
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "outbox-relay = relay.cli:main" in zipfile.ZipFile(image.wheel).read(entry_points).decode()
    )
    probe = image.run(
        ["python", "-c", "import outbox, relay; print(outbox.__file__, relay.__file__)"],
        image.env(),
        REPO.parent,
    )
    assert probe.returncode == 0, probe.stderr
    assert all(Path(p).is_relative_to(image.site) for p in probe.stdout.split())


# -- the image's commands, run ------------------------------------------------------------------


def test_the_init_step_then_the_image_command_deliver_through_ses(image, moto, tmp_path):
    url = sqlite_url(tmp_path)
    env = image.env(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_EXIT_WHEN_IDLE="1",  # the test's addition: drain the backlog, then exit
        OUTBOX_HTTP_PORT=str(free_port()),
        OUTBOX_POLL_INTERVAL="0.2",
        **ses_env(moto),
    )
    migrate = image.run([*DOCKERFILE.entrypoint, "migrate"], env, tmp_path)
    assert migrate.returncode == 0, migrate.stderr
    assert "up to date" in migrate.stdout
    ids = enqueue(url, 5)

    relay = image.run([*DOCKERFILE.entrypoint, *DOCKERFILE.cmd], env, tmp_path)
    assert relay.returncode == 0, relay.stderr[-4000:]

    sent = moto.messages()
    assert sorted(m["destinations"]["ToAddresses"][0] for m in sent) == sorted(
        f"c{n}@example.com" for n in range(5)
    )
    rows = message_rows(url)
    assert {rows[i].status for i in ids} == {"sent"}
    assert {rows[i].provider_message_id for i in ids} == {m["id"] for m in sent}


def test_the_image_takes_the_ses_region_from_AWS_REGION_alone(image, moto, tmp_path):
    """The contract (docs/design.md, "The contract") and the relay's own error message name
    AWS_REGION; boto3 reads only AWS_DEFAULT_REGION. Fails until build_client reads AWS_REGION
    too."""
    url = sqlite_url(tmp_path)
    migrate(url)
    enqueue(url, 1)
    env = image.env(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_EXIT_WHEN_IDLE="1",
        OUTBOX_HTTP_PORT=str(free_port()),
        **ses_env(moto, region_variables=("AWS_REGION",)),
    )
    relay = image.run([*DOCKERFILE.entrypoint, *DOCKERFILE.cmd], env, tmp_path)
    assert relay.returncode == 0, relay.stderr[-2000:]
    assert len(moto.messages()) == 1


def test_the_healthcheck_passes_while_the_relay_runs_and_fails_once_it_stopped(
    image, moto, tmp_path
):
    """Runs the HEALTHCHECK's own command against ``--http-port`` (OUTBOX_HTTP_PORT)."""
    assert (
        "--http-port" in image.run(["outbox-relay", "run", "--help"], image.env(), tmp_path).stdout
    )
    url = sqlite_url(tmp_path)
    migrate(url)
    env = image.env(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_HTTP_PORT=str(free_port()),
        OUTBOX_POLL_INTERVAL="0.2",
        **ses_env(moto),
    )
    healthcheck = DOCKERFILE.healthcheck
    assert healthcheck[0] == "python"  # no curl in slim images
    assert "/healthz" in healthcheck[-1]

    def healthy() -> bool:
        return image.run(healthcheck, env, tmp_path, timeout=30).returncode == 0

    assert not healthy()  # nothing listens yet
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*DOCKERFILE.entrypoint, *DOCKERFILE.cmd],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_for(
            lambda: healthy() or proc.poll() is not None,
            timeout=30,
            what="the HEALTHCHECK to pass",
            interval=0.2,
        )
        assert proc.poll() is None, log.read_text()[-4000:]
        proc.send_signal(getattr(signal, DOCKERFILE.runtime.last("STOPSIGNAL")))
        assert proc.wait(drain_seconds({}) + 10) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not healthy()


# -- compose -------------------------------------------------------------------------------------


def test_compose_migrates_first_and_stops_the_relay_with_time_to_drain():
    services = compose()["services"]
    relay, migrate, grants, app = (services[n] for n in ("relay", "migrate", "grants", "app"))
    for service in (relay, migrate, app):  # the image of this Dockerfile
        assert (DEPLOY / service["build"]["context"]).resolve() == REPO
        assert service["build"]["dockerfile"] == "Dockerfile"
        assert service["image"] == relay["image"]
    assert migrate["command"] == ["migrate"]
    assert migrate["restart"] == "no"
    assert relay.get("command", DOCKERFILE.cmd) == DOCKERFILE.cmd
    assert relay["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert relay["depends_on"]["grants"]["condition"] == "service_completed_successfully"
    assert grants["depends_on"]["migrate"]["condition"] == "service_completed_successfully"

    env = compose_env(relay)
    drain = drain_seconds(env)
    assert drain >= float(env.get("OUTBOX_SEND_TIMEOUT", "20"))
    assert seconds(relay["stop_grace_period"]) >= drain + 10
    assert relay["read_only"] is True
    assert env["AWS_REGION"], "a region the relay reads"
    assert env.get("AWS_DEFAULT_REGION", env["AWS_REGION"]) == env["AWS_REGION"]

    # every service connects as the role made for it: owner migrates, grants creates the rest
    owner = services["db"]["environment"]["POSTGRES_USER"]
    psql = dict(arg.split("=", 1) for arg in grants["command"] if "=" in arg and "://" not in arg)
    assert sa.make_url(compose_env(migrate)["OUTBOX_DATABASE_URL"]).username == owner
    assert grants["environment"]["PGUSER"] == owner
    relay_url = sa.make_url(env["OUTBOX_DATABASE_URL"])
    app_url = sa.make_url(compose_env(app)["APP_DATABASE_URL"])
    assert (relay_url.username, relay_url.password) == (psql["relay_role"], psql["relay_password"])
    assert (app_url.username, app_url.password) == (psql["app_role"], psql["app_password"])
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grants["volumes"]}
    assert (DEPLOY / mounted[grants["command"][-1]]).resolve() == DEPLOY / "grants-postgresql.sql"


def test_the_compose_services_deliver_the_apps_mail_on_sqlite(image, tmp_path):
    """migrate, then the app stand-in, then the relay, each as compose runs it, on SQLite
    instead of PostgreSQL (so without the grants step) and with the fake sender."""
    services = compose()["services"]
    url = sqlite_url(tmp_path)

    migrate = services["migrate"]
    env = image.env(**{**compose_env(migrate), "OUTBOX_DATABASE_URL": url})
    done = image.run([*DOCKERFILE.entrypoint, *migrate["command"]], env, tmp_path)
    assert done.returncode == 0, done.stderr

    app = services["app"]
    mounts = {v.split(":")[1]: DEPLOY / v.split(":")[0] for v in app["volumes"]}
    argv = [str(mounts.get(arg, arg)) for arg in [*app["entrypoint"], *app["command"]]]
    env = image.env(
        **{
            **compose_env(app),
            "APP_DATABASE_URL": url,
            "APP_ORDERS": "3",
            "APP_ORDER_INTERVAL": "0",
        }
    )
    done = image.run(argv, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"^order \w+ committed with email \d+$", done.stdout, re.M)) == 3

    relay = services["relay"]
    record = tmp_path / "sent.log"
    env = image.env(
        **{
            **compose_env(relay),
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_SENDER": FAKE_SENDER,
            "OUTBOX_HTTP_PORT": str(free_port()),
            "OUTBOX_EXIT_WHEN_IDLE": "1",
            "OUTBOX_FAKE_RECORD_FILE": str(record),
        }
    )
    done = image.run([*DOCKERFILE.entrypoint, *relay["command"]], env, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    deliveries = read_deliveries(record)
    assert len(deliveries) == 3
    assert set(deliveries.values()) == {1}
    rows = message_rows(url)
    assert {r.status for r in rows.values()} == {"sent"}
    assert all(r.idempotency_key.startswith("order-confirmation:") for r in rows.values())


# -- Kubernetes ----------------------------------------------------------------------------------


def relay_and_migrate(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    init = pod["initContainers"]
    (migrate,) = (c for c in init if c.get("args") == ["migrate"])
    (relay,) = (c for c in init if c.get("restartPolicy") == "Always")
    return relay, migrate


def test_k8s_the_grace_period_covers_the_app_stopping_then_the_relay_draining():
    pod = k8s_deployment()["spec"]["template"]["spec"]
    relay, migrate = relay_and_migrate(pod)
    init_names = [c["name"] for c in pod["initContainers"]]
    assert init_names.index(migrate["name"]) < init_names.index(relay["name"])

    env = literal_env(relay)
    drain = drain_seconds(env)
    assert drain >= float(env.get("OUTBOX_SEND_TIMEOUT", "20"))
    pre_stop = 0.0
    for container in [*pod["containers"], relay]:
        hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        if hook:
            assert hook["command"][0] == "sleep"
            pre_stop += float(hook["command"][1])
    assert "lifecycle" not in relay  # the relay drains on SIGTERM itself
    # native sidecar: the app's preStop and shutdown come first, then the relay's drain
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10


def test_k8s_probes_security_and_secrets_of_the_relay_sidecar():
    pod = k8s_deployment()["spec"]["template"]["spec"]
    relay, migrate = relay_and_migrate(pod)
    assert relay["image"] == migrate["image"]
    assert relay.get("args", DOCKERFILE.cmd) == DOCKERFILE.cmd
    assert "command" not in relay  # the image's ENTRYPOINT
    assert "command" not in migrate

    env = literal_env(relay)
    port = int(env.get("OUTBOX_HTTP_PORT") or DOCKERFILE.runtime.env()["OUTBOX_HTTP_PORT"])
    (named,) = relay["ports"]
    assert named["containerPort"] == port
    assert relay["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": named["name"]}
    # A native sidecar's readiness gates the pod's Ready (a paused SES account would take
    # every app pod out of its Service) and its startup probe holds back the app's start.
    assert "readinessProbe" not in relay
    assert "startupProbe" not in relay

    uid, _, gid = DOCKERFILE.runtime.last("USER").partition(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False  # no Kubernetes API token to steal
    mounts_tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for container in (relay, migrate, *pod["containers"]):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"]
        assert container["resources"]["limits"]["memory"]
    for container in (relay, migrate):
        assert (
            container["securityContext"]["runAsUser"],
            container["securityContext"]["runAsGroup"],
        ) == (
            int(uid),
            int(gid),
        )
    assert {m["name"] for m in relay["volumeMounts"] if m["mountPath"] == "/tmp"} <= mounts_tmp

    secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for c in (relay, migrate)
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {"OUTBOX_DATABASE_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret)
    assert secret["AWS_ACCESS_KEY_ID"].get("optional") is True  # IRSA / Pod Identity instead
    urls = {
        c["name"]: next(e for e in c["env"] if e["name"] == "OUTBOX_DATABASE_URL")
        for c in (relay, migrate)
    }
    assert (
        urls[relay["name"]]["valueFrom"]["secretKeyRef"]["key"]
        != urls[migrate["name"]]["valueFrom"]["secretKeyRef"]["key"]
    ), "the relay connects with its own role, not the schema owner's"
    for value in literal_env(relay).values():
        assert "://" not in value
        assert "secret" not in value.lower()
    assert env["AWS_REGION"], "a region the relay reads"
    assert env.get("AWS_DEFAULT_REGION", env["AWS_REGION"]) == env["AWS_REGION"]


def test_k8s_a_network_policy_keeps_the_relays_port_to_monitoring():
    """The relay's port (metrics, readiness) is not for every pod of the cluster."""
    deployment = k8s_deployment()
    (policy,) = (
        doc
        for doc in yaml.safe_load_all((DEPLOY / "k8s-sidecar.yaml").read_text())
        if doc and doc.get("kind") == "NetworkPolicy"
    )
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    pod = deployment["spec"]["template"]["spec"]
    relay, _ = relay_and_migrate(pod)
    relay_port = relay["ports"][0]["containerPort"]
    rules = policy["spec"]["ingress"]
    for rule in rules:
        ports = {p["port"] for p in rule["ports"]}
        if relay_port in ports:
            (peer,) = rule["from"]  # only from the monitoring namespace
            assert "namespaceSelector" in peer
    assert any(relay_port in {p["port"] for p in r["ports"]} for r in rules)
    app_ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert app_ports <= {p["port"] for r in rules if "from" not in r for p in r["ports"]}


def test_k8s_the_relay_settings_of_the_manifest_start_a_relay(image, moto, tmp_path):
    """The sidecar's literal env (secrets and the pod name filled in) is accepted as it is."""
    pod = k8s_deployment()["spec"]["template"]["spec"]
    relay, _ = relay_and_migrate(pod)
    url = sqlite_url(tmp_path)
    migrate(url)
    enqueue(url, 2)
    ses = {k: v for k, v in ses_env(moto).items() if k not in ("AWS_REGION", "AWS_DEFAULT_REGION")}
    env = image.env(
        **{
            **literal_env(relay),  # its region included
            **ses,  # the keys from the Secret, and the endpoint of moto
            "OUTBOX_DATABASE_URL": url,  # from the Secret
            "OUTBOX_RELAY_ID": "shop-5d9c7b6f4-x2x7q",  # the pod's name
            "OUTBOX_EXIT_WHEN_IDLE": "1",
            "OUTBOX_HTTP_PORT": str(free_port()),
        }
    )
    done = image.run([*DOCKERFILE.entrypoint, *relay.get("args", DOCKERFILE.cmd)], env, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(moto.messages()) == 2
    rows = message_rows(url)
    assert {r.claimed_by for r in rows.values()} == {"shop-5d9c7b6f4-x2x7q"}
    assert Counter(r.status for r in rows.values()) == {"sent": 2}


# -- the region, said the same way everywhere ------------------------------------------------

REGION_TEXTS = [
    "README.md",
    "docs/configuration.md",
    "docs/design.md",
    "docs/guides/ses.md",  # the README's SES section moved here
    "Dockerfile",
    "docs/guides/deploy.md",  # was examples/deploy/README.md
    "examples/deploy/compose.yaml",
    "examples/deploy/k8s-sidecar.yaml",
]
# what the relay does not do: read only one of the two, or need both
WRONG_REGION_CLAIMS = [
    r"boto3 reads (only )?(the region from )?\W*AWS_DEFAULT_REGION",
    r"the one boto3 reads",
    r"not\W+AWS_REGION",
    r"set both",
]


@pytest.mark.parametrize("path", REGION_TEXTS)
def test_every_text_says_the_relay_reads_either_region_variable(path):
    text = " ".join((REPO / path).read_text().split())
    for claim in WRONG_REGION_CLAIMS:
        assert not re.search(claim, text, flags=re.I), f"{path}: {claim}"
    assert "AWS_REGION" in text, f"{path} names no region variable"
    if "AWS_DEFAULT_REGION" in text and path.endswith((".md", "Dockerfile")):
        assert re.search(r"AWS_DEFAULT_REGION\W+wins", text), f"{path}: which wins is unsaid"


@pytest.mark.parametrize(
    ("variables", "region"),
    [
        ({"AWS_REGION": "eu-west-1"}, "eu-west-1"),
        ({"AWS_DEFAULT_REGION": "eu-west-2"}, "eu-west-2"),
        ({"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-west-2"}, "eu-west-2"),
    ],
    ids=["AWS_REGION", "AWS_DEFAULT_REGION", "both-differ"],
)
def test_the_ses_client_takes_the_region_as_the_texts_say(variables, region, monkeypatch):
    from relay.senders.ses import build_client

    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    client = build_client(send_timeout=5.0, concurrency=1)
    assert client.meta.region_name == region
