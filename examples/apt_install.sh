#!/usr/bin/env bash
# Installs Debian packages with apt-get (through sudo unless root): the example scripts' way to
# get the data they train on when it is missing.
#
#   examples/apt_install.sh PACKAGE...
set -euo pipefail
echo "installing Debian's $*" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
