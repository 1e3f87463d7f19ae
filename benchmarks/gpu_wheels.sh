#!/bin/bash
# Prepares, on this machine, the wheels benchmarks/on_gpu.sh installs on a lent GPU machine, which
# reaches no package registry: every one listed in benchmarks/gpu_wheels.txt, for the machine's
# Python (GPU_PYTHON, 3.12 as last seen there; this machine's own to rehearse here), into .whl/
# (ignored by git; name it in the device tool's carry). Where this machine has that Python too, it
# also builds xsp's C extensions for it (.whl/prebuilt.tar): on_gpu.sh uses them only if they do
# not build there.
#
#   benchmarks/gpu_wheels.sh                    # for the GPU machine
#   GPU_PYTHON=3.11 benchmarks/gpu_wheels.sh    # to rehearse benchmarks/on_gpu.sh here
#   WHEEL_GROUPS="always cupti pm if-missing" benchmarks/gpu_wheels.sh   # also transformers, for an image without
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${GPU_PYTHON:-3.12}
LIST=benchmarks/gpu_wheels.txt
DEST=.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# if-missing (transformers and its needs, 26 MiB) only when asked: the image has transformers, and
# with it the wheels and the tree would pass the 64 MiB the device tool carries
GROUPS_WANTED=" ${WHEEL_GROUPS:-always cupti pm} "
rm -rf "$DEST" && mkdir -p "$DEST/always" "$DEST/cupti" "$DEST/pm" "$DEST/if-missing"
group=""
while read -r line; do
    case "$line" in
        "# [always]"*) group=always ;;
        "# [cupti]"*) group=cupti ;;
        "# [pm]"*) group=pm ;;
        "# [if-missing]"*) group=if-missing ;;
        ""|"#"*) ;;
        *) [ -n "$group" ] || { echo "$LIST: $line comes before a group heading" >&2; exit 1; }
           [[ "$GROUPS_WANTED" == *" $group "* ]] && echo "$group $line" ;;
    esac
done < "$LIST" > "$DEST/plan.txt"
download() {  # GROUP REQUIREMENT...
    local group=$1
    shift
    [ $# -gt 0 ] || return 0
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
# shellcheck disable=SC2046
download pm $(awk '$1 == "pm" {print $2}' "$DEST/plan.txt")
for requirement in $(awk '$1 == "cupti" {print $2}' "$DEST/plan.txt"); do  # one release at a time
    download cupti "$requirement"
done
python=""
for candidate in "python$PYTHON_VERSION" "$HOME"/.pyenv/versions/"$PYTHON_VERSION".*/bin/python; do
    "$candidate" -c "import sys" 2>/dev/null && { python=$candidate; break; }
done
if [ -n "$python" ]; then
    scratch=$(mktemp -d)
    "$python" -m pip install --quiet --no-index --no-deps --target "$scratch/site" "$DEST"/always/setuptools-*.whl \
        2>&1 | grep -v "^WARNING" || true
    if PYTHONPATH="$scratch/site" "$python" -c 'from setuptools import setup; setup()' build_ext \
            --build-lib "$scratch/lib" --build-temp "$scratch/temp" > "$scratch/build.log" 2>&1; then
        (cd "$scratch/lib" && find . -name '*.so' | tar -cf - -T -) > "$DEST/prebuilt.tar"
        echo "C extensions built for Python $PYTHON_VERSION: $(tar -tf "$DEST/prebuilt.tar" | wc -l) in $DEST/prebuilt.tar"
    else
        echo "the C extensions did not build for Python $PYTHON_VERSION here (on_gpu.sh builds them there)"
    fi
    rm -rf "$scratch"
fi
wanted=$(wc -l < "$DEST/plan.txt")
got=$(find "$DEST" -type f -name '*.whl' | wc -l)
size=$(du -sm "$DEST" | cut -f1)
echo "$got of $wanted wheels for Python $PYTHON_VERSION in $DEST ($size MiB; the device tool carries 64 MiB with the tree)"
[ "$got" -eq "$wanted" ] || { echo "some wheels are missing: see the pip errors above" >&2; exit 1; }
