"""Tests that run in a child pytest process started when the collection ends, beside the rest of the
suite (a second CPU core is otherwise idle while the suite runs): compilations that must not share the
suite's process, tests whose time goes to processes they start or to compiling, and whole modules of
CPU-heavy tests that share nothing with the rest (to balance the two cores). The kernels' own compile checks
run each in a process of its own instead (``tests/kernels/compiled.py``).

``in_child_process`` is a marker: it marks a test (``@in_child_process``), a class, or a whole module
(``pytestmark = in_child_process``, or in a list beside other marks). GPU tests (``@pytest.mark.gpu``) stay
in the suite's process whatever their marks. ``tests/conftest.py`` calls ``start`` when the collection ends:
the marked tests that were collected (after ``-m``, ``-k`` and the paths given) move to the end of the
run's order, and one child process starts on them, running them in that order. The suite runs its own tests
meanwhile and then, for each marked test, waits for the child's reports on it and reports them as its own
(``runtest_protocol``): outcome, longrepr, captured output and duration, as the child wrote them. The
suite's process neither sets up the fixtures of a marked test nor runs it; the child does both. A crash of
the child fails the test that was running, and the tests after it run in a new child. The child's warnings
stay in its own output (not in the suite's summary).

What moves is chosen to end both processes together: on a 2-core CPU with the full suite, the child's tests
(test_row_steps, test_cli, test_patch, test_saved_bytes, and the marked tests elsewhere) and the suite's own
measured about 540 s of wall each (``--durations=0`` gives the child's durations too). Move more only when the
suite's process ends last by a margin: the suite waits at its end for what the child has not finished.
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

_CHILD = "CHUNKLOSS_COMPILE_TEST_CHILD"
_REPORTS = "CHUNKLOSS_COMPILE_TEST_REPORTS"  # the child appends one JSON line per test phase here
_ROOT = Path(__file__).resolve().parents[1]

in_child_process = pytest.mark.in_child_process


def _moved(item) -> bool:
    return item.get_closest_marker("in_child_process") is not None and item.get_closest_marker("gpu") is None


class _Child:
    """A child pytest process running ``nodes`` in that order, its reports read as they are written."""

    def __init__(self, nodes: list[str]):
        self.nodes = nodes
        self.tmp = tempfile.TemporaryDirectory()
        self.reports = Path(self.tmp.name) / "reports.jsonl"
        self.output = open(Path(self.tmp.name) / "output.txt", "w+")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            __name__,
            "--basetemp",
            str(Path(self.tmp.name) / "tmp"),
            *nodes,
        ]
        env = {**os.environ, _CHILD: "1", _REPORTS: str(self.reports)}
        self.process = subprocess.Popen(
            command, env=env, cwd=_ROOT, stdout=self.output, stderr=subprocess.STDOUT
        )
        self.read = 0  # lines of the reports already taken
        self.phases: dict[str, list[dict]] = {}

    def poll(self) -> dict[str, list[dict]]:
        """The serialized reports (setup, call, teardown) of each test whose teardown the child has written
        since the last call."""
        text = self.reports.read_text() if self.reports.exists() else ""
        finished = {}
        for line in text.split("\n")[self.read : -1]:  # the last: empty, or a line being written
            self.read += 1
            entry = json.loads(line)
            self.phases.setdefault(entry["nodeid"], []).append(entry)
            if entry["when"] == "teardown":
                finished[entry["nodeid"]] = self.phases.pop(entry["nodeid"])
        return finished

    def tail(self) -> str:
        self.output.seek(0)
        return self.output.read()[-4000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()
        self.tmp.cleanup()


class _Runner:
    def __init__(self):
        self.reports: dict[str, list] = {}  # node -> its reports: serialized (dicts) or TestReports
        self.child: _Child | None = None
        atexit.register(self.stop)

    def start(self, nodes: list[str]) -> None:
        nodes = [n for n in nodes if n not in self.reports]
        if nodes:
            self.child = _Child(nodes)

    def wait(self, item) -> list:
        node = item.nodeid
        if node not in self.reports and (self.child is None or node not in self.child.nodes):
            self.stop()
            self.start([node])
        while node not in self.reports:
            child = self.child
            ended = child.process.poll() is not None
            self.reports.update(child.poll())
            if ended:
                rest = [n for n in child.nodes if n not in self.reports]
                if rest:  # the child ended inside rest[0] (it runs the tests in the order given)
                    text = f"the child process ended (status {child.process.returncode}) in this test\n"
                    self.reports[rest[0]] = [_report(item, rest[0], "failed", text + child.tail())]
                child.close()
                self.child = None
                self.start(rest[1:])
            elif node not in self.reports:
                time.sleep(0.05)
        return self.reports.pop(node)

    def stop(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None


def _report(item, node: str, outcome: str, text: str) -> pytest.TestReport:
    return pytest.TestReport(node, item.location, {}, outcome, text, "call")


_runner = _Runner()


def start(items: list) -> None:
    """Moves the tests of ``items`` (the collected tests, in place) marked ``in_child_process`` to its end
    and starts the child on them."""
    if os.environ.get(_CHILD):
        return
    moved = [item for item in items if _moved(item)]
    items[:] = [item for item in items if not _moved(item)] + moved
    _runner.stop()
    _runner.start([item.nodeid for item in moved])


def stop() -> None:
    _runner.stop()


def runtest_protocol(item) -> bool | None:
    """In the suite's process: a marked test's reports, taken from the child (None for other tests)."""
    if os.environ.get(_CHILD) or not _moved(item):
        return None
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for data in _runner.wait(item):
        if isinstance(data, dict):
            if isinstance(data["longrepr"], list):  # a skip's (file, line, reason), a list once in JSON
                data["longrepr"] = tuple(data["longrepr"])
            data = item.config.hook.pytest_report_from_serializable(config=item.config, data=data)
        hook.pytest_runtest_logreport(report=data)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


_config = None


def pytest_configure(config):
    """In the child (loaded with ``-p``)."""
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """In the child: each phase's report of each test, written as it finishes."""
    path = os.environ.get(_REPORTS)
    if not path:
        return
    data = _config.hook.pytest_report_to_serializable(config=_config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps(data) + "\n")
