//! `dfc lsp` end to end: a real LSP client (pygls, through pytest-lsp: tests/lsp/) drives the
//! binary through every feature, and a fuzz-style client sends thousands of random edits and
//! requests and checks that every one is answered and nothing panics.

#[path = "support/lsp_client.rs"]
mod lsp_client;
#[path = "support/skip.rs"]
mod skip;

use lsp_client::Client;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

const DFC: &str = env!("CARGO_BIN_EXE_dfc");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Python that has pytest-lsp: `DFC_LSP_PYTHON`, the virtual environment `.ci/run` makes
/// (target/lsp-venv), or the system's `python3`.
fn python_with_pytest_lsp() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("DFC_LSP_PYTHON").map(PathBuf::from),
        Some(root().join("target/lsp-venv/bin/python")),
        Some(PathBuf::from("python3")),
    ];
    candidates.into_iter().flatten().find(|python| {
        Command::new(python).args(["-c", "import pytest_lsp"]).output().is_ok_and(|o| o.status.success())
    })
}

#[test]
fn a_real_lsp_client_drives_every_feature() {
    let Some(python) = python_with_pytest_lsp() else {
        skip::skip(
            skip::Need::LspClient,
            "no Python with pytest-lsp (python3 -m venv target/lsp-venv && target/lsp-venv/bin/pip install -r tests/lsp/requirements.txt; .ci/run does)",
        );
        return;
    };
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/lsp"])
        .current_dir(root())
        .env("DFC_BIN", DFC)
        .output()
        .expect("run pytest");
    let report = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    println!("{report}");
    assert!(output.status.success(), "the LSP client's tests failed:\n{report}");
    assert!(report.contains(" passed") && !report.contains("skipped"), "{report}");
}

/// Text the fuzzer inserts: the language's tokens, fragments of statements, brackets left open,
/// comments and strings left unterminated, characters of two UTF-16 units.
const SNIPPETS: &[&str] = &[
    "",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "=",
    "==",
    "-",
    "@",
    "->",
    "<",
    ">",
    "\n",
    "\n\n",
    " ",
    "x",
    "h1",
    "relu(",
    "dense(",
    "let y = ",
    "param w: f32[3, 4] = zeros\n",
    "input z: u8[batch]\n",
    "@device(\"cpu:0\") ",
    "@partitioned(2) ",
    "model m {\n",
    "layer l(x: f32[n]) -> f32[n] {\n",
    "return x\n",
    "minimize loss with adam(",
    "0.5e-3",
    "1e999",
    "99999999999999999999",
    "\"",
    "\"/job:ps/task:0\"",
    "/*",
    "*/",
    "// note\n",
    "é",
    "𝄞",
    "\t",
    "cast<f32>(",
    "units = ",
    "f32[",
    "output ",
    "metric a = ",
    "dim batch = ",
    "device \"gpu:0\" {\n",
];

const REQUESTS: &[&str] = &[
    "textDocument/hover",
    "textDocument/completion",
    "textDocument/definition",
    "textDocument/references",
    "textDocument/prepareRename",
    "textDocument/rename",
    "textDocument/documentSymbol",
    "textDocument/semanticTokens/full",
    "textDocument/formatting",
];

fn random_position(rng: &mut fastrand::Rng) -> Value {
    // Mostly inside the text, sometimes far past its end.
    let (line, character) =
        if rng.u8(..10) == 0 { (rng.u32(..1000), rng.u32(..1000)) } else { (rng.u32(..40), rng.u32(..60)) };
    json!({ "line": line, "character": character })
}

