# Shared helpers for scripts/setup and scripts/test (sourced, not run).

GO_VERSION=${GO_VERSION:-1.26.8}
APT_PACKAGES="qemu-system-x86 qemu-utils debootstrap busybox-static nftables iproute2 e2fsprogs fuse2fs cpio zstd xz-utils ca-certificates curl unzip procps"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

need_root() {
	if [ "$(id -u)" != 0 ]; then
		echo "run this as root (it installs packages and creates network namespaces)" >&2
		exit 1
	fi
}

install_packages() {
	local missing=()
	for p in $APT_PACKAGES; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
	done
	if [ ${#missing[@]} -eq 0 ]; then
		say "Debian packages already installed"
		return
	fi
	say "installing Debian packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# ensure_go puts Go $GO_VERSION (or newer) on PATH, fetching the official
# toolchain from the Go module proxy when the machine has none.
ensure_go() {
	export PATH=/usr/local/go/bin:$PATH
	if command -v go >/dev/null 2>&1; then
		local have
		have=$(go env GOVERSION | sed 's/^go//')
		if [ "$(printf '%s\n%s\n' "$GO_VERSION" "$have" | sort -V | head -1)" = "$GO_VERSION" ]; then
			say "using Go $have"
			return
		fi
	fi
	# The module proxy the machine is configured with: GOPROXY, else what an
	# older Go on the machine would use.
	local proxy=${GOPROXY:-}
	if [ -z "$proxy" ] && command -v go >/dev/null 2>&1; then
		proxy=$(go env GOPROXY)
	fi
	proxy=${proxy%%,*}
	if [ -z "$proxy" ] || [ "$proxy" = direct ] || [ "$proxy" = off ]; then
		echo "no Go $GO_VERSION on this machine and no Go module proxy configured: set GOPROXY" >&2
		exit 1
	fi
	local zip="/tmp/go${GO_VERSION}.zip"
	say "fetching Go $GO_VERSION from the Go module proxy"
	curl -fsSL --retry 3 -o "$zip" "$proxy/golang.org/toolchain/@v/v0.0.1-go${GO_VERSION}.linux-amd64.zip"
	rm -rf /tmp/go-toolchain && mkdir -p /tmp/go-toolchain
	unzip -q "$zip" -d /tmp/go-toolchain
	rm -rf /usr/local/go
	mv "/tmp/go-toolchain/golang.org/toolchain@v0.0.1-go${GO_VERSION}.linux-amd64" /usr/local/go
	chmod +x /usr/local/go/bin/* /usr/local/go/pkg/tool/*/* 2>/dev/null || true
	rm -rf /tmp/go-toolchain "$zip"
	go version
}

build_binaries() {
	say "building bin/aenv and bin/envd"
	mkdir -p bin
	go build -o bin/aenv ./cmd/aenv
	CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o bin/envd ./cmd/envd
}
