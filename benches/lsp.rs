//! How fast `dfc lsp` answers on a large file: a generated 2,000-line model (layers and a long
//! chain of lets), opened in the real server over stdio. Per case, the median and the 90th
//! percentile of 30 rounds:
//!
//! - diagnostics: from sending a one-character edit to receiving its publishDiagnostics (the
//!   whole file re-parsed and re-analysed);
//! - hover, completion, definition and semantic tokens right after an edit (so each includes
//!   the re-analysis);
//! - the analysis alone, in process (`dfc_ide::FileAnalysis::new`).
//!
//! `cargo bench --bench lsp` (optimised build). Not a test: nothing is asserted.

#[path = "../tests/support/lsp_client.rs"]
mod lsp_client;

use serde_json::json;
use std::time::Instant;

/// About `lines` lines: a few layers, then a chain of lets through them.
fn model(lines: usize) -> String {
    let mut text = String::from(
        "// A generated model for the language server's latency benchmark.\n\
         layer dense(x: f32[n, k], units: dim) -> f32[n, units] {\n    param w: f32[k, units] = glorot_uniform\n    param b: f32[units] = zeros\n    return x @ w + b\n}\n\n\
         layer block(x: f32[n, k]) -> f32[n, k] {\n    let h = relu(dense(x, units = k))\n    return x + h\n}\n\n\
         model big {\n    dim batch = 32\n    input x: f32[batch, 16]\n    input y: f32[batch, 16]\n    let h0 = x\n",
    );
    let fixed = text.lines().count() + 4;
    let chain = lines.saturating_sub(fixed);
    for i in 1..=chain {
        let line = match i % 4 {
            0 => format!("    let h{i} = block(h{})\n", i - 1),
            1 => format!("    let h{i} = tanh(h{}) * 0.5\n", i - 1),
            2 => format!("    let h{i} = h{} + sigmoid(h{})\n", i - 1, i - 1),
            _ => format!("    let h{i} = dense(h{}, units = 16)\n", i - 1),
        };
        text += &line;
    }
    text += &format!("    let loss = mean((h{chain} - y) * (h{chain} - y))\n    output h{chain}\n    minimize loss with adam(lr = 0.001)\n}}\n");
    text
}

fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let rounds = 30;
    let source = model(2000);
    let n_lines = source.lines().count();
    let middle = n_lines / 2;
    println!("{n_lines}-line file, {rounds} rounds; milliseconds");
    println!("{:<28} {:>8} {:>8}", "case", "median", "p90");
    let report = |name: &str, times: Vec<f64>| {
        println!("{name:<28} {:>8.1} {:>8.1}", percentile(times.clone(), 0.5) * 1e3, percentile(times, 0.9) * 1e3);
    };

    let mut times = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        let analysis = dfc_ide::FileAnalysis::new(source.clone());
        times.push(start.elapsed().as_secs_f64());
        assert!(analysis.diagnostics.iter().all(|d| !d.is_error()), "{:?}", analysis.diagnostics.first());
    }
    report("analysis in process", times);

    let mut client = lsp_client::Client::start(env!("CARGO_BIN_EXE_dfc"));
    let uri = "file:///bench/big.df";
    client.notify(
        "textDocument/didOpen",
        json!({ "textDocument": { "uri": uri, "languageId": "dfc", "version": 1, "text": source } }),
    );
    let published = client.diagnostics();
    assert_eq!(published["diagnostics"], json!([]), "the generated model checks cleanly");

    // An edit in the middle of the file that keeps it valid: `* 0.5` ↔ `* 0.6` on a tanh line.
    let tanh_line = (middle..n_lines).find(|&l| source.lines().nth(l).is_some_and(|t| t.contains("* 0.5"))).unwrap();
    let column = source.lines().nth(tanh_line).unwrap().find("0.5").unwrap() + 2;
    let mut version = 1;
    let mut edit = |client: &mut lsp_client::Client| {
        version += 1;
        let digit = if version % 2 == 0 { "6" } else { "5" };
        client.notify(
            "textDocument/didChange",
            json!({ "textDocument": { "uri": uri, "version": version }, "contentChanges": [{
                "range": { "start": { "line": tanh_line, "character": column }, "end": { "line": tanh_line, "character": column + 1 } },
                "text": digit
            }] }),
        );
    };

    let mut times = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        edit(&mut client);
        let published = client.diagnostics();
        times.push(start.elapsed().as_secs_f64());
        assert_eq!(published["diagnostics"], json!([]));
    }
    report("edit → diagnostics", times);

    let position = json!({ "line": tanh_line, "character": 9 });
    let cases = [
        ("edit → hover", "textDocument/hover", json!({ "textDocument": { "uri": uri }, "position": position })),
        (
            "edit → completion",
            "textDocument/completion",
            json!({ "textDocument": { "uri": uri }, "position": position }),
        ),
        (
            "edit → definition",
            "textDocument/definition",
            json!({ "textDocument": { "uri": uri }, "position": position }),
        ),
        ("edit → semantic tokens", "textDocument/semanticTokens/full", json!({ "textDocument": { "uri": uri } })),
    ];
    for (name, method, params) in cases {
        let mut times = Vec::new();
        for _ in 0..rounds {
            let start = Instant::now();
            edit(&mut client);
            let response = client.request(method, params.clone());
            times.push(start.elapsed().as_secs_f64());
            assert!(response.error.is_none(), "{method}: {response:?}");
        }
        report(name, times);
        client.notifications.clear();
    }
    assert!(client.stop().success());
}
