#!/usr/bin/env bash
# Build the local base image mosaic-base:bookworm without pulling from any registry:
# debootstrap a minimal Debian bookworm (python3.11, venv, pip, CA certs) from the
# Debian mirror this machine's apt already uses, then `docker import` the rootfs.
#
# Usage: deploy/build-base-image.sh [--force] [--tag IMAGE] [--mirror URL]
#   --force        rebuild even if the image already exists
#   --tag IMAGE    image name (default: mosaic-base:bookworm, or $MOSAIC_BASE_IMAGE)
#   --mirror URL   Debian mirror (default: the one apt uses here, printed by
#                  deploy/apt-mirror.sh; fails when apt has none and no --mirror is given)
# Env: DEBOOTSTRAP_CACHE=DIR  keep downloaded .debs in DIR (speeds up --force rebuilds)
# Needs root (debootstrap), debootstrap and a running docker daemon.
set -euo pipefail

IMAGE="${MOSAIC_BASE_IMAGE:-mosaic-base:bookworm}"
SUITE=bookworm
FORCE=0
MIRROR=""
INCLUDE="python3,python3-venv,python3-pip,ca-certificates"

log() { printf '[build-base-image] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --force|-f) FORCE=1 ;;
        --tag) IMAGE="${2:?--tag needs a value}"; shift ;;
        --mirror) MIRROR="${2:?--mirror needs a value}"; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
    shift
done

command -v docker >/dev/null || die "docker CLI not found"
docker info >/dev/null 2>&1 || die "docker daemon not reachable (start dockerd first)"

if [[ $FORCE -eq 0 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE already exists; nothing to do (use --force to rebuild)"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install -y debootstrap)"

# The Debian mirror apt already uses (deploy/apt-mirror.sh reads apt's sources; any Debian
# archive mirror serves the $SUITE suite). No fallback host: pass --mirror when apt has none.
if [[ -z $MIRROR ]]; then
    MIRROR="$(bash "$(dirname "$0")/apt-mirror.sh")" \
        || die "no Debian mirror configured for apt here (see deploy/apt-mirror.sh); pass --mirror URL"
fi
MIRROR="${MIRROR%/}"
log "mirror: $MIRROR"

WORKDIR="$(mktemp -d /tmp/mosaic-debootstrap.XXXXXX)"
cleanup() { rm -rf --one-file-system "$WORKDIR"; }
trap cleanup EXIT
ROOTFS="$WORKDIR/rootfs"

args=(--variant=minbase --include="$INCLUDE" --components=main)
if [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]]; then
    args+=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
fi
if [[ -n ${DEBOOTSTRAP_CACHE:-} ]]; then
    mkdir -p "$DEBOOTSTRAP_CACHE"
    args+=(--cache-dir="$(cd "$DEBOOTSTRAP_CACHE" && pwd)")
fi

log "debootstrap $SUITE into $ROOTFS"
start=$SECONDS
if ! debootstrap "${args[@]}" "$SUITE" "$ROOTFS" "$MIRROR" >"$WORKDIR/debootstrap.log" 2>&1; then
    tail -n 30 "$WORKDIR/debootstrap.log" >&2
    [[ -f $ROOTFS/debootstrap/debootstrap.log ]] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
fi
log "debootstrap done in $((SECONDS - start))s"

# Trim the rootfs: package caches, apt lists, docs, man pages, logs.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/debootstrap
find "$ROOTFS"/usr/lib/python3* -depth -name __pycache__ -type d -exec rm -rf {} + 2>/dev/null || true
# Keep future apt runs in containers slim too (same as the official debian images).
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOF
printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n' \
    >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-nodoc"
: >"$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/hostname"

log "importing rootfs as $IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --change "LABEL org.opencontainers.image.title=mosaic-base org.opencontainers.image.base.name=debian:$SUITE-minbase" \
    --message "debootstrap --variant=minbase $SUITE from $MIRROR" \
    - "$IMAGE" >/dev/null

version="$(docker run --rm "$IMAGE" python3 --version)"
log "$IMAGE ready: $version"
case "$version" in
    "Python 3.11."*) ;;
    *) die "expected Python 3.11 in $IMAGE, got: $version" ;;
esac
docker image ls "$IMAGE"
