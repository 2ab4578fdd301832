#!/usr/bin/env bash
# Install the pinned Zellij once into a cache directory and print the binary's
# path (see tests/install-tools.sh).
exec "$(dirname "$0")/install-tools.sh" zellij "$@"
