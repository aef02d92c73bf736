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


def test_killed_sandbox_is_not_running():
    """After a kill, envd calls through the proxy raise the SDK's
    SandboxNotRunningException (issue 40, gap 8: the proxy's 502 says "The
    sandbox was not found", the words the SDK maps), and a command streaming
    when its sandbox is killed ends with a sandbox error, not a hang."""
    from e2b import SandboxException, SandboxNotRunningException

    sbx = Sandbox.create(TEMPLATE, timeout=120)
    handle = sbx.commands.run("sleep 600", background=True)
    sbx.kill()
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        sbx.files.read("/etc/hostname")
    with pytest.raises(SandboxException):
        handle.wait()
