#!/bin/bash
# Prepares, on this machine, the wheels benchmarks/on_gpu.sh installs on a lent GPU machine, which
# reaches no package registry: every one listed in benchmarks/gpu_wheels.txt, for the machine's
# Python (GPU_PYTHON, 3.12 as last seen there; this machine's own to rehearse here), into .whl/
# (ignored by git; name it in the device tool's carry).
#
#   benchmarks/gpu_wheels.sh                    # for the GPU machine
#   GPU_PYTHON=3.11 benchmarks/gpu_wheels.sh    # to rehearse benchmarks/on_gpu.sh here
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${GPU_PYTHON:-3.12}
LIST=benchmarks/gpu_wheels.txt
DEST=.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$DEST" && mkdir -p "$DEST/always" "$DEST/cupti" "$DEST/if-missing"
group=""
while read -r line; do
    case "$line" in
        "# [always]"*) group=always ;;
        "# [cupti]"*) group=cupti ;;
        "# [if-missing]"*) group=if-missing ;;
        ""|"#"*) ;;
        *) [ -n "$group" ] || { echo "$LIST: $line comes before a group heading" >&2; exit 1; }
           echo "$group $line" ;;
    esac
done < "$LIST" > "$DEST/plan.txt"
download() {  # GROUP REQUIREMENT...
    local group=$1
    shift
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_25_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$DEST/$group" "$@" 2>&1 \
        | grep -v "^WARNING: Location" || true
}
# shellcheck disable=SC2046
download always $(awk '$1 == "always" {print $2}' "$DEST/plan.txt")
# shellcheck disable=SC2046
download if-missing $(awk '$1 == "if-missing" {print $2}' "$DEST/plan.txt")
for requirement in $(awk '$1 == "cupti" {print $2}' "$DEST/plan.txt"); do  # one release at a time
    download cupti "$requirement"
done
wanted=$(wc -l < "$DEST/plan.txt")
got=$(find "$DEST" -type f -name '*.whl' | wc -l)
size=$(du -sm "$DEST" | cut -f1)
echo "$got of $wanted wheels for Python $PYTHON_VERSION in $DEST ($size MiB; the device tool carries 64 MiB with the tree)"
[ "$got" -eq "$wanted" ] || { echo "some wheels are missing: see the pip errors above" >&2; exit 1; }
