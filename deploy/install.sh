#!/usr/bin/env bash
# Installs AgentENV as a systemd service on Ubuntu 24.04 or Debian 12, as
# root, from a checkout of the repository.
#
#   deploy/install.sh server
#       one machine: aenv server on 127.0.0.1:8000 (AENV_LISTEN to change)
#   AENV_API_KEY=e2b_... AENV_NODE_TOKEN=... deploy/install.sh scheduler
#   AENV_API_KEY=e2b_... AENV_NODE_TOKEN=... deploy/install.sh gateway --scheduler http://10.0.0.1:9090
#   AENV_API_KEY=e2b_... AENV_NODE_TOKEN=... deploy/install.sh node --scheduler http://10.0.0.1:9090 \
#       --advertise-url http://10.0.0.5:8000 [-- --repository oss://...]
#
# Arguments after `--` are passed on to `aenv <role>` (AENV_ARGS);
# AENV_SETUP_ARGS to `aenv setup` (e.g. --guest-distro, --guest-mirror). Every
# machine of a cluster needs the same API key. Installs the Debian packages,
# Go (from the Go module proxy if missing), /usr/local/bin/aenv and envd,
# prepares /var/lib/aenv with the kernel and the base template (server and
# node), writes /etc/aenv/aenv.env and starts aenv-<role>.service where systemd runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

usage() {
	sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

role=${1:-}
[ -n "$role" ] || usage
shift
scheduler="" advertise="" extra=()
while [ $# -gt 0 ]; do
	case "$1" in
	--scheduler) scheduler=${2:?--scheduler needs a URL}; shift 2 ;;
	--advertise-url) advertise=${2:?--advertise-url needs a URL}; shift 2 ;;
	--) shift; extra=("$@"); break ;;
	*) usage ;;
	esac
done

case "$role" in
server) listen=${AENV_LISTEN:-127.0.0.1:8000} ;;
node) listen=${AENV_LISTEN:-0.0.0.0:8000} ;;
gateway) listen=${AENV_LISTEN:-:8080} ;;
scheduler) listen=${AENV_LISTEN:-:9090} ;;
*) usage ;;
esac

# The environment file quotes each value in single quotes, which both
# systemd and a shell read.
for v in "$listen" "$scheduler" "$advertise" "${extra[@]}"; do
	case "$v" in
	*\'* | *$'\n'*) echo "a value with a single quote or a newline cannot go into /etc/aenv/aenv.env: $v" >&2; exit 1 ;;
	esac
done

need_root
. /etc/os-release
case "${ID:-}:${VERSION_ID:-}" in
ubuntu:24.04 | debian:12) ;;
*) say "warning: tested on Ubuntu 24.04 and Debian 12, this is ${PRETTY_NAME:-unknown}" ;;
esac
if [ "$role" != server ]; then
	if ! [[ "${AENV_API_KEY:-}" =~ ^e2b_[0-9a-f]+$ ]]; then
		echo "set AENV_API_KEY to the cluster's key (e2b_<hex>; the same on every machine)" >&2
		exit 1
	fi
	if ! [[ "${AENV_NODE_TOKEN:-}" =~ ^[A-Za-z0-9._~+/=-]{32,256}$ ]] || [ "$AENV_NODE_TOKEN" = "$AENV_API_KEY" ]; then
		echo "set AENV_NODE_TOKEN to the cluster's node credential (e.g. \$(openssl rand -hex 32); the same on every machine, not the API key)" >&2
		exit 1
	fi
fi
if [ "$role" = node ] || [ "$role" = gateway ]; then
	[ -n "$scheduler" ] || { echo "$role needs --scheduler URL" >&2; exit 1; }
fi
if [ "$role" = node ] && [ -z "$advertise" ]; then
	echo "node needs --advertise-url http://<this machine's address>:8000 (how the gateway reaches it)" >&2
	exit 1
fi

install_packages
ensure_go
build_binaries
say "installing /usr/local/bin/aenv and /usr/local/bin/envd"
install -m 0755 bin/aenv bin/envd /usr/local/bin/

if [ "$role" = server ] || [ "$role" = node ]; then
	say "preparing /var/lib/aenv (kernel, initramfs, ${AENV_TEMPLATES:-base} template)"
	# shellcheck disable=SC2086 # AENV_SETUP_ARGS is a list of flags
	/usr/local/bin/aenv setup --data-dir /var/lib/aenv --templates "${AENV_TEMPLATES:-base}" ${AENV_SETUP_ARGS:-}
fi
new_key=""
if [ "$role" = server ] && [ -z "${AENV_API_KEY:-}" ] && ! /usr/local/bin/aenv key --exists --data-dir /var/lib/aenv 2>/dev/null; then
	new_key=$(/usr/local/bin/aenv key --rotate --data-dir /var/lib/aenv) # stored hashed; shown once below
fi

say "writing /etc/aenv/aenv.env"
install -d -m 0700 /etc/aenv
env_file=$(mktemp /etc/aenv/.aenv.env.XXXXXX)
{
	echo "AENV_LISTEN='$listen'"
	[ -n "${AENV_API_KEY:-}" ] && echo "AENV_API_KEY='$AENV_API_KEY'"
	[ -n "${AENV_NODE_TOKEN:-}" ] && echo "AENV_NODE_TOKEN='$AENV_NODE_TOKEN'"
	[ -n "$scheduler" ] && echo "AENV_SCHEDULER_URL='$scheduler'"
	[ -n "$advertise" ] && echo "AENV_ADVERTISE_URL='$advertise'"
	echo "AENV_ARGS='${extra[*]:-}'"
} >"$env_file"
chmod 0600 "$env_file"
mv "$env_file" /etc/aenv/aenv.env

say "installing aenv-$role.service and checking it with systemd-analyze verify"
install -m 0644 "deploy/systemd/aenv-$role.service" /etc/systemd/system/
systemd-analyze verify "/etc/systemd/system/aenv-$role.service"
if [ ! -d /run/systemd/system ]; then
	# No systemd as PID 1 (a container, a build machine): the unit is
	# enabled for the next boot with systemd, and how to run it by hand is
	# printed. Nothing is started.
	systemctl --root=/ enable "aenv-$role.service"
	cat <<MSG

systemd is not running here (PID 1 is $(ps -p 1 -o comm= 2>/dev/null || echo unknown)): aenv-$role.service is installed and
enabled for a boot with systemd, and not started. To run it by hand as its ExecStart does:

  set -a; . /etc/aenv/aenv.env; set +a; $(sed -n 's/^ExecStart=//p' "/etc/systemd/system/aenv-$role.service")

MSG
	[ -n "$new_key" ] && echo "The API key (stored hashed; shown only now): E2B_API_KEY=$new_key"
	exit 0
fi
say "starting aenv-$role.service"
systemctl daemon-reload
systemctl enable "aenv-$role.service"
systemctl restart "aenv-$role.service"
sleep 1
systemctl --no-pager --lines=5 status "aenv-$role.service" || true
case "$role" in
server)
	for _ in $(seq 100); do curl -fs "http://$listen/health" >/dev/null 2>&1 && break; sleep 0.1; done
	cat <<MSG

AgentENV runs as aenv-server.service. Point the E2B SDK at it:

  export E2B_API_URL=http://$listen E2B_SANDBOX_URL=http://$listen E2B_API_KEY=${new_key:-${AENV_API_KEY:-<the key made at the first install; aenv key --rotate makes a new one>}}

MSG
	;;
*) echo "aenv-$role.service is running; logs: journalctl -u aenv-$role -f" ;;
esac
