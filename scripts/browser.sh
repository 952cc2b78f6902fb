#!/usr/bin/env bash
# Debian's Chromium for the browser tests (tests/entrypoints/test_web_browser.py, driven by
# Playwright from the dev extra), where it is missing. Fonts come with it, so pages render text.
set -euo pipefail
if command -v chromium >/dev/null; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
