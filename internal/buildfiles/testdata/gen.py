"""Makes the fixtures of buildfiles' tests with the official E2B Python SDK.

Run with a Python that has the pinned SDK (tests/e2e/pysdk/requirements.txt):
    python gen.py
It builds a small build context, and for each case writes the archive the
SDK uploads for a COPY and the files hash the SDK sends with it.
"""
import json
import os
import shutil
import tempfile

from e2b.template.utils import calculate_files_hash, tar_file_stream

CASES = [
    # name, src, dest, resolve_symlinks
    ("file", "app.txt", "/app/app.txt", False),
    ("dir", "conf", "/etc/conf/", False),
    ("context", ".", "/app", False),
    ("symlink", "link", "/app/link", False),
    ("glob", "bin/*.sh", "/usr/local/bin/", True),
]

here = os.path.dirname(os.path.abspath(__file__))
ctx = tempfile.mkdtemp()
try:
    with open(os.path.join(ctx, "app.txt"), "w") as f:
        f.write("copied from the client\n")
    os.makedirs(os.path.join(ctx, "bin"))
    with open(os.path.join(ctx, "bin", "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho run\n")
    os.chmod(os.path.join(ctx, "bin", "run.sh"), 0o755)
    os.makedirs(os.path.join(ctx, "conf", "nested"))
    with open(os.path.join(ctx, "conf", "a.json"), "w") as f:
        f.write('{"a": 1}\n')
    with open(os.path.join(ctx, "conf", "nested", "b.txt"), "wb") as f:
        f.write(bytes(range(256)) * 64)
    os.chmod(os.path.join(ctx, "conf", "nested"), 0o750)
    os.symlink("app.txt", os.path.join(ctx, "link"))
    cases = []
    for name, src, dest, follow in CASES:
        h = calculate_files_hash(src, dest, ctx, [], follow, None)
        with tar_file_stream(src, ctx, [], follow, True) as t:
            data = t.read()
        with open(os.path.join(here, name + ".tar.gz"), "wb") as out:
            out.write(data)
        cases.append({"name": name, "src": src, "dest": dest, "hash": h})
    with open(os.path.join(here, "python-sdk.json"), "w") as f:
        json.dump({"sdk": "e2b==2.63.0", "cases": cases}, f, indent=2)
        f.write("\n")
finally:
    shutil.rmtree(ctx)
