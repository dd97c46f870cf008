// A smoke test of extension.js without VS Code: `vscode` and `vscode-languageclient/node` are
// replaced by fakes that record what the extension asks of them. Run: node tests/extension.test.js
"use strict";

const assert = require("assert");
const fs = require("fs");
const Module = require("module");
const os = require("os");
const path = require("path");

// ---- fakes -------------------------------------------------------------------------------------

let settings = {};
const shown = [];
const clients = [];
const commands = new Map();
let configListener;

const vscode = {
    workspace: {
        workspaceFolders: undefined,
        getConfiguration: (section) => {
            assert.strictEqual(section, "dfc");
            return { get: (key) => settings[key] };
        },
        onDidChangeConfiguration: (listener) => {
            configListener = listener;
            return { dispose() {} };
        },
    },
    window: {
        createOutputChannel: (name) => ({ name, appendLine() {}, dispose() {} }),
        showErrorMessage: (message) => {
            shown.push(message);
            return Promise.resolve(undefined);
        },
    },
    commands: {
        registerCommand: (name, fn) => {
            commands.set(name, fn);
            return { dispose() {} };
        },
        executeCommand: () => Promise.resolve(),
    },
};

class LanguageClient {
    constructor(id, name, serverOptions, clientOptions) {
        Object.assign(this, { id, name, serverOptions, clientOptions, started: false, stopped: false });
        clients.push(this);
    }
    async start() {
        this.started = true;
    }
    async stop() {
        this.stopped = true;
    }
}
const languageClient = { LanguageClient, TransportKind: { stdio: 0, ipc: 1, pipe: 2, socket: 3 } };

const originalLoad = Module._load;
Module._load = function (request, parent, isMain) {
    if (request === "vscode") {
        return vscode;
    }
    if (request === "vscode-languageclient/node") {
        return languageClient;
    }
    return originalLoad.call(this, request, parent, isMain);
};

const extension = require("../extension.js");

// A fake `dfc` executable on a PATH of our own.
const bin = fs.mkdtempSync(path.join(os.tmpdir(), "dfc-vscode-test-"));
const fakeDfc = path.join(bin, process.platform === "win32" ? "dfc.cmd" : "dfc");
fs.writeFileSync(fakeDfc, "#!/bin/sh\nexit 0\n", { mode: 0o755 });
process.env.PATH = bin + path.delimiter + (process.env.PATH || "");

function context() {
    return { subscriptions: [] };
}

// ---- tests -------------------------------------------------------------------------------------

async function main() {
    // The defaults: `dfc lsp` over stdio, for dfc files on disk and untitled.
    settings = { "server.path": "dfc", "server.extraArgs": [] };
    const ctx = context();
    await extension.activate(ctx);
    assert.strictEqual(clients.length, 1);
    let client = clients[0];
    assert.strictEqual(client.id, "dfc");
    assert.ok(client.started);
    // No `transport`: stdio is the default, and TransportKind.stdio would append `--stdio`.
    assert.deepStrictEqual(client.serverOptions.run, { command: fakeDfc, args: ["lsp"] });
    assert.deepStrictEqual(client.clientOptions.documentSelector, [
        { scheme: "file", language: "dfc" },
        { scheme: "untitled", language: "dfc" },
    ]);
    assert.ok(commands.has("dfc.restartServer"));
    assert.deepStrictEqual(shown, []);

    // Extra arguments follow `lsp`; a change of the settings restarts the server.
    settings = { "server.path": fakeDfc, "server.extraArgs": ["--log", "debug"] };
    await configListener({ affectsConfiguration: (s) => s === "dfc.server" });
    assert.ok(client.stopped);
    assert.strictEqual(clients.length, 2);
    client = clients[1];
    assert.deepStrictEqual(client.serverOptions.run.args, ["lsp", "--log", "debug"]);
    assert.strictEqual(client.serverOptions.run.command, fakeDfc);

    // Other settings leave it alone.
    await configListener({ affectsConfiguration: (s) => s === "dfc.trace" });
    assert.strictEqual(clients.length, 2);

    // A missing binary: a clear message, no client.
    settings = { "server.path": "dfc-that-does-not-exist" };
    await commands.get("dfc.restartServer")();
    assert.ok(clients[1].stopped);
    assert.strictEqual(clients.length, 2);
    assert.strictEqual(shown.length, 1);
    assert.match(shown[0], /dfc-that-does-not-exist/);
    assert.match(shown[0], /dfc\.server\.path/);
    assert.match(shown[0], /PATH/);

    // A path that does not exist, and a directory, are not executables.
    assert.strictEqual(extension.resolveCommand(path.join(bin, "nope")), undefined);
    assert.strictEqual(extension.resolveCommand(bin), undefined);

    // deactivate stops the running client.
    settings = { "server.path": "dfc" };
    await commands.get("dfc.restartServer")();
    assert.strictEqual(clients.length, 3);
    await extension.deactivate();
    assert.ok(clients[2].stopped);

    fs.rmSync(bin, { recursive: true, force: true });
    console.log("✓ extension.js: starts `dfc lsp` on stdio, restarts on settings, reports a missing binary");
}

main().catch((error) => {
    console.error(error);
    process.exit(1);
});
