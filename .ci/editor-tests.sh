#!/usr/bin/env bash
# CI for the editor support in grammar/vscode: the VS Code extension's TextMate grammar tests
# (vscode-tmgrammar-test), a smoke test of extension.js, and a check that the grammar's built-in
# ops match the compiler's. Needs Node.js and npm (and the npm registry, for `npm ci`); prints
# SKIPPED and succeeds only where npm is not installed. Run from anywhere; exits non-zero on any
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v npm >/dev/null 2>&1; then
    echo "editor tests: SKIPPED (npm is not installed; the grammar tests need Node.js and npm)"
    exit 0
fi
echo "editor tests: node $(node --version), npm $(npm --version 2>/dev/null)"

node --check grammar/vscode/extension.js

cd grammar/vscode
# One retry: npm ci has failed here mid-extraction (ENOENT under node_modules) and passed again.
npm ci --no-audit --no-fund || { echo "editor tests: npm ci failed; retrying once" >&2; rm -rf node_modules; npm ci --no-audit --no-fund; }
npm test
npm run --silent test:extension
npm run --silent test:sync
echo "editor tests: passed"
