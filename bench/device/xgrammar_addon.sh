#!/usr/bin/env bash
# Make .device-xgr/: xgrammar and apache-tvm-ffi taken from a full device bundle (.device-ray/,
# which brings them) as a 3 MB add-on, so a call can carry a bundle without them (.device-ray-small)
# plus this and stay within the 64 MiB the tree travels in. Run from the project root, here.
set -euo pipefail
full=${1:-.device-ray}/site.tar.xz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xJf "$full" -C "$work" --wildcards 'site/xgrammar*' 'site/tvm_ffi*' 'site/apache_tvm_ffi*'
mkdir -p .device-xgr
tar cf - -C "$work" site | xz -T0 -6 > .device-xgr/site.tar.xz
cat > .device-xgr/activate.sh <<'ACT'
# xgrammar and apache-tvm-ffi for the GPU machine, after the main bundle on PYTHONPATH.
_x=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -d /tmp/device-xgr/site ] || { mkdir -p /tmp/device-xgr && tar xJf "$_x/site.tar.xz" -C /tmp/device-xgr; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/device-xgr/site"
ACT
git_dir=$(git rev-parse --git-dir)
grep -qx "/.device-xgr/" "$git_dir/info/exclude" 2>/dev/null || echo "/.device-xgr/" >> "$git_dir/info/exclude"
du -sh .device-xgr/site.tar.xz
