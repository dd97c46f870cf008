//! One function per request: parameters in, `dfc_ide`'s answer converted to LSP's form out.

use super::convert::Lines;
use super::Server;
use dfc_ide::{CompletionKind, DefKind, FileAnalysis};
use lsp_server::{ErrorCode, Request};
use lsp_types as lsp;
use serde::de::DeserializeOwned;
use serde_json::Value;

type Answer = Result<Value, (ErrorCode, String)>;

pub fn handle(server: &mut Server, request: Request) -> Answer {
    use lsp::request::*;
    let params = request.params;
    match request.method.as_str() {
        HoverRequest::METHOD => at_position(server, params, |a, lines, offset, _| {
            a.hover(offset).map(|hover| lsp::Hover {
                contents: lsp::HoverContents::Markup(lsp::MarkupContent {
                    kind: lsp::MarkupKind::Markdown,
                    value: hover.markdown,
                }),
                range: Some(lines.range(hover.span)),
            })
        }),
        GotoDefinition::METHOD => at_position(server, params, |a, lines, offset, uri| {
            a.definition(offset).map(|span| {
                lsp::GotoDefinitionResponse::Scalar(lsp::Location { uri: uri.clone(), range: lines.range(span) })
            })
        }),
        References::METHOD => {
            let params: lsp::ReferenceParams = parse(params)?;
            let include = params.context.include_declaration;
            answer_at(server, params.text_document_position, |a, lines, offset, uri| {
                let spans = a.references(offset, include);
                let locations: Vec<lsp::Location> = spans
                    .into_iter()
                    .map(|span| lsp::Location { uri: uri.clone(), range: lines.range(span) })
                    .collect();
                Ok(Some(locations))
            })
        }
        PrepareRenameRequest::METHOD => {
            let params: lsp::TextDocumentPositionParams = parse(params)?;
            answer_at(server, params, |a, lines, offset, _| {
                let (span, placeholder) = a.prepare_rename(offset).map_err(|e| (ErrorCode::RequestFailed, e))?;
                Ok(Some(lsp::PrepareRenameResponse::RangeWithPlaceholder { range: lines.range(span), placeholder }))
            })
        }
        Rename::METHOD => {
            let params: lsp::RenameParams = parse(params)?;
            let new_name = params.new_name;
            answer_at(server, params.text_document_position, |a, lines, offset, uri| {
                let spans = a.rename(offset, &new_name).map_err(|e| (ErrorCode::RequestFailed, e))?;
                let edits = spans
                    .into_iter()
                    .map(|span| lsp::TextEdit { range: lines.range(span), new_text: new_name.clone() })
                    .collect();
                // lsp-types keys the edits by `Uri`, which clippy thinks mutable (it is not).
                #[allow(clippy::mutable_key_type)]
                let changes = std::iter::once((uri.clone(), edits)).collect();
                Ok(Some(lsp::WorkspaceEdit { changes: Some(changes), ..Default::default() }))
            })
        }
        Completion::METHOD => {
            let params: lsp::CompletionParams = parse(params)?;
            let snippets = server.snippets;
            answer_at(server, params.text_document_position, |a, _, offset, _| {
                let items: Vec<lsp::CompletionItem> =
                    a.completions(offset).into_iter().map(|c| completion_item(c, snippets)).collect();
                Ok(Some(lsp::CompletionResponse::Array(items)))
            })
        }
        DocumentSymbolRequest::METHOD => {
            let params: lsp::DocumentSymbolParams = parse(params)?;
            answer_document(server, &params.text_document.uri, |a, lines| {
                let symbols = a.symbols().into_iter().map(|s| document_symbol(s, lines)).collect();
                Ok(Some(lsp::DocumentSymbolResponse::Nested(symbols)))
            })
        }
        Formatting::METHOD => {
            let params: lsp::DocumentFormattingParams = parse(params)?;
            answer_document(server, &params.text_document.uri, |a, lines| {
                // A file with syntax errors is left as it is: no edits.
                let Ok(formatted) = dfc_fmt::format(&a.source) else { return Ok(None) };
                if formatted == a.source {
                    return Ok(Some(Vec::new()));
                }
                let whole = lines.range(dfc_diag::Span::new(0, a.source.len()));
                Ok(Some(vec![lsp::TextEdit { range: whole, new_text: formatted }]))
            })
        }
        SemanticTokensFullRequest::METHOD => {
            let params: lsp::SemanticTokensParams = parse(params)?;
            answer_document(server, &params.text_document.uri, |a, lines| {
                Ok(Some(lsp::SemanticTokensResult::Tokens(semantic_tokens(a, lines))))
            })
        }
        method => Err((ErrorCode::MethodNotFound, format!("dfc lsp does not answer {method}"))),
    }
}

fn parse<T: DeserializeOwned>(params: Value) -> Result<T, (ErrorCode, String)> {
    serde_json::from_value(params).map_err(|e| (ErrorCode::InvalidParams, format!("malformed parameters: {e}")))
}

