#!/usr/bin/env bash
# Print the Debian archive mirror this machine's apt already uses, e.g. for debootstrap
# (deploy/build-base-image.sh) or to fetch a package of another Debian suite (.ci/run).
#
# Usage: deploy/apt-mirror.sh
# Reads apt's own source files: Dir::Etc::SourceList (one-line "deb [opts] URI SUITE COMP..." entries)
# and the *.list and *.sources files of Dir::Etc::SourceParts (*.sources: deb822 stanzas, "Types:",
# "URIs:", "Enabled:"), by default /etc/apt/sources.list and /etc/apt/sources.list.d/. Files with
# other suffixes (disabled ones) are not read. Prints the first http(s) URI of an enabled "deb" entry
# whose path ends in /debian (so neither debian-security nor a third-party repository), without a
# trailing slash, and exits 0. Exits 1 with a message naming the files read when there is none:
# no mirror is assumed.
set -euo pipefail

die() { printf 'apt-mirror: %s\n' "$*" >&2; exit 1; }

# Where apt reads its sources (apt-config resolves Dir, Dir::Etc and the two entries).
SOURCE_LIST=/etc/apt/sources.list
SOURCE_PARTS=/etc/apt/sources.list.d
if command -v apt-config >/dev/null 2>&1; then
    eval "$(apt-config shell SOURCE_LIST Dir::Etc::SourceList/f SOURCE_PARTS Dir::Etc::SourceParts/d 2>/dev/null || true)"
fi
SOURCE_PARTS="${SOURCE_PARTS%/}"

files=()
[[ -f $SOURCE_LIST ]] && files+=("$SOURCE_LIST")
for f in "$SOURCE_PARTS"/*.list "$SOURCE_PARTS"/*.sources; do
    [[ -f $f ]] && files+=("$f")
done
looked_for="an enabled 'deb' entry with an http(s) URI ending in /debian (not -security)"
[[ ${#files[@]} -gt 0 ]] || die "no apt source files ($SOURCE_LIST, $SOURCE_PARTS/*.list, $SOURCE_PARTS/*.sources); looked for $looked_for"

mirror="$(awk '
    function flush() {
        if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
            n = split(uris, u, /[ \t]+/)
            for (i = 1; i <= n; i++) if (u[i] != "") print u[i]
        }
        types = uris = ""; enabled = ""
    }
    FNR == 1 { flush() }
    /^[ \t]*#/ { next }
    FILENAME ~ /\.sources$/ {
        if ($0 ~ /^[ \t]*$/) { flush(); next }
        key = tolower($1); sub(/^[^:]*:[ \t]*/, "")
        if (key == "types:") types = $0
        else if (key == "uris:") uris = $0
        else if (key == "enabled:") enabled = tolower($0)
        next
    }
    $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if (i <= NF) print $i
    }
    END { flush() }
' "${files[@]}" | grep -E '^https?://' | grep -v -- '-security' | grep -E '/debian/?$' | head -n1 || true)"

[[ -n $mirror ]] || die "no Debian mirror in apt's sources (read: ${files[*]}); looked for $looked_for"
printf '%s\n' "${mirror%/}"
