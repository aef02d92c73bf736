"""Volumes through the official SDK: e2b.Volume and e2b.AsyncVolume (the
/volumes routes with the API key, the /volumecontent routes with the
volume's token at E2B_VOLUME_API_URL, which the harness points at the
server too)."""
import uuid

import pytest

from e2b import AsyncVolume, Volume
from e2b.exceptions import AuthenticationException, NotFoundException, VolumeException

from conftest import TEMPLATE


def name():
    return "pyvol-" + uuid.uuid4().hex[:10]


def test_volume_lifecycle_and_files():
    vol = Volume.create(name())
    try:
        assert vol.volume_id and vol.token
        assert any(v.volume_id == vol.volume_id for v in Volume.list())
        info = Volume.get_info(vol.volume_id)
        assert info.name == vol.name and info.token == vol.token

        # Files: parents made, bytes kept, metadata set.
        e = vol.write_file("/data/hello.txt", "hello volume", mode=0o640)
        assert e.path == "/data/hello.txt" and e.size == 12 and e.mode == 0o640
        assert e.uid == 1000 and e.type.value == "file"
        assert vol.read_file("/data/hello.txt") == "hello volume"
        blob = bytes(range(256)) * 4096
        vol.write_file("/data/blob.bin", blob)
        assert vol.read_file("/data/blob.bin", format="bytes") == blob
        assert b"".join(vol.read_file("/data/blob.bin", format="stream")) == blob

        d = vol.make_dir("/a/b/c", force=True)
        assert d.type.value == "directory" and d.path == "/a/b/c"
        with pytest.raises(NotFoundException):
            vol.make_dir("/x/y")  # no parent without force
        listed = [e.path for e in vol.list("/", depth=3)]
        assert "/a/b/c" in listed and "/data/hello.txt" in listed

        info = vol.get_info("/data/hello.txt")
        assert info.size == 12 and info.mtime.tzinfo is not None
        assert vol.exists("/data/hello.txt") and not vol.exists("/nope")

        e = vol.update_metadata("/data/hello.txt", uid=0, gid=0, mode=0o600)
        assert (e.uid, e.gid, e.mode) == (0, 0, 0o600)

        vol.remove("/data")
        assert not vol.exists("/data/hello.txt")
        with pytest.raises(NotFoundException):
            vol.read_file("/data/hello.txt")

        # Connect finds it again by id, token included.
        again = Volume.connect(vol.volume_id)
        assert again.token == vol.token and again.exists("/a/b/c")
    finally:
        assert Volume.destroy(vol.volume_id)
    assert not Volume.destroy(vol.volume_id)
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id)


def test_volume_name_in_use_and_bad_token():
    n = name()
    vol = Volume.create(n)
    try:
        with pytest.raises(VolumeException):
            Volume.create(n)
        wrong = Volume(vol.volume_id, vol.name, token="vol_" + "0" * 48)
        with pytest.raises(AuthenticationException):
            wrong.list("/")
    finally:
        Volume.destroy(vol.volume_id)


@pytest.mark.asyncio
async def test_async_volume():
    vol = await AsyncVolume.create(name())
    try:
        await vol.write_file("/notes/one.txt", b"one")
        assert await vol.read_file("/notes/one.txt") == "one"
        assert [e.name for e in await vol.list("/notes")] == ["one.txt"]
        await vol.make_dir("/deep/er", force=True)
        assert await vol.exists("/deep/er")
        await vol.remove("/notes/one.txt")
        assert not await vol.exists("/notes/one.txt")
        assert any(v.volume_id == vol.volume_id for v in await AsyncVolume.list())
    finally:
        assert await AsyncVolume.destroy(vol.volume_id)


def test_volume_mounted_in_sandboxes():
    """A volume mounted at create (by Volume and by name): the guest reads
    what the SDK wrote and writes as its user; while mounted the volume's
    content routes and its deletion are refused (one writer), a second
    sandbox cannot mount it; it survives pause and resume, and what the
    guest wrote is in the volume after the kill and in the next sandbox."""
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    vol = Volume.create(name())
    try:
        vol.write_file("/seed.txt", "from the sdk\n")
        sbx = Sandbox.create(TEMPLATE, timeout=300, volume_mounts={"/mnt/data": vol})
        try:
            r = sbx.commands.run("cat /mnt/data/seed.txt && id -u && echo guest > /mnt/data/out.txt && stat -c %u /mnt/data/out.txt")
            assert r.stdout == "from the sdk\n1000\n1000\n"
            info = sbx.get_info()
            assert info.volume_mounts == [{"name": vol.name, "path": "/mnt/data"}]
            with pytest.raises(VolumeException):
                vol.read_file("/seed.txt")
            with pytest.raises(Exception):
                Volume.destroy(vol.volume_id)
            with pytest.raises(SandboxException):
                Sandbox.create(TEMPLATE, timeout=60, volume_mounts={"/other": vol.name})

            assert sbx.pause() is True
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=300)
            sbx.commands.run("echo after resume >> /mnt/data/out.txt")
        finally:
            sbx.kill()
        assert vol.read_file("/out.txt") == "guest\nafter resume\n"

        again = Sandbox.create(TEMPLATE, timeout=120, volume_mounts={"/home/user/v": vol.name})
        try:
            assert again.commands.run("cat /home/user/v/out.txt").stdout == "guest\nafter resume\n"
        finally:
            again.kill()
    finally:
        assert Volume.destroy(vol.volume_id)


