"""Template builds with the official Python SDK: COPY uploads checked against
the files hash the SDK sends."""
import os
import time

import pytest
from e2b import Sandbox, Template
from e2b.template.utils import calculate_files_hash, tar_file_stream


def make_context(tmp_path):
    (tmp_path / "app.txt").write_text("copied by the Python SDK\n")
    site = tmp_path / "site"
    (site / "css").mkdir(parents=True)
    (site / "index.html").write_text("<h1>hi</h1>\n")
    (site / "css" / "a.css").write_text("h1{}\n")
    run = tmp_path / "run.sh"
    run.write_text("#!/bin/sh\necho ran\n")
    run.chmod(0o755)
    return tmp_path


def test_build_with_copies_then_rebuild_skips_uploads(tmp_path):
    ctx = make_context(tmp_path)
    name = "py-built-" + format(int(time.time() * 1000), "x")
    logs = []
    tpl = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .copy("app.txt", "/app/app.txt")
        .copy("site", "/srv/site")
        .copy("run.sh", "/usr/local/bin/run.sh")
    )
    Template.build(tpl, name, on_build_logs=lambda l: logs.append(str(l.message)))
    joined = " | ".join(logs)
    assert "Uploaded" in joined, joined

    sbx = Sandbox.create(name, timeout=120)
    try:
        r = sbx.commands.run("cat /app/app.txt /srv/site/index.html /srv/site/css/a.css; run.sh; stat -c %a /usr/local/bin/run.sh")
        assert r.stdout == "copied by the Python SDK\n<h1>hi</h1>\nh1{}\nran\n755\n"
    finally:
        sbx.kill()

    # The same files again: checked, so no upload and every layer cached.
    logs.clear()
    Template.build(tpl, name, on_build_logs=lambda l: logs.append(str(l.message)))
    joined = " | ".join(logs)
    assert "Skipping upload" in joined, joined
    assert "CACHED" in joined, joined


def test_upload_that_does_not_match_its_hash_is_refused(tmp_path, api):
    """Files uploaded under the hash of other files: the build is refused
    with a 400 naming the COPY, and the server keeps nothing."""
    ctx = make_context(tmp_path)
    name = "py-tampered-" + format(int(time.time() * 1000), "x")
    (ctx / "app.txt").write_text(f"the real files of {name}\n")  # never uploaded before
    claimed = calculate_files_hash("app.txt", "/app/app.txt", str(ctx), [], False, None)
    (ctx / "app.txt").write_text("something else entirely\n")
    with tar_file_stream("app.txt", str(ctx), [], False, True) as f:
        tampered = f.read()

    r = api.post("/v3/templates", json={"name": name, "cpuCount": 1, "memoryMB": 512})
    assert r.status_code == 202, r.text
    template_id, build_id = r.json()["templateID"], r.json()["buildID"]
    try:
        link = api.get(f"/templates/{template_id}/files/{claimed}")
        assert link.status_code == 201, link.text
        assert link.json()["present"] is False
        up = api.put(link.json()["url"], content=tampered)
        assert up.status_code == 200, up.text

        steps = [{"type": "COPY", "args": ["app.txt", "/app/app.txt", "", ""], "filesHash": claimed, "force": False}]
        r = api.post(f"/v2/templates/{template_id}/builds/{build_id}", json={"fromTemplate": "base", "steps": steps})
        assert r.status_code == 400, r.text
        body = r.json()
        assert set(body) >= {"code", "message"} and body["code"] == 400
        assert "do not match" in body["message"] and "app.txt" in body["message"], body

        again = api.get(f"/templates/{template_id}/files/{claimed}")
        assert again.json()["present"] is False, "refused files are kept"
        status = api.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert status.json()["status"] == "waiting", status.text
    finally:
        api.delete(f"/templates/{template_id}")


