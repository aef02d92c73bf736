#!/usr/bin/python3
"""AgentENV's code-interpreter server, run inside code-interpreter sandboxes.

It speaks the protocol of E2B's code interpreter on port 49999, which the
official code-interpreter SDKs (Python and JS) call unchanged:

  POST   /execute                 {code, context_id?, language?, env_vars?}
                                  -> a stream of JSON lines: stdout, stderr,
                                     result, error, number_of_executions,
                                     end_of_execution
  POST   /contexts                {language?, cwd?} -> {id, language, cwd}
  GET    /contexts                -> [{id, language, cwd}, ...]
  DELETE /contexts/{id}
  POST   /contexts/{id}/restart
  GET    /health                  200 once the default Python context is up

A Python context is an IPython kernel (Debian's ipykernel, driven with
jupyter_client); a bash context is a persistent bash the code is evaluated
in. Contexts keep their state between executions. When the client goes
away mid-execution (the SDKs close the connection when an execution's
timeout passes) the execution is interrupted. Errors are JSON
{code, message}.

Only the standard library and jupyter_client are used, so the server runs
on the distribution's Python as it is.
"""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from queue import Empty, Queue

PORT = int(os.environ.get("AENV_CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("AENV_CODE_INTERPRETER_CWD", "/home/user")
ENVD_URL = os.environ.get("AENV_ENVD_URL", "http://127.0.0.1:49983")
LANGUAGES = ("python", "bash")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# How long an interrupted execution may take to stop before its context is
# restarted.
INTERRUPT_GRACE = 10.0
# Warm-up run in the default Python context before the server reports
# ready, so that the template's snapshot holds the libraries imported.
WARM_UP = """
import importlib as __aenv_importlib
for __aenv_m in ("numpy", "pandas", "matplotlib", "matplotlib.pyplot"):
    try:
        __aenv_importlib.import_module(__aenv_m)
    except Exception:
        pass
del __aenv_importlib, __aenv_m
"""

# MIME types of Jupyter display data and the result fields the SDKs read.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def now_ns():
    return time.time_ns()


class HTTPError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def result_message(data, is_main):
    msg = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field:
            msg[field] = value
        else:
            extra[mime] = value
    if extra:
        msg["extra"] = extra
    return msg


def sandbox_envs(token):
    """The sandbox's env vars (its create's envVars and the template's), as
    envd holds them since /init, or None if envd would not tell. The
    kernels were started in the template's snapshot, before them."""
    req = urllib.request.Request(ENVD_URL + "/envs")
    if token:
        req.add_header("X-Access-Token", token)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            envs = json.loads(resp.read())
    except Exception:  # noqa: BLE001 - tried again at the next execution
        return None
    if not isinstance(envs, dict):
        return None
    return {k: str(v) for k, v in envs.items() if ENV_NAME.match(k)}


class PythonContext:
    """An IPython kernel with the state of one context."""

    language = "python"

    def __init__(self, context_id, cwd):
        import jupyter_client  # imported here: bash-only use needs no Jupyter

        self._jupyter_client = jupyter_client
        self.id = context_id
        self.cwd = cwd
        self.lock = threading.Lock()
        self._start()

    def _start(self):
        self.have_sandbox_envs = False
        env = dict(os.environ)
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        self.km = self._jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=300)
        except Exception:
            self._stop()
            raise

    def _stop(self):
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass

    def close(self):
        with self.lock:
            self._stop()

    def restart(self):
        with self.lock:
            self._stop()
            self._start()

    def _run(self, code, emit, gone, silent):
        """Runs code; emit gets the SDK's messages (unless silent). Returns
        False if the execution was interrupted because the client left."""
        msg_id = self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=False)
        interrupted_at = None
        while True:
            if interrupted_at is None and gone():
                self.km.interrupt_kernel()
                interrupted_at = time.monotonic()
            if interrupted_at is not None and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                # The code ignores interrupts: a fresh kernel is the only
                # way to get the context back.
                self._stop()
                self._start()
                return False
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                break
            if silent or interrupted_at is not None:
                continue
            if kind == "stream":
                emit({"type": "stdout" if content.get("name") == "stdout" else "stderr",
                      "text": content.get("text", ""), "timestamp": now_ns()})
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
            elif kind == "execute_result":
                emit(result_message(content.get("data", {}), True))
            elif kind == "display_data":
                emit(result_message(content.get("data", {}), False))
            elif kind == "error":
                emit({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                      "traceback": "\n".join(content.get("traceback", []))})
        self._drain_reply(msg_id)
        return interrupted_at is None

    def _drain_reply(self, msg_id):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                reply = self.kc.get_shell_msg(timeout=0.5)
            except Empty:
                return
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return

    def execute(self, code, env_vars, emit, gone, token=None):
        with self.lock:
            if gone():
                return
            if not self.have_sandbox_envs:
                envs = sandbox_envs(token)
                if envs is not None:
                    if envs:
                        self._run("import os as __aenv_os\n__aenv_os.environ.update(%r)\ndel __aenv_os\n" % envs,
                                  emit, lambda: False, True)
                    self.have_sandbox_envs = True
            if env_vars:
                names = sorted(env_vars)
                self._run("import os as __aenv_os\n"
                          "__aenv_saved = {k: __aenv_os.environ.get(k) for k in %r}\n"
                          "__aenv_os.environ.update(%r)\n" % (names, dict(env_vars)), emit, lambda: False, True)
            try:
                self._run(code, emit, gone, False)
            finally:
                if env_vars:
                    self._run("for __aenv_k, __aenv_v in __aenv_saved.items():\n"
                              "    if __aenv_v is None:\n"
                              "        __aenv_os.environ.pop(__aenv_k, None)\n"
                              "    else:\n"
                              "        __aenv_os.environ[__aenv_k] = __aenv_v\n"
                              "del __aenv_saved, __aenv_os\n", emit, lambda: False, True)

    def warm_up(self):
        with self.lock:
            self._run(WARM_UP, lambda m: None, lambda: False, True)


