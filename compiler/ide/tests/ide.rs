//! Editor answers on small files. A fixture marks the cursor with `$0`; expectations are
//! `expect![[...]]` blocks that `UPDATE_EXPECT=1 cargo test -p dfc-ide` rewrites.

use dfc_ide::FileAnalysis;
use expect_test::{expect, Expect};

const MLP: &str = r#"// An MLP.
layer dense(x: f32[n, k], units: dim) -> f32[n, units] {
    param w: f32[k, units] = glorot_uniform
    param b: f32[units] = zeros
    return x @ w + b
}

model mlp {
    dim batch = 128
    input images: u8[batch, 28, 28]
    input labels: i32[batch]
    device "/job:ps/task:0" {
        param scale: f32 = 1.0
    }
    let x      = flatten(cast<f32>(images) / 255.0) * scale
    let h1     = relu(dense(x, units = 256))
    let logits = dense(h1, units = 10)
    let loss   = mean(softmax_cross_entropy(logits, one_hot(labels, 10)))
    output logits
    minimize loss with sgd(lr = 0.01)
}
"#;

/// The analysis of `fixture` without its `$0`, and the cursor's offset.
fn at(fixture: &str) -> (FileAnalysis, usize) {
    let offset = fixture.find("$0").expect("the fixture marks the cursor with $0");
    (FileAnalysis::new(fixture.replacen("$0", "", 1)), offset)
}

/// `MLP` with the cursor just before the `n`-th (from 1) occurrence of `needle`.
fn mlp_at(needle: &str, n: usize) -> String {
    let (i, _) = MLP.match_indices(needle).nth(n - 1).unwrap_or_else(|| panic!("no {n}th `{needle}`"));
    format!("{}$0{}", &MLP[..i], &MLP[i..])
}

fn check_hover(fixture: &str, expect: Expect) {
    let (analysis, offset) = at(fixture);
    let actual = match analysis.hover(offset) {
        Some(hover) => format!("{}\n---\n{}", analysis.text(hover.span), hover.markdown),
        None => "no hover".to_string(),
    };
    expect.assert_eq(&actual);
}

