"""Tests that run in a child pytest process started when the collection ends, beside the rest of the
suite (a second CPU core is otherwise idle while the suite runs): compilations that must not share the
suite's process, and tests whose time goes to processes they start or to compiling.

``in_child_process`` marks such a test; ``tests/conftest.py`` starts one child for all of the session's,
which runs them in the session's order, and each test reports its own result from the child's report when
its turn comes in the suite. A crash fails the test that was running, and the tests after it run in a new
child.
"""

import atexit
import functools
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


class _Child:
    """A child pytest process running ``nodes`` in that order, its reports read as they are written."""

    def __init__(self, nodes: list[str]):
        self.nodes = nodes
        self.tmp = tempfile.TemporaryDirectory()
        self.reports = Path(self.tmp.name) / "reports.jsonl"
        self.output = open(Path(self.tmp.name) / "output.txt", "w+")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", __name__,
                   "--basetemp", str(Path(self.tmp.name) / "tmp"), *nodes]  # fmt: skip
        env = {**os.environ, _CHILD: "1", _REPORTS: str(self.reports)}
        self.process = subprocess.Popen(command, env=env, cwd=_ROOT, stdout=self.output,
                                        stderr=subprocess.STDOUT)  # fmt: skip
        self.read = 0  # lines of the reports already taken
        self.phases: dict[str, list[tuple[str, str]]] = {}

    def poll(self) -> dict[str, tuple[str, str]]:
        """The outcome and report of each test whose teardown the child has written since the last call: its
        first phase that did not pass, else passed."""
        text = self.reports.read_text() if self.reports.exists() else ""
        finished = {}
        for line in text.split("\n")[self.read : -1]:  # the last: empty, or a line being written
            self.read += 1
            entry = json.loads(line)
            self.phases.setdefault(entry["node"], []).append((entry["outcome"], entry["report"]))
            if entry["when"] == "teardown":
                phases = self.phases.pop(entry["node"])
                finished[entry["node"]] = next((p for p in phases if p[0] != "passed"), ("passed", ""))
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
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.child: _Child | None = None
        atexit.register(self.stop)

    def start(self, nodes: list[str]) -> None:
        nodes = [n for n in nodes if n not in self.outcomes]
        if nodes:
            self.child = _Child(nodes)

    def outcome(self, node: str) -> tuple[str, str]:
        if node not in self.outcomes and (self.child is None or node not in self.child.nodes):
            self.stop()
            self.start([node])
        while node not in self.outcomes:
            child = self.child
            ended = child.process.poll() is not None
            self.outcomes.update(child.poll())
            if ended:
                rest = [n for n in child.nodes if n not in self.outcomes]
                if rest:  # the child ended inside rest[0] (it runs the tests in the order given)
                    report = f"the child process ended (status {child.process.returncode}) in this test\n"
                    self.outcomes[rest[0]] = ("crashed", report + child.tail())
                child.close()
                self.child = None
                self.start(rest[1:])
            elif node not in self.outcomes:
                time.sleep(0.05)
        return self.outcomes[node]

    def stop(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None


_runner = _Runner()


def start(items) -> None:
    """Starts the child for the session's tests marked ``in_child_process`` among ``items``."""
    nodes = [item.nodeid for item in items if getattr(getattr(item, "function", None), "in_child_process", 0)]
    if nodes and not os.environ.get(_CHILD):
        _runner.stop()
        _runner.start(nodes)


def stop() -> None:
    _runner.stop()


def in_child_process(test):
    """Runs the decorated test in the session's child process (see the module's docstring)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(_CHILD):
            return test(*args, **kwargs)
        outcome, report = _runner.outcome(os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0])
        if outcome == "skipped":
            pytest.skip(report)
        assert outcome == "passed", report

    wrapper.in_child_process = True
    return wrapper


def pytest_runtest_logreport(report):
    """In the child (loaded with ``-p``): each test's outcome, written as it finishes."""
    path = os.environ.get(_REPORTS)
    if not path:
        return
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]  # (file, line, reason)
    else:
        text = f"{report.when} {report.outcome}:\n{report.longreprtext}"
    line = json.dumps({"node": report.nodeid, "when": report.when, "outcome": report.outcome, "report": text})
    with open(path, "a") as f:
        f.write(line + "\n")


