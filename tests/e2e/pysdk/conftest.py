"""Shared setup of the Python SDK compatibility tests.

The Go harness (tests/e2e/pysdk_test.go) starts `aenv server` and runs
pytest here with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing the
official, unmodified SDKs (requirements.txt) at it.
"""
import os

import httpx
import pytest
import pytest_asyncio

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")


def pytest_configure(config):
    for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        if not os.environ.get(var):
            raise pytest.UsageError(f"{var} is not set: run these tests through `go test ./tests/e2e`")


@pytest.fixture
def api():
    """A plain HTTP client of the server's REST API, for what the SDK will not send."""
    with httpx.Client(
        base_url=os.environ["E2B_API_URL"],
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
        timeout=60,
    ) as c:
        yield c


@pytest.fixture
def sandbox():
    """A sandbox of the test template, killed afterwards whatever happens."""
    from e2b import Sandbox

    sbx = Sandbox.create(TEMPLATE, timeout=300)
    try:
        yield sbx
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


@pytest_asyncio.fixture
async def async_sandbox():
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(TEMPLATE, timeout=300)
    try:
        yield sbx
    finally:
        try:
            await sbx.kill()
        except Exception:
            pass
