#!/usr/bin/env bash
# CI for the editor support in grammar/vscode: the VS Code extension's TextMate grammar tests
# (vscode-tmgrammar-test), a smoke test of extension.js, and a check that the grammar's built-in
# ops match the compiler's. Needs Node.js and npm (and the npm registry, for `npm ci`). Where npm
# is not installed it skips as a test does (tests/support/skip.rs): says SKIPPED, appends that to
# DFC_SKIP_LOG if set, and succeeds, unless DFC_REQUIRE lists npm. Run from anywhere; exits
# non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v npm >/dev/null 2>&1; then
    required="" listed=${DFC_REQUIRE:-}
    case ",${listed// /}," in *,npm,*) required=", required here" ;; esac
    line="SKIPPED editor-tests: npm is not installed; the grammar tests need Node.js and npm [npm$required]"
    echo "$line" >&2
    [ -z "${DFC_SKIP_LOG:-}" ] || echo "$line" >>"$DFC_SKIP_LOG"
    [ -z "$required" ] || exit 1
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
