//! A minimal LSP client over a `dfc lsp` child's stdio, for the fuzz test and the latency
//! benchmark (the feature tests use a real client: tests/lsp/). Messages are framed and parsed
//! by lsp-server's own reader and writer.

use lsp_server::{Message, Notification, Request, RequestId, Response};
use serde_json::{json, Value};
use std::io::{BufReader, BufWriter, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

pub struct Client {
    child: Child,
    input: BufWriter<ChildStdin>,
    output: BufReader<ChildStdout>,
    next_id: i32,
    /// Notifications that arrived while waiting for a response.
    pub notifications: Vec<Notification>,
}

impl Client {
    /// Starts `dfc lsp` and completes the handshake.
    pub fn start(dfc: &str) -> Client {
        let mut child = Command::new(dfc)
            .arg("lsp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start dfc lsp");
        let input = BufWriter::new(child.stdin.take().expect("stdin"));
        let output = BufReader::new(child.stdout.take().expect("stdout"));
        let mut client = Client { child, input, output, next_id: 0, notifications: Vec::new() };
        let result = client.request("initialize", json!({ "capabilities": {} }));
        assert!(result.error.is_none(), "initialize failed: {result:?}");
        client.notify("initialized", json!({}));
        client
    }

    pub fn notify(&mut self, method: &str, params: Value) {
        self.send(Message::Notification(Notification::new(method.to_string(), params)));
    }

    /// Sends a request and waits for its response (keeping the notifications met meanwhile).
    pub fn request(&mut self, method: &str, params: Value) -> Response {
        self.next_id += 1;
        let id = RequestId::from(self.next_id);
        self.send(Message::Request(Request::new(id.clone(), method.to_string(), params)));
        loop {
            match self.receive() {
                Message::Response(response) if response.id == id => return response,
                Message::Notification(notification) => self.notifications.push(notification),
                other => panic!("unexpected message while waiting for {method}: {other:?}"),
            }
        }
    }

    /// The next `textDocument/publishDiagnostics` (one already received first).
    pub fn diagnostics(&mut self) -> Value {
        if let Some(i) = self.notifications.iter().position(|n| n.method == "textDocument/publishDiagnostics") {
            return self.notifications.remove(i).params;
        }
        loop {
            match self.receive() {
                Message::Notification(n) if n.method == "textDocument/publishDiagnostics" => return n.params,
                Message::Notification(n) => self.notifications.push(n),
                other => panic!("unexpected message while waiting for diagnostics: {other:?}"),
            }
        }
    }

    fn send(&mut self, message: Message) {
        message.write(&mut self.input).expect("write to dfc lsp");
        self.input.flush().expect("flush to dfc lsp");
    }

    fn receive(&mut self) -> Message {
        match Message::read(&mut self.output) {
            Ok(Some(message)) => message,
            Ok(None) => panic!("dfc lsp closed its output: {:?}", self.child.try_wait()),
            Err(e) => panic!("unreadable message from dfc lsp: {e}"),
        }
    }

    /// `shutdown`, then `exit`; returns the server's exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let response = self.request("shutdown", Value::Null);
        assert!(response.error.is_none(), "shutdown failed: {response:?}");
        self.notify("exit", Value::Null);
        drop(self.input);
        self.child.wait().expect("wait for dfc lsp")
    }
}