def test_volume_mount_bad_input():
    from e2b import Sandbox
    from e2b.exceptions import InvalidArgumentException, SandboxException

    with pytest.raises((InvalidArgumentException, SandboxException), match="no volume"):
        Sandbox.create(TEMPLATE, timeout=60, volume_mounts={"/mnt/x": "no-such-volume"})
    vol = Volume.create(name())
    try:
        for path in ("relative", "/proc/x", "/"):
            with pytest.raises((InvalidArgumentException, SandboxException)):
                Sandbox.create(TEMPLATE, timeout=60, volume_mounts={path: vol})
        # Nothing held: the volume's files are reachable.
        assert not vol.exists("/anything")
    finally:
        Volume.destroy(vol.volume_id)


@pytest.mark.asyncio
async def test_async_volume_mounted():
    from e2b import AsyncSandbox

    vol = await AsyncVolume.create(name())
    try:
        sbx = await AsyncSandbox.create(TEMPLATE, timeout=300, volume_mounts={"/data": vol})
        try:
            await sbx.commands.run("echo async > /data/a.txt")
        finally:
            await sbx.kill()
        assert await vol.read_file("/a.txt") == "async\n"
    finally:
        await AsyncVolume.destroy(vol.volume_id)


def test_fork_of_a_sandbox_with_a_volume():
    """Children of a fork each get a copy-on-write copy of the volume as the
    parent had it; their writes stay theirs, the volume stays the parent's."""
    from e2b import Sandbox

    vol = Volume.create(name())
    try:
        parent = Sandbox.create(TEMPLATE, timeout=300, volume_mounts={"/mnt/v": vol})
        children = []
        try:
            parent.commands.run("echo parent > /mnt/v/p.txt")
            results = parent.fork(count=2, timeout=120)
            children = [r for r in results if not isinstance(r, Exception)]
            assert len(children) == 2, results
            for i, c in enumerate(children):
                assert c.commands.run("cat /mnt/v/p.txt").stdout == "parent\n"
                c.commands.run(f"echo child {i} > /mnt/v/c.txt")
                assert c.get_info().volume_mounts == [{"name": vol.name, "path": "/mnt/v"}]
            assert [c.commands.run("cat /mnt/v/c.txt").stdout for c in children] == ["child 0\n", "child 1\n"]
            assert parent.commands.run("ls /mnt/v").stdout.split() == ["lost+found", "p.txt"]
            parent.commands.run("echo more >> /mnt/v/p.txt")
            assert children[0].commands.run("cat /mnt/v/p.txt").stdout == "parent\n"
        finally:
            for c in children:
                c.kill()
            parent.kill()
        assert vol.read_file("/p.txt") == "parent\nmore\n"
        assert not vol.exists("/c.txt")
    finally:
        Volume.destroy(vol.volume_id)


def test_snapshot_of_a_sandbox_with_a_volume():
    """A snapshot keeps the volume as it was; a sandbox made from it mounts
    its own copy, and the volume goes on as its sandbox writes it."""
    from e2b import Sandbox

    vol = Volume.create(name())
    snap = None
    try:
        sbx = Sandbox.create(TEMPLATE, timeout=300, volume_mounts={"/mnt/v": vol})
        try:
            sbx.commands.run("echo at snapshot > /mnt/v/s.txt")
            snap = sbx.create_snapshot().snapshot_id
            sbx.commands.run("echo later > /mnt/v/s.txt")
            restored = Sandbox.create(snap, timeout=120)
            try:
                assert restored.commands.run("cat /mnt/v/s.txt").stdout == "at snapshot\n"
                restored.commands.run("echo restored > /mnt/v/s.txt")
            finally:
                restored.kill()
            assert sbx.commands.run("cat /mnt/v/s.txt").stdout == "later\n"
        finally:
            sbx.kill()
        assert vol.read_file("/s.txt") == "later\n"
    finally:
        if snap:
            Sandbox.delete_snapshot(snap)
        Volume.destroy(vol.volume_id)
