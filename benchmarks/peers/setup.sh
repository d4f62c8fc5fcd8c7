#!/usr/bin/env bash
# One virtual environment per peer loader for benchmarks/peers.py, under .peers/ at the
# repository's root (git-ignored): torch first (the pinned CPU build), then the peer from
# PyPI at the version its figures were measured with, then a check that torch is still
# the pinned one. Needs only PyPI. About five minutes on a 2-core machine.
#
#   benchmarks/peers/setup.sh [streaming] [litdata] [grain]     # default: all three
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEERS="${PEERS_DIR:-$ROOT/.peers}"
PY="${PY:-python3}"
TORCH="torch==2.13.0"

# peer -> the pip requirements it is measured with (torch is installed before them)
declare -A PACKAGES=(
    [streaming]="mosaicml-streaming==0.13.0"
    [litdata]="litdata==0.2.76"
    [grain]="grain==0.2.18"
)

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(streaming litdata grain)

for peer in "${peers[@]}"; do
    req="${PACKAGES[$peer]:-}"
    if [ -z "$req" ]; then
        echo "unknown peer: $peer (known: ${!PACKAGES[*]})" >&2
        exit 2
    fi
    venv="$PEERS/$peer"
    echo "== $peer: $venv ($req)"
    test -x "$venv/bin/python" || "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "$TORCH"
    "$venv/bin/pip" install -q "$TORCH" $req
    have="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    case "$have" in
        2.13.0*) ;;
        *) echo "$peer: pip replaced torch with $have" >&2; exit 1 ;;
    esac
    "$venv/bin/pip" freeze > "$venv/freeze.txt"
    echo "   torch $have; $(grep -iE "^(${req%%=*})==" "$venv/freeze.txt")"
done
