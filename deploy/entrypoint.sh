#!/bin/sh
# ENTRYPOINT of the mosaicd image: `mosaicd "$@"`, never as root.
#
# The image runs as the user mosaic (uid 10001). A container started as root (compose's barrier
# service: `user: "0:0"`) only prepares the output folder and then drops to an unprivileged uid
# before mosaicd starts, so a bind-mounted --out works whoever owns it on the host:
#   - the folder (MOSAIC_OUT or --out; created if missing) is owned by a non-root uid, e.g. the
#     host user who ran `mkdir -p results`: mosaicd runs as that uid:gid, and the results on the
#     host belong to that user;
#   - it is owned by root (Docker created the missing bind source): it is given to the owner of
#     MOSAIC_OWNER_FROM when that is a non-root uid (compose.yaml: the project's folder, so the results
#     belong to whoever checked it out), else to mosaic (10001:10001), and mosaicd runs as that uid.
# Started as a non-root uid, it checks that the output folder is writable and says what to do if not.
set -eu

out="${MOSAIC_OUT:-}"
next_is_out=0
for arg in "$@"; do
    if [ "$next_is_out" = 1 ]; then out="$arg"; next_is_out=0; continue; fi
    case "$arg" in
        --out) next_is_out=1 ;;
        --out=*) out="${arg#--out=}" ;;
    esac
done

if [ "$(id -u)" = 0 ]; then
    uid=10001
    gid=10001
    if [ -n "$out" ]; then
        mkdir -p "$out"
        owner="$(stat -c %u "$out")"
        from="${MOSAIC_OWNER_FROM:-}"
        if [ "$owner" = 0 ] && [ -n "$from" ] && [ -e "$from" ] && [ "$(stat -c %u "$from")" != 0 ]; then
            uid="$(stat -c %u "$from")"
            gid="$(stat -c %g "$from")"
            chown "$uid:$gid" "$out"
        elif [ "$owner" = 0 ]; then
            chown 10001:10001 "$out"
        else
            uid="$owner"
            gid="$(stat -c %g "$out")"
        fi
    fi
    exec setpriv --reuid="$uid" --regid="$gid" --clear-groups --inh-caps=-all --bounding-set=-all \
        --no-new-privs mosaicd "$@"
fi

if [ -n "$out" ]; then
    mkdir -p "$out" 2>/dev/null || true
    if [ ! -w "$out" ]; then
        echo "mosaic-entrypoint: the output folder $out is not writable by uid $(id -u)." >&2
        echo "  Either make it writable on the host (mkdir -p results && chmod 777 results), or start the" >&2
        echo "  container as root (--user 0, compose: user: \"0:0\"): the entrypoint then hands the folder" >&2
        echo "  to an unprivileged uid and drops to it before mosaicd starts." >&2
        exit 1
    fi
fi
exec mosaicd "$@"
