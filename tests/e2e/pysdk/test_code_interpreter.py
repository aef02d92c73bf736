"""The official e2b-code-interpreter SDK (sync and async) against the
code-interpreter template (`aenv setup --templates code-interpreter`, built
as the SDK's default template code-interpreter-v1): state kept between
calls, stdout and stderr, results in several formats with a matplotlib
chart as PNG, an error's traceback, env vars, a timeout that interrupts
the execution, bash, and contexts (create, list, restart, remove)."""
import base64
import os
import re
import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

if not os.environ.get("AENV_CODE_INTERPRETER"):
    reason = "the test data dir has no code-interpreter template: `aenv setup --templates code-interpreter`"
    if os.environ.get("CI") == "true":
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture
def sbx():
    # No template named: the SDK's default, code-interpreter-v1.
    s = Sandbox.create(timeout=300, envs={"AENV_FROM_CREATE": "at create"})
    try:
        yield s
    finally:
        try:
            s.kill()
        except Exception:
            pass


def test_run_code_keeps_state_and_streams(sbx):
    assert sbx.run_code("x = 41").error is None
    seen = []
    ex = sbx.run_code(
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nx + 1",
        on_stdout=lambda m: seen.append(("out", m.line)),
        on_stderr=lambda m: seen.append(("err", m.line)),
    )
    assert ex.error is None
    assert ex.text == "42"
    assert ex.logs.stdout == ["to stdout\n"] and ex.logs.stderr == ["to stderr\n"]
    assert ("out", "to stdout\n") in seen and ("err", "to stderr\n") in seen
    assert ex.execution_count is not None and ex.execution_count >= 2


def test_matplotlib_chart_comes_back_as_png(sbx):
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('t')\nplt.show()"
    )
    assert ex.error is None, ex.error
    pngs = [r for r in ex.results if r.png]
    assert len(pngs) == 1, ex.results
    assert base64.b64decode(pngs[0].png).startswith(PNG_MAGIC)
    assert not pngs[0].is_main_result


def test_results_in_several_formats(sbx):
    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert ex.error is None, ex.error
    main = [r for r in ex.results if r.is_main_result]
    assert len(main) == 1
    assert "<table" in main[0].html and "a" in main[0].text
    ex = sbx.run_code("from IPython.display import JSON, display\ndisplay(JSON({'k': [1, 2]}))")
    assert ex.results[0].json == {"k": [1, 2]}


def test_error_has_name_value_and_traceback(sbx):
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError" and ex.error.value == "bad value"
    # IPython's traceback, colour codes and all (as E2B's).
    assert "raise ValueError('bad value')" in re.sub(r"\x1b\[[0-9;]*m", "", ex.error.traceback)
    # The kernel goes on after an error.
    assert sbx.run_code("1 + 1").text == "2"


def test_envs(sbx):
    ex = sbx.run_code("import os\nos.environ['AENV_CI']", envs={"AENV_CI": "yes"})
    assert ex.text == "'yes'"
    assert sbx.run_code("os.environ.get('AENV_CI', 'unset')").text == "'unset'"
    # The sandbox's own env vars reach the kernels, which the template's
    # snapshot started before the sandbox had them.
    assert sbx.run_code("os.environ['AENV_FROM_CREATE']").text == "'at create'"
    ex = sbx.run_code("echo $AENV_FROM_CREATE", language="bash")
    assert ex.logs.stdout == ["at create\n"]


def test_timeout_interrupts_the_execution(sbx):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=3)
    assert time.monotonic() - start < 30
    # The loop was interrupted: the context answers again, its state kept.
    sbx.run_code("y = 'still here'")
    assert sbx.run_code("y").text == "'still here'"


def test_bash_and_contexts(sbx):
    ex = sbx.run_code("cd /tmp && V=1 && echo hello from bash", language="bash")
    assert ex.error is None and ex.logs.stdout == ["hello from bash\n"]
    assert sbx.run_code("pwd; echo $V", language="bash").logs.stdout == ["/tmp\n", "1\n"]

    ctx = sbx.create_code_context(cwd="/tmp", language="python")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    sbx.run_code("z = 'in the context'", context=ctx)
    assert sbx.run_code("import os\n(z, os.getcwd())", context=ctx).text == "('in the context', '/tmp')"
    assert sbx.run_code("'z' in dir()").text == "False"  # the default context is another kernel
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]

    sbx.restart_code_context(ctx)
    assert sbx.run_code("'z' in dir()", context=ctx).text == "False"

    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(Exception):
        sbx.run_code("1", context=ctx)


@pytest.mark.asyncio
async def test_async_sdk():
    s = await AsyncSandbox.create(timeout=300)
    try:
        await s.run_code("a = [1, 2, 3]")
        ex = await s.run_code("sum(a)")
        assert ex.text == "6"
        ex = await s.run_code("import matplotlib.pyplot as plt\nplt.bar(['x', 'y'], [1, 2])\nplt.show()")
        assert any(r.png and base64.b64decode(r.png).startswith(PNG_MAGIC) for r in ex.results), ex.results
        ex = await s.run_code("1/0")
        assert ex.error.name == "ZeroDivisionError"
        with pytest.raises(TimeoutException):
            await s.run_code("import time\ntime.sleep(60)", timeout=3)
        ctx = await s.create_code_context(language="bash")
        ex = await s.run_code("echo $((6*7))", context=ctx)
        assert ex.logs.stdout == ["42\n"]
        await s.restart_code_context(ctx)
        await s.remove_code_context(ctx)
    finally:
        await s.kill()
