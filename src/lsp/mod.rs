//! `dfc lsp`: the language server, on stdio. It keeps the open documents, re-analyses one when
//! it changes (after every queued change has been applied), publishes the diagnostics `dfc check`
//! would print, and answers hover, definition, references, rename, completion, symbols,
//! formatting and semantic tokens from `dfc_ide`.
//!
//! No request can bring the server down: malformed parameters are an error answer, unknown
//! methods are "method not found", and a panic inside a handler is caught and answered as an
//! internal error while the server goes on.

mod convert;
mod handlers;
mod transport;

use convert::Encoding;
use dfc_ide::FileAnalysis;
use lsp_server::{Connection, ErrorCode, Message, Notification, Request, Response};
use lsp_types as lsp;
use lsp_types::notification::Notification as _;
use std::collections::HashMap;

/// Serves one client on stdin and stdout until it asks the server to exit.
pub fn serve_stdio() -> Result<(), String> {
    let (connection, io_threads) = transport::stdio();
    let served = serve(&connection);
    drop(connection);
    io_threads.join().map_err(|e| format!("the language server's stdio failed: {e}"))?;
    served
}

/// The whole session on one connection: the handshake, then every message until `exit`.
pub fn serve(connection: &Connection) -> Result<(), String> {
    let (id, params) = connection.initialize_start().map_err(|e| format!("no initialize request: {e}"))?;
    let params: lsp::InitializeParams = serde_json::from_value(params).unwrap_or_default();
    let encoding = negotiate_encoding(&params);
    let snippets = params
        .capabilities
        .text_document
        .as_ref()
        .and_then(|t| t.completion.as_ref())
        .and_then(|c| c.completion_item.as_ref())
        .and_then(|i| i.snippet_support)
        .unwrap_or(false);
    let result = lsp::InitializeResult {
        capabilities: capabilities(encoding),
        server_info: Some(lsp::ServerInfo {
            name: "dfc".to_string(),
            version: Some(env!("CARGO_PKG_VERSION").to_string()),
        }),
    };
    let result = serde_json::to_value(result).map_err(|e| e.to_string())?;
    connection.initialize_finish(id, result).map_err(|e| format!("the initialize handshake failed: {e}"))?;

    let mut server = Server { sender: connection.sender.clone(), documents: HashMap::new(), encoding, snippets };
    for message in &connection.receiver {
        match message {
            Message::Request(request) => {
                if connection.handle_shutdown(&request).map_err(|e| format!("shutdown: {e}"))? {
                    return Ok(());
                }
                server.request(request);
            }
            Message::Notification(notification) => {
                if notification.method == lsp::notification::Exit::METHOD {
                    return Ok(());
                }
                server.notification(notification);
            }
            Message::Response(_) => {}
        }
        // Diagnostics once the queue is drained, so that a burst of keystrokes is analysed once.
        if connection.receiver.is_empty() {
            server.publish_changed();
        }
    }
    Ok(())
}

/// UTF-8 positions if the client offers them (no conversion), else LSP's default UTF-16.
fn negotiate_encoding(params: &lsp::InitializeParams) -> Encoding {
    let offered = params.capabilities.general.as_ref().and_then(|g| g.position_encodings.as_ref());
    match offered {
        Some(kinds) if kinds.contains(&lsp::PositionEncodingKind::UTF8) => Encoding::Utf8,
        _ => Encoding::Utf16,
    }
}

fn capabilities(encoding: Encoding) -> lsp::ServerCapabilities {
    let legend = lsp::SemanticTokensLegend {
        token_types: dfc_ide::TOKEN_KINDS.iter().map(|k| lsp::SemanticTokenType::new(k)).collect(),
        token_modifiers: dfc_ide::MODIFIERS.iter().map(|m| lsp::SemanticTokenModifier::new(m)).collect(),
    };
    lsp::ServerCapabilities {
        position_encoding: Some(match encoding {
            Encoding::Utf8 => lsp::PositionEncodingKind::UTF8,
            Encoding::Utf16 => lsp::PositionEncodingKind::UTF16,
        }),
        text_document_sync: Some(lsp::TextDocumentSyncCapability::Options(lsp::TextDocumentSyncOptions {
            open_close: Some(true),
            change: Some(lsp::TextDocumentSyncKind::INCREMENTAL),
            ..Default::default()
        })),
        hover_provider: Some(lsp::HoverProviderCapability::Simple(true)),
        definition_provider: Some(lsp::OneOf::Left(true)),
        references_provider: Some(lsp::OneOf::Left(true)),
        rename_provider: Some(lsp::OneOf::Right(lsp::RenameOptions {
            prepare_provider: Some(true),
            work_done_progress_options: Default::default(),
        })),
        completion_provider: Some(lsp::CompletionOptions {
            trigger_characters: Some(vec![":".into(), "<".into(), "@".into(), "(".into()]),
            ..Default::default()
        }),
        document_symbol_provider: Some(lsp::OneOf::Left(true)),
        document_formatting_provider: Some(lsp::OneOf::Left(true)),
        semantic_tokens_provider: Some(lsp::SemanticTokensServerCapabilities::SemanticTokensOptions(
            lsp::SemanticTokensOptions {
                legend,
                full: Some(lsp::SemanticTokensFullOptions::Bool(true)),
                range: None,
                work_done_progress_options: Default::default(),
            },
        )),
        ..Default::default()
    }
}

