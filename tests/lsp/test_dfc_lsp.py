"""End-to-end tests of `dfc lsp` through a real LSP client (pygls's, driven by pytest-lsp).

The server is the `dfc` binary named by DFC_BIN (tests/lsp.rs sets it). Every test opens a
document, asks what an editor asks, and checks the answer against the text: ranges, codes,
shapes, locations. pytest-lsp also checks each answer against the client's capabilities.
"""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient

DFC = os.environ.get("DFC_BIN", "dfc")
ROOT = Path(__file__).resolve().parents[2]

BROKEN = """\
layer dense(x: f32[n, k], units: dim) -> f32[n, units] {
    param w: f32[k, units] = glorot_uniform
    param b: f32[units] = zeros
    return x @ w + b
}

model mlp {
    dim batch = 128
    input images: u8[batch, 28, 28]
    input labels: i32[batch]
    param w2: f32[300, 10] = zeros
    let x      = flatten(cast<f32>(images) / 255.0)
    let h1     = relu(dense(x, units = 256))
    let logits = h1 @ w2
    let loss   = mean(softmax_cross_entropy(logits, one_hot(label, 10)))
    output logits
    minimize loss with sgd(lr = 0.01)
}
"""

URI = "file:///tmp/dfc-lsp-test/model.df"


@pytest_lsp.fixture(config=ClientServerConfig(server_command=[DFC, "lsp"]))
async def client(lsp_client: LanguageClient):
    capabilities = types.ClientCapabilities(
        text_document=types.TextDocumentClientCapabilities(
            completion=types.CompletionClientCapabilities(
                completion_item=types.ClientCompletionItemOptions(snippet_support=True)
            ),
            hover=types.HoverClientCapabilities(content_format=[types.MarkupKind.Markdown]),
            document_symbol=types.DocumentSymbolClientCapabilities(hierarchical_document_symbol_support=True),
            rename=types.RenameClientCapabilities(prepare_support=True),
            publish_diagnostics=types.PublishDiagnosticsClientCapabilities(related_information=True),
        )
    )
    await lsp_client.initialize_session(types.InitializeParams(capabilities=capabilities))
    yield
    await lsp_client.shutdown_session()


async def open_document(client: LanguageClient, text: str, uri: str = URI):
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="dfc", version=1, text=text)
        )
    )
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    return client.diagnostics[uri]


def position_of(text: str, needle: str, nth: int = 1, delta: int = 0) -> types.Position:
    """The position of the nth occurrence of needle (plus delta characters), for ASCII text."""
    index = -1
    for _ in range(nth):
        index = text.index(needle, index + 1)
    index += delta
    line = text.count("\n", 0, index)
    return types.Position(line=line, character=index - (text.rfind("\n", 0, index) + 1))


