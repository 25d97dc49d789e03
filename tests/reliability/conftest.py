"""The reliability suite runs against the same real `serve run` as the e2e tests (tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def soak(request) -> bool:
    return request.config.getoption("--soak")
