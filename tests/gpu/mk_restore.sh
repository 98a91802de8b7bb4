#!/usr/bin/env bash
# Build .gpu-carry/restore.{tgz,sh}: on the device, `bash .gpu-carry/restore.sh` turns the copied working tree into
# HEAD's tree (modified tracked files back to HEAD, untracked non-ignored files removed), so result JSONs record a
# committed tree while other engineers leave uncommitted files here.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"; mkdir -p .gpu-carry
mod=$(git diff --name-only HEAD; git diff --name-only --cached HEAD)
mod=$(echo "$mod" | sort -u | while read -r f; do [ -n "$f" ] && git cat-file -e "HEAD:$f" 2>/dev/null && echo "$f"; done || true)
untracked=$(git ls-files --others --exclude-standard)
added=$(git diff --name-only --cached --diff-filter=A HEAD)
rm -f .gpu-carry/restore.tgz
if [ -n "$mod" ]; then git archive --format=tar.gz -o .gpu-carry/restore.tgz HEAD -- $mod; fi
{
  echo "set -e"
  [ -n "$mod" ] && echo "tar -xzf .gpu-carry/restore.tgz"
  for f in $untracked $added; do printf 'rm -f %q\n' "$f"; done
  echo "echo restored to $(git rev-parse --short HEAD) tree $(git rev-parse HEAD^{tree})"
} > .gpu-carry/restore.sh
echo "modified: $(echo $mod | wc -w) untracked: $(echo $untracked $added | wc -w)"
