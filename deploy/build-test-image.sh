#!/usr/bin/env bash
# The image the container tests run (tests/docker, tests/hosts): the base image (deploy/build-base-image.sh, a no-op
# when it exists), ./wheels (deploy/build-wheels.sh, when it holds none), then deploy/Dockerfile on top.
# .ci/run starts it in the background while the quick tests run; the tests' fixtures run it again (a cache hit),
# waiting for a build under way through the same lock (at most 30 minutes, and they say so).
#
# Usage: deploy/build-test-image.sh [IMAGE [BASE]]   (defaults: $MOSAIC_TEST_IMAGE or mosaic:test,
#                                                      $MOSAIC_BASE or mosaic-base:bookworm)
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-${MOSAIC_TEST_IMAGE:-mosaic:test}}
base=${2:-${MOSAIC_BASE:-mosaic-base:bookworm}}
exec 9>.image-build.lock
if ! flock -n 9; then
    echo "deploy/build-test-image.sh: waiting for the image build under way (.image-build.lock), 30 minutes at most" >&2
    flock -w 1800 9 || { echo "deploy/build-test-image.sh: the build under way did not end in 30 minutes" >&2; exit 1; }
fi
if [ "$base" = "mosaic-base:bookworm" ]; then
    bash deploy/build-base-image.sh
fi
if ! compgen -G "wheels/*.whl" >/dev/null; then
    bash deploy/build-wheels.sh
fi
# The build stage is tagged too ($image-build): it is the next build's cache, and once tagged, every image an
# earlier build left untagged (the image this tag named before, its build stage) can go. Each CI run builds from a
# fresh clone, so without this every run left ~2.7 GB of untagged images behind until the disk filled.
before=$(docker image inspect --format '{{.Id}}' "$image" "$image-build" 2>/dev/null || true)
docker build -q --force-rm --build-arg "BASE=$base" -f deploy/Dockerfile --target project -t "$image-build" . >/dev/null
docker build -q --force-rm --build-arg "BASE=$base" -f deploy/Dockerfile -t "$image" . >/dev/null
docker image prune --force --filter label=org.mosaic-learning.stage >/dev/null
for id in $before; do  # an image of these tags from before the label, if now untagged and unused
    [ -z "$(docker image inspect --format '{{join .RepoTags ""}}' "$id" 2>/dev/null)" ] && docker rmi "$id" >/dev/null 2>&1 || true
done
echo "deploy/build-test-image.sh: $image built on $base"