#[test]
fn thousands_of_random_edits_never_crash_the_server() {
    let mut rng = fastrand::Rng::with_seed(0xdfc_15b);
    let mut client = Client::start(DFC);
    let examples: Vec<PathBuf> =
        ["mlp.df", "cnn.df", "wide_and_deep.df"].iter().map(|f| root().join("examples").join(f)).collect();
    let uris: Vec<String> = (0..examples.len()).map(|i| format!("file:///fuzz/{i}.df")).collect();
    for (path, uri) in examples.iter().zip(&uris) {
        let text = std::fs::read_to_string(path).expect("read example");
        client.notify(
            "textDocument/didOpen",
            json!({ "textDocument": { "uri": uri, "languageId": "dfc", "version": 1, "text": text } }),
        );
    }
    let (mut answered, mut refused) = (0, 0);
    let edits = 3000;
    for version in 2..edits + 2 {
        let uri = &uris[rng.usize(..uris.len())];
        let start = random_position(&mut rng);
        let end = if rng.bool() { start.clone() } else { random_position(&mut rng) };
        let text: String = (0..rng.usize(1..4)).map(|_| SNIPPETS[rng.usize(..SNIPPETS.len())]).collect();
        // A whole-text replacement now and then (and a reversed range, which must not panic).
        let change = if rng.u8(..50) == 0 {
            json!({ "text": text })
        } else {
            json!({ "range": { "start": start, "end": end }, "text": text })
        };
        client.notify(
            "textDocument/didChange",
            json!({ "textDocument": { "uri": uri, "version": version }, "contentChanges": [change] }),
        );
        if rng.u8(..4) != 0 {
            continue;
        }
        let method = REQUESTS[rng.usize(..REQUESTS.len())];
        let new_name = ["renamed", "x", "2bad", "relu", "let"][rng.usize(..5)];
        let mut params = json!({
            "textDocument": { "uri": uri },
            "position": random_position(&mut rng),
            "context": { "includeDeclaration": rng.bool() },
            "newName": new_name,
            "options": { "tabSize": 4, "insertSpaces": true },
        });
        // Malformed parameters now and then: an error answer, never a crash.
        if rng.u8(..20) == 0 {
            params = json!({ "textDocument": 42, "position": "here" });
        }
        let response = client.request(method, params);
        match &response.error {
            None => answered += 1,
            Some(error) => {
                assert_ne!(error.code, -32603, "{method} failed inside the server: {}", error.message);
                refused += 1;
            }
        }
    }
    let unknown = client.request("dfc/noSuchMethod", json!({}));
    assert_eq!(unknown.error.expect("an unknown method is an error").code, -32601);
    // Still answering, and with diagnostics for what the text has become.
    let symbols = client.request("textDocument/documentSymbol", json!({ "textDocument": { "uri": uris[0] } }));
    assert!(symbols.error.is_none(), "{symbols:?}");
    // Refusals are renames of what is not a name, malformed parameters and the like.
    println!("{answered} requests answered, {refused} refused");
    assert!(answered > 2 * refused / 3, "{answered} requests answered, {refused} refused");
    let status = client.stop();
    assert!(status.success(), "dfc lsp exited with {status}");
}

#[test]
fn diagnostics_follow_open_change_and_close() {
    let mut client = Client::start(DFC);
    let uri = "file:///tmp/m.df";
    let text = std::fs::read_to_string(root().join("examples/mlp.df")).unwrap();
    client.notify(
        "textDocument/didOpen",
        json!({ "textDocument": { "uri": uri, "languageId": "dfc", "version": 1, "text": text } }),
    );
    let published = client.diagnostics();
    assert_eq!(published["diagnostics"], json!([]), "{published}");
    assert_eq!(published["version"], 1);
    // Break a name: one E0101 at exactly that name, with its help line.
    let at = text.find("one_hot(labels").unwrap() + "one_hot(".len();
    let (line, character) = line_and_character(&text, at);
    client.notify(
        "textDocument/didChange",
        json!({ "textDocument": { "uri": uri, "version": 2 }, "contentChanges": [{
            "range": { "start": { "line": line, "character": character }, "end": { "line": line, "character": character + 6 } },
            "text": "lables"
        }] }),
    );
    let published = client.diagnostics();
    let diagnostics = published["diagnostics"].as_array().unwrap();
    assert_eq!(diagnostics.len(), 1, "{published}");
    assert_eq!(diagnostics[0]["code"], "E0101");
    assert_eq!(diagnostics[0]["range"]["start"], json!({ "line": line, "character": character }));
    assert_eq!(diagnostics[0]["range"]["end"], json!({ "line": line, "character": character + 6 }));
    assert!(diagnostics[0]["message"].as_str().unwrap().contains("help: did you mean `labels`?"), "{published}");
    assert_eq!(published["version"], 2);
    client.notify("textDocument/didClose", json!({ "textDocument": { "uri": uri } }));
    let published = client.diagnostics();
    assert_eq!(published["diagnostics"], json!([]), "closing clears: {published}");
    assert!(client.stop().success());
}

/// Zero-based line and character (ASCII text) of a byte offset.
fn line_and_character(text: &str, offset: usize) -> (usize, usize) {
    let line = text[..offset].matches('\n').count();
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    (line, offset - start)
}

/// A client's headers are read within bounds: a `Content-Length` of 100 GB, or a header line
/// that never ends, ends the session at once with a message naming it (the transport of
/// lsp-server, which dfc no longer uses for stdio, would have allocated the 100 GB).
#[test]
fn hostile_headers_end_the_session_with_a_message() {
    use std::io::Write;
    let cases: [(&[u8], &str); 2] = [
        (b"Content-Length: 100000000000\r\n\r\n", "Content-Length 100000000000: a body of 0 to 64 MiB"),
        (&[b'x'; 100_000], "a header line longer than 8 KiB"),
    ];
    for (input, expected) in cases {
        let mut server = Command::new(env!("CARGO_BIN_EXE_dfc"))
            .arg("lsp")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start dfc lsp");
        let mut stdin = server.stdin.take().unwrap();
        // The server may stop reading (and close its end) before the whole input is written.
        let _ = stdin.write_all(input);
        let started = std::time::Instant::now();
        while server.try_wait().unwrap().is_none() {
            assert!(started.elapsed().as_secs() < 30, "dfc lsp still runs 30 s after {expected:?}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        drop(stdin);
        let output = server.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
}
