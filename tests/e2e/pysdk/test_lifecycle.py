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


SERVE_HOST = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get("Host", "") + "|" + self.headers.get("X-Forwarded-Host", "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def test_mask_request_host():
    """network.mask_request_host (issue 40, gap 7): the sandbox's ports see
    that Host, ${PORT} replaced, and the client's in X-Forwarded-Host."""
    import os
    import time

    import httpx

    sbx = Sandbox.create(TEMPLATE, timeout=120, network={"mask_request_host": "app.internal:${PORT}"})
    try:
        sbx.files.write("/tmp/serve_host.py", SERVE_HOST)
        sbx.commands.run("python3 /tmp/serve_host.py", background=True)
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
        for _ in range(100):
            r = httpx.get(os.environ["E2B_SANDBOX_URL"], headers=headers)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        host, forwarded = r.text.split("|")
        assert r.status_code == 200 and host == "app.internal:8000", r.text
        assert forwarded, r.text
    finally:
        sbx.kill()


def test_mcp_without_a_gateway_in_the_template():
    """mcp at create (issue 40, gap 6) is taken by the API and left to the
    SDK, as E2B's is: the SDK starts the template's mcp-gateway, and a
    template without one ends in the SDK's own error, the sandbox killed."""
    import os

    from e2b import SandboxException, SandboxQuery

    tag = f"pymcp-{os.getpid()}"
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": tag}, mcp={"exa": {"apiKey": "not-used"}})
    left = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
    assert left == [], left
