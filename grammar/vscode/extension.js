// The dfc extension for VS Code: starts `dfc lsp` (the dfc language server, on stdio) for .df
// files. Plain JavaScript, no build step.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const vscode = require("vscode");
const { LanguageClient } = require("vscode-languageclient/node");

/** @type {LanguageClient | undefined} */
let client;
/** @type {vscode.OutputChannel | undefined} */
let outputChannel;

/** The settings under `dfc.server`. */
function serverSettings() {
    const config = vscode.workspace.getConfiguration("dfc");
    const command = String(config.get("server.path") || "dfc").trim() || "dfc";
    const extraArgs = config.get("server.extraArgs") || [];
    return { command, extraArgs: Array.isArray(extraArgs) ? extraArgs.map(String) : [] };
}

/**
 * The executable `command` names, or undefined if there is none: a path (with `~/` expanded and a
 * relative path taken from the first workspace folder), or a bare name looked up on PATH.
 */
function resolveCommand(command) {
    if (command === "~" || command.startsWith("~/") || command.startsWith("~\\")) {
        command = path.join(os.homedir(), command.slice(1));
    }
    const isWindows = process.platform === "win32";
    const extensions = isWindows
        ? ["", ...(process.env.PATHEXT || ".EXE;.CMD;.BAT;.COM").split(";").filter(Boolean)]
        : [""];
    const isExecutable = (file) => {
        try {
            if (!fs.statSync(file).isFile()) {
                return false;
            }
            if (!isWindows) {
                fs.accessSync(file, fs.constants.X_OK);
            }
            return true;
        } catch {
            return false;
        }
    };
    const withExtensions = (file) => extensions.map((ext) => file + ext).find(isExecutable);

    if (command.includes("/") || (isWindows && command.includes("\\"))) {
        if (!path.isAbsolute(command)) {
            const folder = vscode.workspace.workspaceFolders && vscode.workspace.workspaceFolders[0];
            command = path.resolve(folder ? folder.uri.fsPath : process.cwd(), command);
        }
        return withExtensions(command);
    }
    for (const dir of (process.env.PATH || "").split(path.delimiter)) {
        if (dir) {
            const found = withExtensions(path.join(dir, command));
            if (found) {
                return found;
            }
        }
    }
    return undefined;
}

async function showNotFound(command) {
    const openSettings = "Open Settings";
    const choice = await vscode.window.showErrorMessage(
        `dfc: cannot start the language server: the executable \`${command}\` was not found. ` +
            "Put `dfc` on your PATH, or set `dfc.server.path` to the full path of the dfc binary " +
            "(for example target/release/dfc after `cargo build --release`).",
        openSettings
    );
    if (choice === openSettings) {
        await vscode.commands.executeCommand("workbench.action.openSettings", "dfc.server.path");
    }
}

async function startClient() {
    const { command, extraArgs } = serverSettings();
    const executable = resolveCommand(command);
    if (!executable) {
        void showNotFound(command);
        return;
    }

    // stdio is the client's default transport. It is left unset on purpose: with
    // `transport: TransportKind.stdio` vscode-languageclient appends `--stdio` to the arguments,
    // which `dfc lsp` does not take.
    const run = { command: executable, args: ["lsp", ...extraArgs] };
    /** @type {import("vscode-languageclient/node").ServerOptions} */
    const serverOptions = { run, debug: run };
    /** @type {import("vscode-languageclient/node").LanguageClientOptions} */
    const clientOptions = {
        documentSelector: [
            { scheme: "file", language: "dfc" },
            { scheme: "untitled", language: "dfc" },
        ],
        outputChannel,
    };

    client = new LanguageClient("dfc", "dfc Language Server", serverOptions, clientOptions);
    try {
        await client.start();
    } catch (error) {
        const message = error instanceof Error ? error.message : String(error);
        void vscode.window.showErrorMessage(
            `dfc: the language server (\`${executable} lsp\`) failed to start: ${message}. ` +
                "`dfc lsp` needs a dfc built with the language server; see the \"dfc\" output for details."
        );
        const failed = client;
        client = undefined;
        try {
            await failed.stop();
        } catch {
            // it never ran
        }
    }
}

async function stopClient() {
    const running = client;
    client = undefined;
    if (running) {
        await running.stop();
    }
}

async function restartClient() {
    await stopClient();
    await startClient();
}

/** @param {vscode.ExtensionContext} context */
async function activate(context) {
    outputChannel = vscode.window.createOutputChannel("dfc");
    context.subscriptions.push(outputChannel);
    context.subscriptions.push(vscode.commands.registerCommand("dfc.restartServer", restartClient));
    context.subscriptions.push(
        vscode.workspace.onDidChangeConfiguration((event) => {
            if (event.affectsConfiguration("dfc.server")) {
                return restartClient();
            }
            return undefined;
        })
    );
    await startClient();
}

function deactivate() {
    return stopClient();
}

module.exports = { activate, deactivate, resolveCommand };