class BashContext:
    """A persistent bash: each execution is evaluated in the same shell, so
    variables, functions and the working directory are kept."""

    language = "bash"

    def __init__(self, context_id, cwd):
        self.id = context_id
        self.cwd = cwd
        self.lock = threading.Lock()
        self.count = 0
        self._start()

    def _start(self):
        self.sandbox_envs = None
        self.proc = subprocess.Popen(
            ["/bin/bash", "--noprofile", "--norc"], cwd=self.cwd, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.out = Queue()
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            threading.Thread(target=self._read, args=(name, pipe, self.out), daemon=True).start()

    @staticmethod
    def _read(name, pipe, out):
        for line in iter(pipe.readline, b""):
            out.put((name, line.decode("utf-8", "replace")))
        out.put((name, None))

    def _stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()

    def close(self):
        with self.lock:
            self._stop()

    def restart(self):
        with self.lock:
            self._stop()
            self.count = 0
            self._start()

    def execute(self, code, env_vars, emit, gone, token=None):
        with self.lock:
            if gone():
                return
            if self.proc.poll() is not None:
                self._start()
            if self.sandbox_envs is None:
                self.sandbox_envs = sandbox_envs(token)
                if self.sandbox_envs:
                    exports = "".join("export %s=%s\n" % (k, shell_quote(v)) for k, v in self.sandbox_envs.items())
                    try:
                        self.proc.stdin.write(exports.encode())
                        self.proc.stdin.flush()
                    except OSError:
                        pass
            marker = "__AENV_END_" + uuid.uuid4().hex
            # Assignments before eval last for this execution only (bash
            # outside POSIX mode), and reach the commands it runs.
            exports = "".join("%s=%s " % (k, shell_quote(v)) for k, v in (env_vars or {}).items())
            # The code is read as data by a here-document and evaluated, so a
            # syntax error ends the execution instead of leaving bash waiting
            # for more input.
            script = "%seval \"$(cat <<'%s'\n%s\n%s\n)\"\n" % (exports, marker, code, marker)
            script += "__aenv_rc=$?; printf '%s %%d\\n' \"$__aenv_rc\"; printf '%s\\n' >&2\n" % (marker, marker)
            self.count += 1
            emit({"type": "number_of_executions", "execution_count": self.count})
            try:
                self.proc.stdin.write(script.encode())
                self.proc.stdin.flush()
            except OSError:
                pass
            done = {"stdout": False, "stderr": False}
            rc = None
            while not all(done.values()):
                if gone():
                    # bash cannot interrupt its foreground job without job
                    # control: the shell starts afresh (the context keeps
                    # its id and directory).
                    self._stop()
                    self._start()
                    return
                try:
                    name, line = self.out.get(timeout=0.2)
                except Empty:
                    continue
                if line is None:
                    # bash exited (the code ran `exit`): report it, start anew.
                    self.proc.wait()
                    emit({"type": "error", "name": "", "value": "bash exited with %d" % self.proc.returncode,
                          "traceback": ""})
                    self._start()
                    return
                i = line.find(marker)
                if i >= 0:
                    if i > 0:
                        emit({"type": name, "text": line[:i], "timestamp": now_ns()})
                    if name == "stdout":
                        try:
                            rc = int(line[i + len(marker):].strip() or 0)
                        except ValueError:
                            rc = None
                    done[name] = True
                    continue
                emit({"type": name, "text": line, "timestamp": now_ns()})
            if rc:
                # As bash_kernel reports a non-zero exit status.
                emit({"type": "error", "name": "", "value": str(rc), "traceback": ""})


def shell_quote(value):
    return "'" + str(value).replace("'", "'\\''") + "'"


class Contexts:
    """The contexts of this sandbox, and the default one per language."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}

    def create(self, language, cwd):
        language = (language or "python").lower()
        if language not in LANGUAGES:
            raise HTTPError(400, "language %r is not supported by this template (supported: %s)"
                            % (language, ", ".join(LANGUAGES)))
        cwd = cwd or DEFAULT_CWD
        if not os.path.isdir(cwd):
            raise HTTPError(400, "cwd %r is not a directory" % cwd)
        kind = PythonContext if language == "python" else BashContext
        ctx = kind(str(uuid.uuid4()), cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            ctx = self.by_id.get(context_id)
        if ctx is None:
            raise HTTPError(404, "context %r not found" % context_id)
        return ctx

    def default(self, language):
        language = (language or "python").lower()
        if language not in LANGUAGES:
            raise HTTPError(400, "language %r is not supported by this template (supported: %s)"
                            % (language, ", ".join(LANGUAGES)))
        with self.lock:
            ctx = self.defaults.get(language)
            if ctx is not None and ctx.id in self.by_id:
                return ctx
        ctx = self.create(language, DEFAULT_CWD)
        with self.lock:
            current = self.defaults.get(language)
            if current is not None and current.id in self.by_id:
                # Another request made it first.
                self.by_id.pop(ctx.id, None)
                ctx.close()
                return current
            self.defaults[language] = ctx
        return ctx

    def list(self):
        with self.lock:
            return list(self.by_id.values())

    def remove(self, context_id):
        with self.lock:
            ctx = self.by_id.pop(context_id, None)
        if ctx is None:
            raise HTTPError(404, "context %r not found" % context_id)
        ctx.close()


def describe(ctx):
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "aenv-code-interpreter"
    contexts = None  # set by main
    ready = threading.Event()

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.log_date_time_string(), fmt % args))

    def _send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_empty(self, status):
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, "request body is not JSON: %s" % e)
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def _path(self):
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _dispatch(self, method):
        try:
            path = self._path()
            parts = path.strip("/").split("/")
            if path == "/health" and method in ("GET", "HEAD"):
                if not self.ready.is_set():
                    raise HTTPError(503, "the default context is starting")
                return self._send_json(200, {"status": "ok"})
            if path == "/execute" and method == "POST":
                return self._execute()
            if path == "/contexts" and method == "GET":
                return self._send_json(200, [describe(c) for c in self.contexts.list()])
            if path == "/contexts" and method == "POST":
                body = self._body()
                language, cwd = body.get("language"), body.get("cwd")
                for name, value in (("language", language), ("cwd", cwd)):
                    if value is not None and not isinstance(value, str):
                        raise HTTPError(400, "%s must be a string" % name)
                return self._send_json(200, describe(self.contexts.create(language, cwd)))
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                self.contexts.remove(parts[1])
                return self._send_empty(204)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                self.contexts.get(parts[1]).restart()
                return self._send_empty(204)
            if path in ("/health", "/execute", "/contexts") or parts[0] == "contexts":
                raise HTTPError(405, "method %s not allowed on %s" % (method, path))
            raise HTTPError(404, "no route %s %s" % (method, path))
        except HTTPError as e:
            self._send_json(e.status, {"code": e.status, "message": e.message})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - reported, the server keeps serving
            sys.stderr.write("error serving %s %s: %r\n" % (method, self.path, e))
            try:
                self._send_json(500, {"code": 500, "message": "internal error: %s" % type(e).__name__})
            except OSError:
                self.close_connection = True

    def _gone(self):
        """Reports whether the client closed its side of the connection."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _execute(self):
        body = self._body()
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code is required and must be a string")
        context_id, language, env_vars = body.get("context_id"), body.get("language"), body.get("env_vars")
        if context_id is not None and not isinstance(context_id, str):
            raise HTTPError(400, "context_id must be a string")
        if language is not None and not isinstance(language, str):
            raise HTTPError(400, "language must be a string")
        if env_vars is not None and (not isinstance(env_vars, dict) or
                                     not all(isinstance(v, str) for v in env_vars.values())):
            raise HTTPError(400, "env_vars must be an object of strings")
        for name in env_vars or {}:
            if not ENV_NAME.match(name):
                raise HTTPError(400, "env_vars: %r is not a variable name" % name)
        if context_id and language:
            raise HTTPError(400, "give context_id or language, not both")
        ctx = self.contexts.get(context_id) if context_id else self.contexts.default(language)

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        lost = []

        def emit(msg):
            if lost:
                return
            data = (json.dumps(msg) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:
                lost.append(True)

        def gone():
            return bool(lost) or self._gone()

        ctx.execute(code, env_vars, emit, gone, self.headers.get("X-Access-Token"))
        if gone():
            self.close_connection = True
            return
        emit({"type": "end_of_execution"})
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_PATCH(self):
        self._dispatch("PATCH")


def main():
    contexts = Contexts()
    Handler.contexts = contexts
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stderr.write("code interpreter listening on :%d\n" % PORT)
    ctx = contexts.default("python")
    ctx.warm_up()
    Handler.ready.set()
    sys.stderr.write("default python context %s ready\n" % ctx.id)
    signal.sigwait([signal.SIGTERM, signal.SIGINT])
    server.shutdown()
    for c in contexts.list():
        c.close()


if __name__ == "__main__":
    main()
