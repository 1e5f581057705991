#!/usr/bin/env bash
# colo's Debian package and its wheel, from this source tree, in one command:
#
#   packaging/build-deb.sh [OUTDIR]          (default: dist/ in the tree)
#
# Writes OUTDIR/colo-gpu_VERSION_ARCH.deb and OUTDIR/colo_gpu-VERSION-py3-none-manylinux_X_Y_ARCH.whl.
# The package holds colo in an environment of its own, /opt/colo (a venv of Debian's python3 with
# colo's Python dependencies from PyPI, fetched now), the systemd unit, /etc/colo/colo.toml (a
# conffile that holds only what the admin changes), /usr/share/colo/colo.toml (every key with its
# default: the reference), /usr/bin/colo and colo-fakegpu, and /usr/lib/colo/ (the SPANK plugin, the interposer,
# Slurm's health check).
# docs/install.md says what each file is. Needs: Debian's python3 with venv (python3-venv), make, a
# C compiler, dpkg-deb, git, and libslurm-dev for the SPANK plugin (left out without it, with a warning).
set -euo pipefail
# the package's environment is built from this tree alone: a caller's PYTHONPATH (a source tree
# with its colo_gpu.egg-info) made pip take colo as installed already, and the .deb had no colo
unset PYTHONPATH PYTHONHOME

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$REPO/dist}")
PY=${COLO_DEB_PYTHON:-/usr/bin/python3}  # the package runs on this Python: Debian's own
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ARCH=$(dpkg --print-architecture)
PREFIX=/opt/colo
MAINTAINER=${COLO_DEB_MAINTAINER:-colo maintainers <colo@localhost>}  # set yours: lintian flags localhost

for tool in make dpkg-deb git "${CC:-cc}"; do
  command -v "$tool" >/dev/null || { echo "build-deb: $tool is missing (apt-get install make gcc dpkg-dev git)" >&2; exit 1; }
done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root

# 1. The source as git sees it (tracked and new files; nothing .gitignore leaves out: no build
#    outputs, no venvs), so what is built is what a clone holds.
mkdir -p "$WORK/src"
git -C "$REPO" ls-files -z --cached --others --exclude-standard |
  (cd "$REPO" && "$PY" -c 'import os, sys; [print(p) for p in sys.stdin.read().split("\0") if p and os.path.lexists(p)]') |
  tar -C "$REPO" -cf - -T - | tar -xf - -C "$WORK/src"
VERSION=$("$PY" -c 'import ast, sys; t = ast.parse(open(sys.argv[1]).read()); print(next(n.value.value for n in t.body if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"))' "$WORK/src/colo/__init__.py")

# 2. colo's environment, made where it will be installed from here on (paths fixed in step 3), on
#    python3.X itself: a later default python3 of another version leaves it working.
"/usr/bin/python$PYVER" -m venv "$ROOT$PREFIX"
VPY=$ROOT$PREFIX/bin/python3
"$VPY" -m pip wheel -q --no-deps -w "$WORK/wheel" "$WORK/src"
WHEEL=$(ls "$WORK"/wheel/colo_gpu-*.whl)
"$VPY" -m pip install -q --no-compile "$WHEEL"
# setuptools came with the venv (python3.11's ensurepip), not with colo, and nothing colo runs needs
# it; its distutils-precedence.pth ran at every start of every colo command (~0.5-1 ms of a ~20 ms
# `colo ls`: bench/peers_bench.py; issue 41)
"$VPY" -m pip uninstall -q -y setuptools
[ -e "$ROOT$PREFIX/lib/python$PYVER/site-packages/colo/_native/colo_spank.so" ] ||
  echo "build-deb: warning: no SPANK plugin (Slurm's headers are missing: apt-get install libslurm-dev)" >&2

# 3. Relocate: the venv's scripts and activate files name the staging folder; make them name /opt/colo.
grep -rlIF "$ROOT$PREFIX" "$ROOT$PREFIX" | while read -r f; do sed -i "s#$ROOT$PREFIX#$PREFIX#g" "$f"; done
find "$ROOT$PREFIX" -name direct_url.json -delete  # the build's wheel path: nothing an admin needs
find "$ROOT$PREFIX" -name __pycache__ -prune -exec rm -rf {} +
# compiled now (users cannot write under /opt/colo), naming the installed paths in tracebacks
"$VPY" -m compileall -q -j 0 -s "$ROOT" -p / "$ROOT$PREFIX/lib" >/dev/null
# colo's own binaries stripped (debug symbols are for a build tree); the dependencies' wheels are
# left as PyPI ships them: some are patched by auditwheel, which strip can break
find "$ROOT$PREFIX" -type f -name '*.so*' -exec chmod a-x {} +  # libraries are loaded, not run
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$ROOT$PREFIX/bin/colo"  # (compiled: native/client)
find "$ROOT$PREFIX" -path '*/colo/_native/*' -type f | while read -r f; do
  if head -c 4 "$f" | grep -q 'ELF'; then strip --strip-unneeded --remove-section=.comment --remove-section=.note "$f"; fi
done

# 4. The rest of the layout (docs/install.md lists each file).
SITE=$PREFIX/lib/python$PYVER/site-packages
install -d "$ROOT/usr/bin" "$ROOT/usr/lib/colo" "$ROOT/etc/colo" "$ROOT/lib/systemd/system" \
  "$ROOT/usr/share/doc/colo-gpu" "$ROOT/usr/share/colo" "$ROOT/usr/share/lintian/overrides"