/// A request that names a document and a position and may have no answer (`null`).
fn at_position<T: serde::Serialize>(
    server: &mut Server,
    params: Value,
    answer: impl FnOnce(&FileAnalysis, &Lines, usize, &lsp::Uri) -> Option<T>,
) -> Answer {
    let params: lsp::TextDocumentPositionParams = parse(params)?;
    answer_at(server, params, |a, lines, offset, uri| Ok(answer(a, lines, offset, uri)))
}

fn answer_at<T: serde::Serialize>(
    server: &mut Server,
    at: lsp::TextDocumentPositionParams,
    answer: impl FnOnce(&FileAnalysis, &Lines, usize, &lsp::Uri) -> Result<Option<T>, (ErrorCode, String)>,
) -> Answer {
    let uri = at.text_document.uri;
    answer_document(server, &uri.clone(), |a, lines| {
        let offset = lines.offset(at.position);
        answer(a, lines, offset, &uri)
    })
}

fn answer_document<T: serde::Serialize>(
    server: &mut Server,
    uri: &lsp::Uri,
    answer: impl FnOnce(&FileAnalysis, &Lines) -> Result<Option<T>, (ErrorCode, String)>,
) -> Answer {
    let encoding = server.encoding;
    let document = server
        .documents
        .get_mut(uri)
        .ok_or_else(|| (ErrorCode::InvalidParams, format!("{} is not open", uri.as_str())))?;
    let analysis = document.analysis();
    let lines = Lines::new(&analysis.source, encoding);
    let result = answer(analysis, &lines)?;
    serde_json::to_value(result).map_err(|e| (ErrorCode::InternalError, e.to_string()))
}

fn completion_item(c: dfc_ide::Completion, snippets: bool) -> lsp::CompletionItem {
    use lsp::CompletionItemKind as K;
    let kind = match c.kind {
        CompletionKind::Keyword => K::KEYWORD,
        CompletionKind::Snippet => K::SNIPPET,
        CompletionKind::Type => K::TYPE_PARAMETER,
        CompletionKind::Op | CompletionKind::Optimizer | CompletionKind::Schedule | CompletionKind::Initializer => {
            K::FUNCTION
        }
        CompletionKind::Layer => K::CLASS,
        CompletionKind::Dim => K::CONSTANT,
        CompletionKind::Value => K::VARIABLE,
        CompletionKind::Argument => K::PROPERTY,
        CompletionKind::Attribute => K::KEYWORD,
    };
    let (insert_text, format) = match (&c.snippet, snippets) {
        (Some(snippet), true) => (Some(snippet.clone()), Some(lsp::InsertTextFormat::SNIPPET)),
        // Without snippets: the text before the first placeholder.
        (Some(snippet), false) => (Some(snippet.split('$').next().unwrap_or(&c.label).to_string()), None),
        (None, _) => (None, None),
    };
    lsp::CompletionItem {
        label: c.label,
        kind: Some(kind),
        detail: c.detail,
        documentation: c.documentation.map(lsp::Documentation::String),
        insert_text,
        insert_text_format: format,
        ..Default::default()
    }
}

fn document_symbol(symbol: dfc_ide::Symbol, lines: &Lines) -> lsp::DocumentSymbol {
    use lsp::SymbolKind as K;
    let kind = match symbol.kind {
        DefKind::Model => K::MODULE,
        DefKind::Layer => K::FUNCTION,
        DefKind::LayerParam | DefKind::SizeName => K::TYPE_PARAMETER,
        DefKind::Dim | DefKind::Const => K::CONSTANT,
        DefKind::Input => K::FIELD,
        DefKind::Param => K::PROPERTY,
        DefKind::Let | DefKind::OutputAlias => K::VARIABLE,
        DefKind::Metric => K::EVENT,
    };
    let children: Vec<lsp::DocumentSymbol> = symbol.children.into_iter().map(|c| document_symbol(c, lines)).collect();
    #[allow(deprecated)] // `deprecated` is a required field of the struct, superseded by tags.
    lsp::DocumentSymbol {
        name: symbol.name,
        detail: symbol.detail,
        kind,
        tags: None,
        deprecated: None,
        range: lines.range(symbol.span),
        selection_range: lines.range(symbol.selection),
        children: (!children.is_empty()).then_some(children),
    }
}

/// LSP's relative encoding: each token's line and start as deltas from the previous token's,
/// tokens that span lines cut at line ends.
fn semantic_tokens(analysis: &FileAnalysis, lines: &Lines) -> lsp::SemanticTokens {
    let mut data = Vec::new();
    let (mut previous_line, mut previous_start) = (0u32, 0u32);
    for token in analysis.semantic_tokens() {
        for piece in lines.split_by_line(token.span) {
            let at = lines.position(piece.start as usize);
            let delta_line = at.line - previous_line;
            let delta_start = if delta_line == 0 { at.character - previous_start } else { at.character };
            data.push(lsp::SemanticToken {
                delta_line,
                delta_start,
                length: lines.width(piece),
                token_type: token.kind as u32,
                token_modifiers_bitset: token.modifiers,
            });
            (previous_line, previous_start) = (at.line, at.character);
        }
    }
    lsp::SemanticTokens { result_id: None, data }
}
