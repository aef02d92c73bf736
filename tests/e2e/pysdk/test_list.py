"""Sandbox.list with the official Python SDK (what the JS suite's
list.test.cjs covers): metadata filters, paging, state."""
import os

from e2b import Sandbox, SandboxQuery, SandboxState

from conftest import TEMPLATE


def test_list_filters_and_pages():
    tag = f"pylist-{os.getpid()}"
    made = [Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": tag, "n": str(i)}) for i in range(3)]
    try:
        def ids(**kw):
            p, out = Sandbox.list(**kw), []
            while p.has_next:
                out.extend(s.sandbox_id for s in p.next_items())
            return out

        mine = sorted(s.sandbox_id for s in made)
        assert sorted(ids(query=SandboxQuery(metadata={"suite": tag}))) == mine
        assert ids(query=SandboxQuery(metadata={"suite": tag, "n": "1"})) == [made[1].sandbox_id]
        paged = ids(query=SandboxQuery(metadata={"suite": tag}), limit=2)
        assert sorted(paged) == mine and len(paged) == len(set(paged))
        assert sorted(ids(query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.RUNNING]))) == mine
        assert ids(query=SandboxQuery(metadata={"suite": tag + "-none"})) == []
        # As E2B's (issue 40, gap 2): oldest first on order="asc", through
        # the pages too; started_after is "at or after".
        newest_first = ids(query=SandboxQuery(metadata={"suite": tag}))
        assert ids(query=SandboxQuery(metadata={"suite": tag}), order="asc", limit=2) == newest_first[::-1]
        first = made[0].get_info().started_at
        assert sorted(ids(query=SandboxQuery(metadata={"suite": tag}, started_after=first))) == mine
        info = made[0].get_info()
        assert info.metadata["suite"] == tag and info.template_id
    finally:
        for s in made:
            s.kill()