def check_json(text: str) -> list[dict]:
    """What `dfc check --message-format json` reports for the same text."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "model.df"
        path.write_text(text)
        result = subprocess.run([DFC, "check", "--message-format", "json", str(path)], capture_output=True, text=True)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


async def test_diagnostics_on_open_match_dfc_check_and_clear_when_fixed(client: LanguageClient):
    diagnostics = await open_document(client, BROKEN)
    expected = check_json(BROKEN)
    assert len(expected) >= 2, expected
    got = sorted(
        (d.code, d.range.start.line + 1, d.range.start.character + 1, d.range.end.line + 1, d.range.end.character + 1)
        for d in diagnostics
    )
    want = sorted((e["code"], e["line"], e["column"], e["end_line"], e["end_column"]) for e in expected)
    assert got == want
    by_code = {d.code: d for d in diagnostics}
    # The matrix product's inner dimensions: `w2` on line 14; the misspelt `label` on line 15.
    assert by_code["E0203"].range.start.line == 13
    assert by_code["E0101"].range == types.Range(start=position_of(BROKEN, "label,"), end=position_of(BROKEN, "label,", delta=5))
    assert "did you mean `labels`?" in by_code["E0101"].message
    assert all(d.source == "dfc" for d in diagnostics)

    # Fix both with incremental edits: the client sends only the changed ranges.
    fixed_label = position_of(BROKEN, "label,", delta=5)
    start_300 = position_of(BROKEN, "300")
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=URI, version=2),
            content_changes=[
                types.TextDocumentContentChangePartial(range=types.Range(start=fixed_label, end=fixed_label), text="s"),
                types.TextDocumentContentChangePartial(
                    range=types.Range(start=start_300, end=types.Position(line=start_300.line, character=start_300.character + 3)),
                    text="256",
                ),
            ],
        )
    )
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    assert list(client.diagnostics[URI]) == []


async def test_hover_shows_the_shape_of_a_name(client: LanguageClient):
    await open_document(client, BROKEN)
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=URI), position=position_of(BROKEN, "h1 ", delta=1))
    )
    assert "let h1: f32[128, 256]" in hover.contents.value
    assert hover.range == types.Range(start=position_of(BROKEN, "h1 "), end=position_of(BROKEN, "h1 ", delta=2))
    # Inside the layer: one line per call; on an op: its signature.
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=URI), position=position_of(BROKEN, "w:"))
    )
    assert "param w: f32[784, 256]" in hover.contents.value and "glorot_uniform" in hover.contents.value
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=URI), position=position_of(BROKEN, "relu"))
    )
    assert "relu(x)" in hover.contents.value


async def test_definition_and_references(client: LanguageClient):
    await open_document(client, BROKEN)
    document = types.TextDocumentIdentifier(uri=URI)
    definition = await client.text_document_definition_async(
        types.DefinitionParams(text_document=document, position=position_of(BROKEN, "logits,", delta=2))
    )
    assert definition.uri == URI
    assert definition.range.start == position_of(BROKEN, "logits =")
    references = await client.text_document_references_async(
        types.ReferenceParams(
            text_document=document,
            position=position_of(BROKEN, "dense(x,"),
            context=types.ReferenceContext(include_declaration=True),
        )
    )
    assert [r.range.start for r in references] == [position_of(BROKEN, "dense"), position_of(BROKEN, "dense(x,")]


async def test_rename_edits_every_occurrence(client: LanguageClient):
    await open_document(client, BROKEN)
    document = types.TextDocumentIdentifier(uri=URI)
    prepared = await client.text_document_prepare_rename_async(
        types.PrepareRenameParams(text_document=document, position=position_of(BROKEN, "x      ="))
    )
    assert prepared.placeholder == "x"
    edit = await client.text_document_rename_async(
        types.RenameParams(text_document=document, position=position_of(BROKEN, "x      ="), new_name="pixels")
    )
    edits = edit.changes[URI]
    assert [e.range.start for e in edits] == [position_of(BROKEN, "x      ="), position_of(BROKEN, "x, units")]
    assert all(e.new_text == "pixels" for e in edits)
    with pytest.raises(Exception, match="already the name"):
        await client.text_document_rename_async(
            types.RenameParams(text_document=document, position=position_of(BROKEN, "x      ="), new_name="logits")
        )


async def test_completion_offers_ops_layers_and_names(client: LanguageClient):
    text = BROKEN.replace("    output logits", "    let y = so\n    output logits")
    await open_document(client, text)
    result = await client.text_document_completion_async(
        types.CompletionParams(text_document=types.TextDocumentIdentifier(uri=URI), position=position_of(text, "= so", delta=4))
    )
    items = result if isinstance(result, list) else result.items
    labels = {item.label for item in items}
    assert {"softmax", "softmax_cross_entropy", "matmul", "relu", "dense", "h1", "batch"} <= labels
    softmax = next(item for item in items if item.label == "softmax")
    assert softmax.detail == "softmax(x, axis=-1)"


async def test_symbols_and_semantic_tokens(client: LanguageClient):
    await open_document(client, BROKEN)
    document = types.TextDocumentIdentifier(uri=URI)
    symbols = await client.text_document_document_symbol_async(types.DocumentSymbolParams(text_document=document))
    assert [s.name for s in symbols] == ["dense", "mlp"]
    assert "logits" in [c.name for c in symbols[1].children]
    tokens = await client.text_document_semantic_tokens_full_async(types.SemanticTokensParams(text_document=document))
    assert len(tokens.data) % 5 == 0 and len(tokens.data) > 5 * 50


async def test_formatting_returns_the_formatted_text(client: LanguageClient):
    messy = "model  m{\n  input x:f32[ 4,3 ]   // the input\n\n\n    output   relu( x )\n}"
    await open_document(client, messy)
    edits = await client.text_document_formatting_async(
        types.DocumentFormattingParams(
            text_document=types.TextDocumentIdentifier(uri=URI),
            options=types.FormattingOptions(tab_size=4, insert_spaces=True),
        )
    )
    assert len(edits) == 1
    expected = subprocess.run([DFC, "fmt", "-"], input=messy, capture_output=True, text=True, check=True).stdout
    assert edits[0].new_text == expected
    assert expected == "model m {\n    input x: f32[4, 3]  // the input\n\n    output relu(x)\n}\n"


async def test_a_broken_file_keeps_hover_and_symbols(client: LanguageClient):
    text = BROKEN.replace("let h1     = relu(dense(x, units = 256))", "let h1     = relu(dense(x, units = ))")
    diagnostics = await open_document(client, text)
    assert any(d.code == "E0001" for d in diagnostics)
    document = types.TextDocumentIdentifier(uri=URI)
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=document, position=position_of(text, "images:"))
    )
    assert "u8[128, 28, 28]" in hover.contents.value
    symbols = await client.text_document_document_symbol_async(types.DocumentSymbolParams(text_document=document))
    assert "loss" in [c.name for c in symbols[1].children]


async def test_bad_requests_are_answered_and_the_server_goes_on(client: LanguageClient):
    await open_document(client, BROKEN)
    with pytest.raises(Exception, match="is not open"):
        await client.text_document_hover_async(
            types.HoverParams(
                text_document=types.TextDocumentIdentifier(uri="file:///nowhere.df"), position=types.Position(line=0, character=0)
            )
        )
    # A position far past the end of the text clamps, and the server still answers.
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=URI), position=types.Position(line=999, character=999))
    )
    assert hover is None
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=URI), position=position_of(BROKEN, "h1 "))
    )
    assert "f32[128, 256]" in hover.contents.value
