#!/bin/sh
# Prepares the data dir of a server or node on first start (kernel,
# initramfs, templates in $AENV_TEMPLATES, default base), then runs aenv.
set -eu
case "${1:-}" in
server | node)
	if [ ! -f "$AENV_DATA_DIR/templates/base/template.json" ]; then
		aenv setup --data-dir "$AENV_DATA_DIR" --templates "${AENV_TEMPLATES:-base}"
	fi
	;;
esac
exec aenv "$@"