/// An open document: its text as the client has it, and its analysis once asked for.
struct Document {
    text: String,
    version: i32,
    analysis: Option<FileAnalysis>,
    /// Changed since its diagnostics were last published.
    changed: bool,
}

impl Document {
    fn analysis(&mut self) -> &FileAnalysis {
        let text = &self.text;
        self.analysis.get_or_insert_with(|| FileAnalysis::new(text.clone()))
    }
}

struct Server {
    sender: crossbeam_channel::Sender<Message>,
    documents: HashMap<lsp::Uri, Document>,
    encoding: Encoding,
    /// Whether completions may be snippets.
    snippets: bool,
}

impl Server {
    fn send(&self, message: Message) {
        // The client is gone if this fails; the receiving loop ends on its own.
        let _ = self.sender.send(message);
    }

    fn notification(&mut self, notification: Notification) {
        use lsp::notification::{DidChangeTextDocument, DidCloseTextDocument, DidOpenTextDocument};
        match notification.method.as_str() {
            DidOpenTextDocument::METHOD => {
                let Ok(params) = serde_json::from_value::<lsp::DidOpenTextDocumentParams>(notification.params) else {
                    return;
                };
                let document = params.text_document;
                self.documents.insert(
                    document.uri,
                    Document { text: document.text, version: document.version, analysis: None, changed: true },
                );
            }
            DidChangeTextDocument::METHOD => {
                let Ok(params) = serde_json::from_value::<lsp::DidChangeTextDocumentParams>(notification.params) else {
                    return;
                };
                let Some(document) = self.documents.get_mut(&params.text_document.uri) else { return };
                for change in params.content_changes {
                    match change.range {
                        Some(range) => {
                            let span = convert::Lines::new(&document.text, self.encoding).span(range);
                            document.text.replace_range(span.range(), &change.text);
                        }
                        None => document.text = change.text,
                    }
                }
                document.version = params.text_document.version;
                document.analysis = None;
                document.changed = true;
            }
            DidCloseTextDocument::METHOD => {
                let Ok(params) = serde_json::from_value::<lsp::DidCloseTextDocumentParams>(notification.params) else {
                    return;
                };
                if self.documents.remove(&params.text_document.uri).is_some() {
                    self.publish(params.text_document.uri, Vec::new(), None);
                }
            }
            _ => {}
        }
    }

    /// Publishes the diagnostics of every document changed since the last time.
    fn publish_changed(&mut self) {
        let encoding = self.encoding;
        let mut ready = Vec::new();
        for (uri, document) in self.documents.iter_mut().filter(|(_, d)| d.changed) {
            document.changed = false;
            let version = document.version;
            let analysis = document.analysis();
            let lines = convert::Lines::new(&analysis.source, encoding);
            let diagnostics = analysis.diagnostics.iter().map(|d| convert::diagnostic(d, &lines, uri)).collect();
            ready.push((uri.clone(), diagnostics, Some(version)));
        }
        for (uri, diagnostics, version) in ready {
            self.publish(uri, diagnostics, version);
        }
    }

    fn publish(&self, uri: lsp::Uri, diagnostics: Vec<lsp::Diagnostic>, version: Option<i32>) {
        let params = lsp::PublishDiagnosticsParams { uri, diagnostics, version };
        self.send(Message::Notification(Notification::new(
            lsp::notification::PublishDiagnostics::METHOD.to_string(),
            params,
        )));
    }

    fn request(&mut self, request: Request) {
        let id = request.id.clone();
        let method = request.method.clone();
        let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handlers::handle(self, request)));
        let response = match answer {
            Ok(Ok(result)) => Response::new_ok(id, result),
            Ok(Err((code, message))) => Response::new_err(id, code as i32, message),
            Err(_) => Response::new_err(
                id,
                ErrorCode::InternalError as i32,
                format!("dfc lsp: internal error while answering {method} (the server goes on)"),
            ),
        };
        self.send(Message::Response(response));
    }
}
