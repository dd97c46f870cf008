// Checks that the TextMate grammar keeps up with the compiler, from the repository's sources:
//  - its built-in ops, optimizers and initializers are exactly those of
//    compiler/sema/src/builtins.rs (OPS, OPTIMIZERS, INITIALIZERS), and its learning-rate
//    schedules those of compiler/sema/src/schedule.rs (SCHEDULES);
//  - examples/*.df and the ```df blocks of docs/language.md highlight without an `invalid` token.
// Run: node tests/check-sync.js (from grammar/vscode). Outside the repository it skips.
"use strict";

const fs = require("fs");
const path = require("path");
const vsctm = require("vscode-textmate");
const oniguruma = require("vscode-oniguruma");

const here = path.resolve(__dirname, "..");
const root = path.resolve(here, "..", "..");
const grammarPath = path.join(here, "syntaxes", "dfc.tmLanguage.json");
const builtinsPath = path.join(root, "compiler", "sema", "src", "builtins.rs");
const schedulesPath = path.join(root, "compiler", "sema", "src", "schedule.rs");

const failures = [];

/** The names of a `pub const NAME: &[(&str, ...)] = &[ ... ];` table, or undefined. */
function rustTable(source, name) {
    const start = source.search(new RegExp(`pub const ${name}\\s*:`));
    if (start < 0) {
        return undefined;
    }
    const body = source.slice(source.indexOf("= &[", start), source.indexOf("\n];", start));
    return [...body.matchAll(/\(\s*"([A-Za-z_][A-Za-z0-9_]*)"/g)].map((m) => m[1]);
}

/** The names that the grammar's call rule with capture scope `scope` lists. */
function grammarNames(grammar, scope) {
    const rule = grammar.repository.calls.patterns.find((p) => p.captures["1"].name === scope);
    const alternation = /^\(\?<!\[[^\]]*\]\)\(\(\?:([^)]*)\)/.exec(rule.match);
    if (!alternation) {
        throw new Error(`cannot read the names of the ${scope} rule: ${rule.match}`);
    }
    return alternation[1].split("|");
}

function compare(what, inCompiler, inGrammar) {
    const a = new Set(inCompiler);
    const b = new Set(inGrammar);
    const missing = [...a].filter((n) => !b.has(n));
    const extra = [...b].filter((n) => !a.has(n));
    if (missing.length || extra.length) {
        failures.push(
            `${what}: the grammar (syntaxes/dfc.tmLanguage.json, repository.calls) ` +
                (missing.length ? `lacks ${missing.join(", ")}` : "") +
                (missing.length && extra.length ? " and " : "") +
                (extra.length ? `has ${extra.join(", ")}, which the compiler does not` : "")
        );
    } else {
        console.log(`✓ ${what}: the grammar's ${inGrammar.length} names are the compiler's`);
    }
}

async function tokenizer() {
    const wasm = fs.readFileSync(require.resolve("vscode-oniguruma/release/onig.wasm"));
    await oniguruma.loadWASM(wasm.buffer.slice(wasm.byteOffset, wasm.byteOffset + wasm.byteLength));
    const registry = new vsctm.Registry({
        onigLib: Promise.resolve({
            createOnigScanner: (sources) => new oniguruma.OnigScanner(sources),
            createOnigString: (s) => new oniguruma.OnigString(s),
        }),
        loadGrammar: async (scopeName) =>
            scopeName === "source.dfc"
                ? vsctm.parseRawGrammar(fs.readFileSync(grammarPath, "utf8"), grammarPath)
                : null,
    });
    return registry.loadGrammar("source.dfc");
}

/** The `invalid` tokens of `text`, as "line:column text". */
function invalidTokens(grammar, text) {
    const found = [];
    let state = vsctm.INITIAL;
    text.split(/\r?\n/).forEach((line, i) => {
        const result = grammar.tokenizeLine(line, state);
        for (const token of result.tokens) {
            if (token.scopes.some((s) => s.startsWith("invalid"))) {
                found.push(`${i + 1}:${token.startIndex + 1} ${JSON.stringify(line.slice(token.startIndex, token.endIndex))}`);
            }
        }
        state = result.ruleStack;
    });
    return found;
}

async function main() {
    if (!fs.existsSync(builtinsPath)) {
        console.log(`SKIPPED: ${builtinsPath} not found (not in the dfc repository)`);
        return;
    }
    const grammar = JSON.parse(fs.readFileSync(grammarPath, "utf8"));
    const builtins = fs.readFileSync(builtinsPath, "utf8");
    const schedules = fs.existsSync(schedulesPath) ? fs.readFileSync(schedulesPath, "utf8") : "";
    const tables = [
        ["OPS", "built-in ops", "support.function.builtin.dfc", builtins],
        ["OPTIMIZERS", "optimizers", "support.function.optimizer.dfc", builtins],
        ["INITIALIZERS", "initializers", "support.function.initializer.dfc", builtins],
        ["SCHEDULES", "learning-rate schedules", "support.function.schedule.dfc", schedules],
    ];
    for (const [table, what, scope, source] of tables) {
        const names = rustTable(source, table);
        if (names === undefined) {
            if (table === "OPS") {
                failures.push(`no \`pub const OPS\` in ${builtinsPath}`);
            } else {
                console.log(`- ${what}: no \`pub const ${table}\` in builtins.rs; not compared`);
            }
            continue;
        }
        compare(what, names, grammarNames(grammar, scope));
    }

    const tm = await tokenizer();
    const sources = [];
    const examples = path.join(root, "examples");
    for (const name of fs.readdirSync(examples).filter((n) => n.endsWith(".df")).sort()) {
        sources.push([`examples/${name}`, fs.readFileSync(path.join(examples, name), "utf8")]);
    }
    // Not docs/diagnostics.md: its examples are wrong on purpose (and `"gpu:0\g"` in it is
    // rightly an invalid escape).
    for (const name of ["language.md"]) {
        const text = fs.readFileSync(path.join(root, "docs", name), "utf8");
        let block = 0;
        for (const m of text.matchAll(/^```df\n([\s\S]*?)^```/gm)) {
            block += 1;
            sources.push([`docs/${name} (df block ${block})`, m[1]]);
        }
    }
    let clean = 0;
    for (const [name, text] of sources) {
        const bad = invalidTokens(tm, text);
        if (bad.length) {
            failures.push(`${name}: invalid tokens at ${bad.join(", ")}`);
        } else {
            clean += 1;
        }
    }
    console.log(`✓ ${clean} of ${sources.length} example files and df blocks of docs/language.md highlight without invalid tokens`);
}

main()
    .then(() => {
        if (failures.length) {
            for (const f of failures) {
                console.error(`✖ ${f}`);
            }
            process.exit(1);
        }
    })
    .catch((error) => {
        console.error(error);
        process.exit(1);
    });