def test_last_user_and_workdir_are_the_sandbox_defaults():
    """A template's last USER and WORKDIR become its sandboxes' default
    user and working directory (E2B's envd takes both in /init)."""
    name = "py-defaults-" + format(int(time.time() * 1000), "x")
    tpl = Template().from_template("base").set_user("root").set_workdir("/opt/x").run_cmd("touch made-here")
    Template.build(tpl, name)
    sbx = Sandbox.create(name, timeout=120)
    try:
        r = sbx.commands.run("whoami; pwd; ls made-here")
        assert r.stdout == "root\n/opt/x\nmade-here\n"
    finally:
        sbx.kill()
    # Only a WORKDIR: the base's user, in that directory.
    name2 = name + "-wd"
    Template.build(Template().from_template("base").set_workdir("/tmp/wd"), name2)
    sbx = Sandbox.create(name2, timeout=120)
    try:
        assert sbx.commands.run("whoami; pwd").stdout == "user\n/tmp/wd\n"
    finally:
        sbx.kill()


def test_tags_name_builds():
    """Template tags: a build's tags keep pointing at it when the template
    is built again; name:tag creates from that build; assign_tags,
    get_tags, remove_tags; build ids are UUIDs, as the SDK parses them."""
    name = "py-tags-" + format(int(time.time() * 1000), "x")
    one = Template.build(Template().from_template("base").run_cmd("echo one | sudo tee /build.txt"), name, tags=["v1"])
    two = Template.build(Template().from_template("base").run_cmd("echo two | sudo tee /build.txt"), name)
    assert one.build_id != two.build_id and one.tags == ["v1"]

    tags = {t.tag: t.build_id for t in Template.get_tags(name)}
    assert tags == {"default": two.build_id, "v1": one.build_id}, tags

    def content(ref):
        sbx = Sandbox.create(ref, timeout=120)
        try:
            return sbx.commands.run("cat /build.txt").stdout
        finally:
            sbx.kill()

    assert content(name) == "two\n"
    assert content(f"{name}:default") == "two\n"
    assert content(f"{name}:v1") == "one\n"

    info = Template.assign_tags(f"{name}:v1", ["prod", "stable"])
    assert info.build_id == one.build_id and sorted(info.tags) == ["prod", "stable"]
    Template.remove_tags(name, ["v1", "stable"])
    tags = {t.tag: t.build_id for t in Template.get_tags(name)}
    assert tags == {"default": two.build_id, "prod": one.build_id}, tags
    assert content(f"{name}:prod") == "one\n"
    with pytest.raises(Exception):
        Sandbox.create(f"{name}:v1", timeout=60)
    with pytest.raises(Exception):
        Template.remove_tags(name, ["never-assigned"])

    # The SDK's generated client reads the template with its builds, and a
    # build's log (its models parse the answers: UUID build ids, times).
    from e2b.api.client.api.templates import get_templates_template_id, get_templates_template_id_builds_build_id_logs
    from e2b.api.client.models import LogLevel, LogsDirection
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig

    client = get_api_client(ConnectionConfig())
    detail = get_templates_template_id.sync_detailed(name, client=client)
    assert detail.status_code == 200, detail.content
    assert str(detail.parsed.build_id) == two.build_id and detail.parsed.build_count == 2
    assert [str(b.build_id) for b in detail.parsed.builds] == [two.build_id, one.build_id]
    assert all(b.status.value == "ready" for b in detail.parsed.builds)
    logs = get_templates_template_id_builds_build_id_logs.sync_detailed(name, one.build_id, client=client)
    assert logs.status_code == 200, logs.content
    messages = [e.message for e in logs.parsed.logs]
    assert any("tagged v1" in m for m in messages), messages
    back = get_templates_template_id_builds_build_id_logs.sync_detailed(
        name, one.build_id, client=client, direction=LogsDirection.BACKWARD, limit=1, level=LogLevel.INFO)
    assert [e.message for e in back.parsed.logs] == [messages[-1]]
    # And the template listing (its Template model requires every field).
    from e2b.api.client.api.templates import get_templates
    listing = get_templates.sync_detailed(client=client)
    assert listing.status_code == 200, listing.content
    mine = [t for t in listing.parsed if t.template_id == name]
    assert len(mine) == 1 and str(mine[0].build_id) == two.build_id and mine[0].build_count == 2, listing.content
