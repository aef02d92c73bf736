#!/bin/sh
# Prepares the data dir of a server or node on first start (kernel,
# initramfs, templates in $AENV_TEMPLATES, default base), then runs aenv.
set -eu
case "${1:-}" in
server | node)
	if [ -z "${AENV_API_KEY:-}" ] && ! aenv key --exists --data-dir "$AENV_DATA_DIR" 2>/dev/null; then
		echo "set AENV_API_KEY (e2b_<hex>, e.g. e2b_\$(openssl rand -hex 20)): the node stores only its hash" >&2
		exit 1
	fi
	if [ ! -f "$AENV_DATA_DIR/templates/base/template.json" ]; then
		aenv setup --data-dir "$AENV_DATA_DIR" --templates "${AENV_TEMPLATES:-base}"
	fi
	;;
esac
exec aenv "$@"
