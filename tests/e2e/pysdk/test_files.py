"""Files with the official Python SDK, sync and async (what the JS suite's
files.test.cjs covers)."""
import time

import httpx
import pytest
from e2b import FileType, FilesystemEventType, NotFoundException

D = "/home/user/pysdk"


def test_files_sync(sandbox):
    info = sandbox.files.write(D + "/a.txt", "hello file")
    assert info.path == D + "/a.txt" and info.type == FileType.FILE
    assert sandbox.files.read(D + "/a.txt") == "hello file"
    assert bytes(sandbox.files.read(D + "/a.txt", format="bytes")) == b"hello file"
    assert sandbox.files.get_info(D + "/a.txt").owner == "user"
    assert sandbox.files.exists(D + "/a.txt") and not sandbox.files.exists(D + "/missing.txt")
    with pytest.raises(NotFoundException):
        sandbox.files.read(D + "/missing.txt")

    assert sandbox.files.make_dir(D + "/sub/deeper") is True
    assert sandbox.files.make_dir(D + "/sub/deeper") is False
    sandbox.files.write(D + "/sub/b.txt", "bb")
    entries = {e.name: e for e in sandbox.files.list(D + "/sub")}
    assert sorted(entries) == ["b.txt", "deeper"]
    assert entries["b.txt"].type == FileType.FILE and entries["b.txt"].size == 2
    assert entries["deeper"].type == FileType.DIR

    moved = sandbox.files.rename(D + "/sub/b.txt", D + "/sub/c.txt")
    assert moved.path == D + "/sub/c.txt" and sandbox.files.read(D + "/sub/c.txt") == "bb"
    sandbox.files.remove(D + "/sub/c.txt")
    assert not sandbox.files.exists(D + "/sub/c.txt")

    # Several files in one call.
    sandbox.files.write_files([{"path": D + "/m1.txt", "data": "one"}, {"path": D + "/m2.bin", "data": b"\x00\x01"}])
    assert sandbox.files.read(D + "/m1.txt") == "one"
    assert bytes(sandbox.files.read(D + "/m2.bin", format="bytes")) == b"\x00\x01"

    # Signed download URL: works without headers; a tampered one is refused.
    url = sandbox.download_url(D + "/a.txt")
    ok = httpx.get(url)
    assert ok.status_code == 200 and ok.text == "hello file"
    bad = httpx.get(url.replace("a.txt", "other.txt"))
    assert bad.status_code == 401 and bad.json()["message"] == "invalid signature", bad.text
    # Expired, in E2B's words (issue 40, gap 4).
    short = sandbox.download_url(D + "/a.txt", use_signature_expiration=1)
    time.sleep(2.2)
    late = httpx.get(short)
    assert late.status_code == 401 and late.json()["message"] == "signature is already expired", late.text


def test_watch_dir_sync(sandbox):
    sandbox.files.make_dir(D + "/watched")
    h = sandbox.files.watch_dir(D + "/watched")
    try:
        sandbox.files.write(D + "/watched/new.txt", "x")
        deadline, seen = time.monotonic() + 10, []
        while time.monotonic() < deadline and not any(e.name == "new.txt" for e in seen):
            seen.extend(h.get_new_events())
            time.sleep(0.1)
        types = {e.type for e in seen if e.name == "new.txt"}
        assert types & {FilesystemEventType.CREATE, FilesystemEventType.WRITE}, seen
    finally:
        h.stop()


@pytest.mark.asyncio
async def test_files_async(async_sandbox):
    await async_sandbox.files.write(D + "/x.txt", "async hello")
    assert await async_sandbox.files.read(D + "/x.txt") == "async hello"
    assert await async_sandbox.files.exists(D + "/x.txt")
    names = [e.name for e in await async_sandbox.files.list(D)]
    assert "x.txt" in names
    with pytest.raises(NotFoundException):
        await async_sandbox.files.read(D + "/nope")


def test_files_as_e2b_envd_answers(sandbox):
    """Behaviours E2B's own SDK suite checks (issue 40): removing what is
    not there succeeds; files of /proc read whole; a symlink's info is the
    type of what it leads to and its resolved, absolute target."""
    sandbox.files.remove(D + "/never-was.txt")
    assert sandbox.files.read("/proc/version").startswith("Linux version")
    assert len(sandbox.files.read("/proc/sys/kernel/random/boot_id").strip()) == 36
    sandbox.files.write(D + "/links/target.txt", "t")
    sandbox.commands.run(f"cd {D}/links && ln -s target.txt rel-link && ln -s {D}/links abs-dir-link")
    info = sandbox.files.get_info(D + "/links/rel-link")
    assert info.type == FileType.FILE and info.symlink_target == D + "/links/target.txt", info
    info = sandbox.files.get_info(D + "/links/abs-dir-link")
    assert info.type == FileType.DIR and info.symlink_target == D + "/links", info
