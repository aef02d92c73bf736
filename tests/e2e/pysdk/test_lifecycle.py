"""Sandbox lifecycle with the official Python SDK: get_info reports what a
sandbox does at its timeout."""
import pytest
from e2b import Sandbox

from conftest import TEMPLATE


@pytest.mark.parametrize("on_timeout", ["kill", "pause"])
def test_info_reports_on_timeout(on_timeout):
    sbx = Sandbox.create(TEMPLATE, timeout=120, lifecycle={"on_timeout": on_timeout})
    try:
        info = sbx.get_info()
        assert info.lifecycle is not None and info.lifecycle["on_timeout"] == on_timeout, info.lifecycle
        assert info.state.value == "running"
    finally:
        sbx.kill()