#[test]
fn hover_shows_the_shape_of_a_name() {
    check_hover(
        &mlp_at("h1,", 1),
        expect![[r#"
            h1
            ---
            ```dfc
            let h1: f32[128, 256]
            ```"#]],
    );
    check_hover(
        &mlp_at("batch,", 1),
        expect![[r#"
            batch
            ---
            ```dfc
            dim batch = 128
            ```"#]],
    );
}

#[test]
fn hover_shows_a_params_initializer_and_device() {
    check_hover(
        &mlp_at("scale:", 1),
        expect![[r#"
            scale
            ---
            ```dfc
            param scale: f32
            ```
            Initializer: `1.0`.
            Device: `"/job:ps/task:0"`."#]],
    );
}

#[test]
fn hover_in_a_layer_shows_each_call() {
    check_hover(
        &mlp_at("w:", 1),
        expect![[r#"
            w
            ---
            ```dfc
            param w: f32[784, 256]
            param w: f32[256, 10]
            ```
            Initializer: `glorot_uniform`.
            Device: chosen by placement.
            One line per distinct call of `dense`."#]],
    );
    check_hover(
        &mlp_at("k]", 1),
        expect![[r#"
            k
            ---
            ```dfc
            k: 784
            k: 256
            ```
            Declared `k: dim`.
            One line per distinct call of `dense`."#]],
    );
}

#[test]
fn hover_on_an_op_shows_its_signature() {
    check_hover(
        &mlp_at("softmax_cross_entropy", 1),
        expect![[r#"
            softmax_cross_entropy
            ---
            ```dfc
            softmax_cross_entropy(logits, labels)
            ```
            Built-in op: Per-example cross-entropy of softmax(logits) against label distributions over the last axis."#]],
    );
    check_hover(
        &mlp_at("sgd", 1),
        expect![[r#"
            sgd
            ---
            ```dfc
            sgd(lr, weight_decay=0, clip_global_norm=none)
            ```
            Built-in optimizer: Stochastic gradient descent: w -= lr · g."#]],
    );
    check_hover(
        "model m {\n    param w: f32[2]\n    minimize sum(w) with sgd(lr = cosine_$0decay(0.1, decay_steps = 10))\n}\n",
        expect![[r#"
            cosine_decay
            ---
            ```dfc
            cosine_decay(initial, decay_steps, alpha=0)
            ```
            Built-in learning-rate schedule: Learning rate falling from initial along a half cosine to initial · alpha at decay_steps, then staying."#]],
    );
}

#[test]
fn hover_on_an_expression_shows_its_type() {
    check_hover(
        &mlp_at("/ 255.0", 1),
        expect![[r#"
            cast<f32>(images) / 255.0
            ---
            ```dfc
            f32[128, 28, 28]
            ```"#]],
    );
}

#[test]
fn hover_on_a_layer_shows_its_signature() {
    check_hover(
        &mlp_at("dense(h1", 1),
        expect![[r#"
            dense
            ---
            ```dfc
            layer dense(x: f32[n, k], units: dim) -> f32[n, units]
            ```
            Called 2 times in this file."#]],
    );
}

fn check_navigation(fixture: &str, expect: Expect) {
    let (analysis, offset) = at(fixture);
    let line = |span: dfc_diag::Span| {
        let index = dfc_diag::LineIndex::new(&analysis.source);
        let at = index.line_col(&analysis.source, span.start as usize);
        format!("{}:{} {}", at.line, at.column, analysis.text(span))
    };
    let definition = analysis.definition(offset).map(line).unwrap_or_else(|| "none".into());
    let references: Vec<String> = analysis.references(offset, true).into_iter().map(line).collect();
    expect.assert_eq(&format!("definition {definition}\nreferences {}", references.join(", ")));
}

#[test]
fn definitions_and_references() {
    check_navigation(
        &mlp_at("logits,", 1),
        expect![[r#"
            definition 17:9 logits
            references 17:9 logits, 18:45 logits, 19:12 logits"#]],
    );
    // A layer's keyword argument names the layer's parameter.
    check_navigation(
        &mlp_at("units = 10", 1),
        expect![[r#"
            definition 2:27 units
            references 2:27 units, 2:49 units, 3:21 units, 4:18 units, 16:32 units, 17:28 units"#]],
    );
    check_navigation(
        &mlp_at("dense(x", 1),
        expect![[r#"
            definition 2:7 dense
            references 2:7 dense, 16:23 dense, 17:18 dense"#]],
    );
    // A layer's size name is defined where it first appears.
    check_navigation(
        &mlp_at("n, k", 1),
        expect![[r#"
            definition 2:20 n
            references 2:20 n, 2:46 n"#]],
    );
}

#[test]
fn rename_edits_every_occurrence_and_refuses_clashes() {
    let (analysis, offset) = at(&mlp_at("h1 ", 1));
    let spans = analysis.rename(offset, "hidden").unwrap();
    let texts: Vec<&str> = spans.iter().map(|s| analysis.text(*s)).collect();
    assert_eq!(texts, ["h1", "h1"]);
    assert_eq!(analysis.rename(offset, "logits").unwrap_err(), "`logits` is already the name of a let here");
    assert!(analysis.rename(offset, "2x").unwrap_err().contains("is not a name"));
    assert!(analysis.rename(offset, "relu").unwrap_err().contains("built-in"));
    let (analysis, offset) = at(&mlp_at("relu", 1));
    assert_eq!(analysis.prepare_rename(offset).unwrap_err(), "`relu` is built in and cannot be renamed");
}

fn check_completion(fixture: &str, expect: Expect) {
    let (analysis, offset) = at(fixture);
    let labels: Vec<String> = analysis
        .completions(offset)
        .into_iter()
        .map(|c| format!("{} ({:?}{})", c.label, c.kind, c.detail.map(|d| format!(": {d}")).unwrap_or_default()))
        .filter(|l| !l.contains("(Op"))
        .collect();
    expect.assert_eq(&labels.join("\n"));
}

#[test]
fn completion_offers_names_in_scope_layers_and_ops() {
    let (analysis, offset) = at(&MLP.replace("    output logits", "    let y = re$0\n    output logits"));
    let labels: Vec<String> = analysis.completions(offset).into_iter().map(|c| c.label).collect();
    for expected in ["relu", "reshape", "softmax", "dense", "h1", "batch", "scale"] {
        assert!(labels.contains(&expected.to_string()), "{expected} missing from {labels:?}");
    }
    assert!(!labels.contains(&"w".to_string()), "a layer's names are not in the model's scope");
    assert!(!labels.contains(&"y".to_string()), "not the name being defined");
    check_completion(
        &MLP.replace("    output logits", "    let y = l$0\n    output logits"),
        expect![[r#"
            dense (Layer: layer dense(x: f32[n, k], units: dim) -> f32[n, units])
            batch (Dim: dim batch: 128)
            images (Value: input images: u8[128, 28, 28])
            labels (Value: input labels: i32[128])
            scale (Value: param scale: f32)
            x (Value: let x: f32[128, 784])
            h1 (Value: let h1: f32[128, 256])
            logits (Value: let logits: f32[128, 10])
            loss (Value: let loss: f32)
            true (Keyword)
            false (Keyword)"#]],
    );
}

#[test]
fn completion_knows_its_context() {
    check_completion(
        "model m {\n    input x: $0\n}\n",
        expect![[r#"
            f32 (Type: element type)
            f64 (Type: element type)
            i32 (Type: element type)
            i64 (Type: element type)
            u8 (Type: element type)
            bool (Type: element type)"#]],
    );
    check_completion("model m {\n    minimize loss with $0\n}\n", expect![""]);
    check_completion(
        "model m {\n    minimize loss with sgd(lr = $0)\n}\n",
        expect![[r#"
        exponential_decay (Schedule: exponential_decay(initial, decay_steps, decay_rate, staircase=false))
        piecewise_constant (Schedule: piecewise_constant(boundaries, values))
        cosine_decay (Schedule: cosine_decay(initial, decay_steps, alpha=0))
        warmup (Schedule: warmup(lr, steps))"#]],
    );
    let (analysis, offset) = at("model m {\n    $0\n}\n");
    let labels: Vec<String> = analysis.completions(offset).into_iter().map(|c| c.label).collect();
    assert_eq!(labels, ["let", "param", "input", "const", "dim", "output", "metric", "minimize", "device", "return"]);
    let (analysis, offset) = at(&mlp_at("256)", 1).replace("$0256", "$0"));
    let labels: Vec<String> = analysis.completions(offset).into_iter().map(|c| c.label).collect();
    assert!(labels.contains(&"units =".to_string()), "{labels:?}");
}

#[test]
fn symbols_outline_models_and_layers() {
    let analysis = FileAnalysis::new(MLP.to_string());
    let mut text = String::new();
    for item in analysis.symbols() {
        text += &format!("{:?} {} {}\n", item.kind, item.name, item.detail.unwrap_or_default());
        for child in item.children {
            text += &format!("    {:?} {} {}\n", child.kind, child.name, child.detail.unwrap_or_default());
        }
    }
    expect![[r#"
        Layer dense 
            LayerParam x f32[128, 784]
            LayerParam units 256
            SizeName n 128
            SizeName k 784
            Param w f32[784, 256]
            Param b f32[256]
        Model mlp 
            Dim batch 128
            Input images u8[128, 28, 28]
            Input labels i32[128]
            Param scale f32
            Let x f32[128, 784]
            Let h1 f32[128, 256]
            Let logits f32[128, 10]
            Let loss f32
    "#]]
    .assert_eq(&text);
}

#[test]
fn semantic_tokens_classify_every_name() {
    let analysis = FileAnalysis::new(
        "layer d(x: f32[n]) -> f32[n] { return relu(x) }\nmodel m {\n  @device(\"cpu:0\") param w: f32[3] = zeros\n  let y = d(w) // c\n  minimize sum(y) with sgd(lr = 0.1)\n}\n"
            .to_string(),
    );
    let text: Vec<String> = analysis
        .semantic_tokens()
        .iter()
        .map(|t| {
            format!(
                "{}:{:?}{}",
                analysis.text(t.span),
                t.kind,
                if t.modifiers == 0 { String::new() } else { format!("/{}", t.modifiers) }
            )
        })
        .collect();
    expect![[r#"layer:Keyword d:Function/1 x:Parameter/1 f32:Type n:Parameter/1 ->:Operator f32:Type n:Parameter return:Keyword relu:Function/4 x:Parameter model:Keyword m:Class/1 @:Decorator device:Decorator "cpu:0":String param:Keyword w:Property/1 f32:Type 3:Number =:Operator zeros:Function/4 let:Keyword y:Variable/1 =:Operator d:Function w:Property // c:Comment minimize:Keyword sum:Function/4 y:Variable with:Keyword sgd:Function/4 lr:Parameter =:Operator 0.1:Number"#]]
        .assert_eq(&text.join(" "));
}

#[test]
fn a_syntax_error_keeps_the_rest_of_the_file() {
    let broken = MLP.replace("let h1     = relu(dense(x, units = 256))", "let h1     = relu(dense(x, units = ))");
    let analysis = FileAnalysis::new(broken.clone());
    assert!(analysis.diagnostics.iter().any(|d| d.code.as_str() == "E0001"), "{:?}", analysis.diagnostics);
    let outline: Vec<String> = analysis.symbols().into_iter().flat_map(|s| s.children).map(|c| c.name).collect();
    assert!(outline.contains(&"logits".to_string()) && outline.contains(&"h1".to_string()), "{outline:?}");
    let offset = broken.find("images:").unwrap();
    let hover = analysis.hover(offset).expect("hover on an input of a broken file");
    assert!(hover.markdown.contains("u8[128, 28, 28]"), "{}", hover.markdown);
}