ln -s "$PREFIX/bin/colo" "$ROOT/usr/bin/colo"
ln -s "$PREFIX/bin/colo-fakegpu" "$ROOT/usr/bin/colo-fakegpu"
ln -s "$SITE/colo/_native/libcolo-interpose.so" "$ROOT/usr/lib/colo/libcolo-interpose.so"
if [ -e "$ROOT$SITE/colo/_native/colo_spank.so" ]; then
  ln -s "$SITE/colo/_native/colo_spank.so" "$ROOT/usr/lib/colo/colo_spank.so"
fi
install -m 0755 "$WORK/src/packaging/slurm-healthcheck" "$ROOT/usr/lib/colo/slurm-healthcheck"  # HealthCheckProgram
install -m 0644 "$WORK/src/packaging/colo.service" "$ROOT/lib/systemd/system/colo.service"
# /etc holds what the admin changes, and never changes itself: dpkg asks about a conffile only
# when both the admin and the package changed it, so an upgrade never stops to ask. The defaults
# are colo's own; the reference of every key is in /usr/share, updated freely.
install -m 0644 "$WORK/src/packaging/colo-etc.toml" "$ROOT/etc/colo/colo.toml"
install -m 0644 "$WORK/src/packaging/colo.toml" "$ROOT/usr/share/colo/colo.toml"
install -m 0644 "$WORK/src/packaging/debian/lintian-overrides" "$ROOT/usr/share/lintian/overrides/colo-gpu"
install -m 0644 "$WORK/src/README.md" "$WORK/src/docs/install.md" "$WORK/src/docs/slurm.md" "$ROOT/usr/share/doc/colo-gpu/"
# man pages made from the CLI's own definitions (colo/cli/manpage.py: they say what --help says),
# and the shells' completion scripts, as the CLI itself writes them (typer's, answered by colo)
install -d "$ROOT/usr/share/man/man1" "$ROOT/usr/share/bash-completion/completions" \
  "$ROOT/usr/share/zsh/vendor-completions" "$ROOT/usr/share/fish/vendor_completions.d"
COLUMNS=80 "$VPY" -m colo.cli.manpage "$ROOT/usr/share/man/man1"
gzip -9n "$ROOT"/usr/share/man/man1/*.1
chmod 0644 "$ROOT"/usr/share/man/man1/*.1.gz
for sh in bash zsh fish; do
  case $sh in bash) to=usr/share/bash-completion/completions/colo ;; zsh) to=usr/share/zsh/vendor-completions/_colo ;;
               fish) to=usr/share/fish/vendor_completions.d/colo.fish ;; esac
  _COLO_COMPLETE=source_$sh "$VPY" -c 'import sys; sys.argv[0] = "colo"; from colo.cli.entry import main; main()' \
    > "$ROOT/$to"
  [ -s "$ROOT/$to" ] || { echo "build-deb: no $sh completion script came out" >&2; exit 1; }
  chmod 0644 "$ROOT/$to"
done
YEARS=$(git -C "$REPO" log --format=%cd --date=format:%Y 2>/dev/null | sort -u | sed -n '1p;$p' | uniq | paste -sd- || true)
printf 'colo (colo-gpu on PyPI)\nCopyright (c) %s the colo authors\nLicense: MIT\nPython dependencies in %s: see %s/bin/pip list\n' \
  "${YEARS:-$(date +%Y)}" "$PREFIX" "$PREFIX" \
  > "$ROOT/usr/share/doc/colo-gpu/copyright"

# 5. Package metadata: the wheel's tag says the newest glibc its binaries need.
GLIBC=$(basename "$WHEEL" | sed -n 's/.*manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p')
install -d "$ROOT/DEBIAN"
cat > "$ROOT/DEBIAN/control" <<EOF
Package: colo-gpu
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Section: admin
Priority: optional
Depends: python$PYVER, libc6${GLIBC:+ (>= $GLIBC)}, procps
Suggests: docker.io | docker-ce, slurmd
Installed-Size: $(du -sk "$ROOT" | cut -f1)
Description: share one node's GPUs safely: budgets, MPS or time-slicing, a queue
 colo queues container and process jobs with a GPU-memory budget and starts
 each as soon as it fits, as an MPS client or time-sliced, from stored profiles
 of what jobs do; a compiled interposer holds every job to its budget. Its own
 Python environment is in $PREFIX.
EOF
echo /etc/colo/colo.toml > "$ROOT/DEBIAN/conffiles"
# the changelog Debian packages carry (here: the commit it was built from)
printf 'colo-gpu (%s) unstable; urgency=medium\n\n  * Built from git %s.\n\n -- %s  %s\n' "$VERSION" \
  "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$MAINTAINER" \
  "$(date -R -d "@${SOURCE_DATE_EPOCH:-$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || date +%s)}")" |
  gzip -9n > "$ROOT/usr/share/doc/colo-gpu/changelog.gz"
chmod 0644 "$ROOT/usr/share/doc/colo-gpu/changelog.gz"
install -m 0755 "$WORK/src/packaging/debian/postinst" "$WORK/src/packaging/debian/prerm" \
  "$WORK/src/packaging/debian/postrm" "$ROOT/DEBIAN/"

mkdir -p "$OUT"
DEB=$OUT/colo-gpu_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zgzip -z6 --build "$ROOT" "$DEB" >/dev/null
cp "$WHEEL" "$OUT/"
echo "$DEB"
echo "$OUT/$(basename "$WHEEL")"
