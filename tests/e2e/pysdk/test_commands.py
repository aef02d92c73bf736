"""Commands with the official Python SDK, sync and async: a command's
timeout is the SDK's TimeoutException and ends the command in the guest
(upstream envd ties the process to the timeout); a watch's timeout reaches
its on_exit as that error."""
import asyncio
import time

import pytest
from e2b import CommandExitException, TimeoutException


def test_run_output_and_exit_code(sandbox):
    r = sandbox.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("exit 3")
    assert e.value.exit_code == 3


def still_running(sbx, marker):
    # "[s]leep ..." matches the command but not this shell's own command line.
    r = sbx.commands.run(f"pgrep -f '[{marker[0]}]{marker[1:]}' >/dev/null && echo yes || echo no")
    return r.stdout.strip() == "yes"


def test_command_timeout_raises_and_kills_the_command(sandbox):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 31.5; touch /tmp/never", timeout=2)
    assert time.monotonic() - start < 20
    deadline = time.monotonic() + 10
    while still_running(sandbox, "sleep 31.5"):
        assert time.monotonic() < deadline, "the command outlived its timeout"
        time.sleep(0.2)


def test_background_command_outlives_its_handle(sandbox):
    h = sandbox.commands.run("sleep 32.5", background=True)
    h.disconnect()
    time.sleep(0.5)
    assert still_running(sandbox, "sleep 32.5")
    h2 = sandbox.commands.connect(h.pid)
    h2.kill()


@pytest.mark.asyncio
async def test_async_command_timeout(async_sandbox):
    with pytest.raises(TimeoutException):
        await async_sandbox.commands.run("sleep 33.5", timeout=2)
    for _ in range(50):
        r = await async_sandbox.commands.run("pgrep -f '[s]leep 33.5' >/dev/null && echo yes || echo no")
        if r.stdout.strip() == "no":
            break
        await asyncio.sleep(0.2)
    else:
        pytest.fail("the command outlived its timeout")


@pytest.mark.asyncio
async def test_async_watch_timeout_reaches_on_exit(async_sandbox):
    ended = asyncio.get_running_loop().create_future()
    await async_sandbox.files.make_dir("/tmp/watched")
    await async_sandbox.files.watch_dir(
        "/tmp/watched", on_event=lambda e: None, on_exit=lambda err: ended.set_result(err), timeout=2
    )
    err = await asyncio.wait_for(ended, 20)
    assert isinstance(err, TimeoutException), f"on_exit got {err!r}"


def test_base_has_what_e2b_base_has(sandbox):
    """Code ported from E2B finds python, pip, node and npm in base (issue
    40, gap 10), and `pip install` works for the sandbox's user (a wheel
    from a file: the tests reach nothing but this machine)."""
    import io
    import zipfile

    for cmd, want in [("python --version", "Python 3"), ("pip --version", "pip "), ("node --version", "v"), ("npm --version", "")]:
        r = sandbox.commands.run(cmd)
        assert r.exit_code == 0 and (r.stdout + r.stderr).startswith(want), (cmd, r)
    whl = io.BytesIO()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("aenvprobe/__init__.py", "VALUE = 42\n")
        z.writestr("aenvprobe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: aenvprobe\nVersion: 1.0\n")
        z.writestr("aenvprobe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: aenv-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("aenvprobe-1.0.dist-info/RECORD", "")
    sandbox.files.write("/tmp/aenvprobe-1.0-py3-none-any.whl", whl.getvalue())
    r = sandbox.commands.run("pip install --no-index /tmp/aenvprobe-1.0-py3-none-any.whl && python -c 'import aenvprobe; print(aenvprobe.VALUE)'")
    assert r.stdout.strip().endswith("42"), r
