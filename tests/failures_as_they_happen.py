"""A pytest plugin for runs that a time limit may cut short (the device machine's calls): each
failure's report is printed as the test ends, not only in the summary at the session's end, which
a killed run never reaches. `bench/device.sh`'s gpu-tests stage loads it (`-p`)."""

from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n---- {report.nodeid} failed ({report.when}) ----\n{report.longreprtext}\n", flush=True)
