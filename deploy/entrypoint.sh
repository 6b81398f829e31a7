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
#     belong to whoever checked it out), and mosaicd runs as that uid;
#   - it is owned by root and so is MOSAIC_OWNER_FROM (root checked the project out): mosaicd runs as
#     mosaic (10001) on the folder, lent to it for the run, and the entrypoint hands the folder back to
#     root when mosaicd exits (SIGTERM and SIGINT are passed on to mosaicd meanwhile: `docker stop` ends it
#     as it ends mosaicd itself, within 2 s), so the results belong to root, as the checkout does;
#   - it is owned by root and MOSAIC_OWNER_FROM is unset: it is given to mosaic (10001:10001).
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
    hand_back=0
    if [ -n "$out" ]; then
        mkdir -p "$out"
        owner="$(stat -c %u "$out")"
        lent="$out/.lent-by-root"  # root's folder lent to mosaic by a start that was killed: still root's
        if [ -e "$lent" ]; then owner=0; fi
        from="${MOSAIC_OWNER_FROM:-}"
        if [ "$owner" = 0 ] && [ -n "$from" ] && [ -e "$from" ] && [ "$(stat -c %u "$from")" != 0 ]; then
            uid="$(stat -c %u "$from")"
            gid="$(stat -c %g "$from")"
            chown "$uid:$gid" "$out"
        elif [ "$owner" = 0 ] && [ -n "$from" ] && [ -e "$from" ]; then
            hand_back=1  # root's checkout: lent to mosaic for the run (an earlier run's files too), then root's
            touch "$lent"
            chown -R 10001:10001 "$out"
        elif [ "$owner" = 0 ]; then
            chown 10001:10001 "$out"
        else
            uid="$owner"
            gid="$(stat -c %g "$out")"
        fi
    fi
    if [ "$hand_back" = 0 ]; then
        exec setpriv --reuid="$uid" --regid="$gid" --clear-groups --inh-caps=-all --bounding-set=-all \
            --no-new-privs mosaicd "$@"
    fi
    setpriv --reuid="$uid" --regid="$gid" --clear-groups --inh-caps=-all --bounding-set=-all \
        --no-new-privs mosaicd "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    trap 'kill -TERM "$child" 2>/dev/null || true' INT  # a background job ignores SIGINT: it is told as SIGTERM
    code=0
    wait "$child" || code=$?
    while kill -0 "$child" 2>/dev/null; do  # a signal passed on interrupted `wait`: wait for mosaicd's end
        code=0
        wait "$child" || code=$?
    done
    chown -R 0:0 "$out"
    rm -f "$lent"
    exit "$code"
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
# MOSAIC_SLOTS (compose's node service): a folder of slots on a named volume, one per replica. This container
# claims the lowest slot that no running container holds (a lock that mosaicd holds for its life: descriptor 9)
# and links it at MOSAIC_SLOT, where the node keeps its port and its checkpoints. So a replica recreated
# (`docker compose down` and `up`, a host restart) goes on as the node it was; `down -v` forgets them.
if [ -n "${MOSAIC_SLOTS:-}" ]; then
    i=0
    while :; do
        if [ "$i" -ge 100000 ]; then
            echo "mosaic-entrypoint: no free slot in $MOSAIC_SLOTS (MOSAIC_SLOTS) of 100000" >&2
            exit 1
        fi
        slot="$MOSAIC_SLOTS/$i"
        mkdir -p "$slot"
        exec 9>>"$slot/lock"
        if flock -n 9; then break; fi
        exec 9>&-
        i=$((i + 1))
    done
    link="${MOSAIC_SLOT:?MOSAIC_SLOT must name where the claimed slot of MOSAIC_SLOTS is linked}"
    mkdir -p "$(dirname "$link")"
    ln -sfn "$slot" "$link"
fi
exec mosaicd "$@"
