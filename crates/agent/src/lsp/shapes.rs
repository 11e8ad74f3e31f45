//! The SDK's shapes of what language servers answer (`CompletionList`,
//! `LspSymbol` in `daytona_toolbox_api_client`), and the normalisation of
//! every shape the protocol allows into them.
//!
//! Servers differ: a completion answer is `null`, a list of items or a
//! `CompletionList`; documentation a string or `MarkupContent` (the SDK
//! wants an object, so a string becomes plain-text `MarkupContent`); document
//! symbols are flat `SymbolInformation` (pylsp) or a tree of `DocumentSymbol`
//! (typescript-language-server), which is flattened, parents first, each
//! located in the document asked about. Entries a server got wrong (no
//! label, no kind) are left out rather than failing the whole answer.

use serde::Serialize;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LspPosition {
    pub line: u64,
    pub character: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LspRange {
    pub start: LspPosition,
    pub end: LspPosition,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LspLocation {
    pub uri: String,
    pub range: LspRange,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LspSymbol {
    pub name: String,
    pub kind: i64,
    pub location: LspLocation,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CompletionItem {
    pub label: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Always `MarkupContent` (`{kind, value}`): the SDK types it as an object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub documentation: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insert_text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter_text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sort_text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CompletionList {
    pub is_incomplete: bool,
    pub items: Vec<CompletionItem>,
}

/// A `textDocument/completion` result in the SDK's shape.
pub fn completion_list(result: &Value) -> CompletionList {
    let (is_incomplete, items) = match result {
        Value::Array(items) => (false, items.as_slice()),
        Value::Object(list) => (
            list.get("isIncomplete")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            list.get("items")
                .and_then(Value::as_array)
                .map_or(&[][..], Vec::as_slice),
        ),
        _ => (false, &[][..]),
    };
    CompletionList {
        is_incomplete,
        items: items.iter().filter_map(completion_item).collect(),
    }
}

fn completion_item(item: &Value) -> Option<CompletionItem> {
    let text = |name: &str| item.get(name).and_then(Value::as_str).map(str::to_owned);
    Some(CompletionItem {
        label: text("label")?,
        kind: item.get("kind").and_then(Value::as_i64),
        detail: text("detail"),
        documentation: item.get("documentation").and_then(markup),
        // Not a `textEdit`'s text: that replaces the edit's range, which
        // may start before the cursor (tsserver's `.charAt` replaces the
        // dot too), while insertText goes in at the cursor.
        insert_text: text("insertText"),
        filter_text: text("filterText"),
        sort_text: text("sortText"),
    })
}

/// Documentation as `MarkupContent`; `None` for what is neither it nor a string.
fn markup(documentation: &Value) -> Option<Value> {
    match documentation {
        Value::String(text) => Some(json!({"kind": "plaintext", "value": text})),
        Value::Object(content) => {
            let value = content.get("value")?.as_str()?;
            let kind = content
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or("plaintext");
            Some(json!({"kind": kind, "value": value}))
        }
        _ => None,
    }
}

/// A `textDocument/documentSymbol` result (for the document at `uri`) as a
/// flat list.
pub fn document_symbols(result: &Value, uri: &str) -> Vec<LspSymbol> {
    let mut symbols = Vec::new();
    for entry in result.as_array().into_iter().flatten() {
        if entry.get("location").is_some() {
            symbols.extend(symbol_information(entry));
        } else {
            flatten_document_symbol(entry, uri, &mut symbols);
        }
    }
    symbols
}

/// A `workspace/symbol` result: `SymbolInformation`, or `WorkspaceSymbol`,
/// whose location may be a bare `{uri}` (its range left to a resolve the
/// SDK has no call for; the start of the file stands in).
pub fn workspace_symbols(result: &Value) -> Vec<LspSymbol> {
    result
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(symbol_information)
        .collect()
}

fn symbol_information(entry: &Value) -> Option<LspSymbol> {
    let location = entry.get("location")?;
    Some(LspSymbol {
        name: entry.get("name")?.as_str()?.to_owned(),
        kind: entry.get("kind")?.as_i64()?,
        location: LspLocation {
            uri: location.get("uri")?.as_str()?.to_owned(),
            range: location.get("range").and_then(range).unwrap_or(LspRange {
                start: LspPosition {
                    line: 0,
                    character: 0,
                },
                end: LspPosition {
                    line: 0,
                    character: 0,
                },
            }),
        },
    })
}

fn flatten_document_symbol(entry: &Value, uri: &str, into: &mut Vec<LspSymbol>) {
    let symbol = (|| {
        Some(LspSymbol {
            name: entry.get("name")?.as_str()?.to_owned(),
            kind: entry.get("kind")?.as_i64()?,
            location: LspLocation {
                uri: uri.to_owned(),
                range: range(entry.get("range")?)?,
            },
        })
    })();
    into.extend(symbol);
    for child in entry
        .get("children")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        flatten_document_symbol(child, uri, into);
    }
}

fn range(value: &Value) -> Option<LspRange> {
    let position = |value: &Value| {
        Some(LspPosition {
            line: value.get("line")?.as_u64()?,
            character: value.get("character")?.as_u64()?,
        })
    };
    Some(LspRange {
        start: position(value.get("start")?)?,
        end: position(value.get("end")?)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range_json(line: u64) -> Value {
        json!({"start": {"line": line, "character": 0}, "end": {"line": line, "character": 9}})
    }

    #[test]
    fn completions_in_every_shape_become_a_completion_list() {
        let items = json!([
            {"label": "path", "kind": 9, "detail": "os.path", "documentation": "Common pathname manipulations",
             "insertText": "path", "sortText": "apath"},
            {"label": "pathsep", "kind": 6,
             "documentation": {"kind": "markdown", "value": "`:`"}, "filterText": "pathsep"},
            {"label": "toFixed", "textEdit": {"range": range_json(0), "newText": ".toFixed"}},
            {"kind": 3},
        ]);
        let list = completion_list(&items);
        assert!(!list.is_incomplete);
        let labels: Vec<_> = list.items.iter().map(|i| i.label.as_str()).collect();
        assert_eq!(
            labels,
            ["path", "pathsep", "toFixed"],
            "a label is required"
        );
        assert_eq!(
            list.items[0].documentation,
            Some(json!({"kind": "plaintext", "value": "Common pathname manipulations"}))
        );
        assert_eq!(
            list.items[1].documentation,
            Some(json!({"kind": "markdown", "value": "`:`"}))
        );
        assert_eq!(
            list.items[2].insert_text, None,
            "an edit is not an insertion"
        );
        assert_eq!(
            serde_json::to_value(&list.items[0]).unwrap(),
            json!({"label": "path", "kind": 9, "detail": "os.path",
                   "documentation": {"kind": "plaintext", "value": "Common pathname manipulations"},
                   "insertText": "path", "sortText": "apath"})
        );

        let wrapped = completion_list(&json!({"isIncomplete": true, "items": items}));
        assert!(wrapped.is_incomplete);
        assert_eq!(wrapped.items, list.items);

        for empty in [Value::Null, json!({}), json!("nonsense")] {
            assert_eq!(
                serde_json::to_value(completion_list(&empty)).unwrap(),
                json!({"isIncomplete": false, "items": []})
            );
        }
    }

    #[test]
    fn symbol_information_keeps_its_own_location() {
        let answer = json!([
            {"name": "Greeter", "kind": 5, "location": {"uri": "file:///p/a.py", "range": range_json(0)},
             "containerName": ""},
            {"name": "broken", "location": {"uri": "file:///p/a.py", "range": range_json(1)}},
        ]);
        let symbols = document_symbols(&answer, "file:///elsewhere.py");
        assert_eq!(
            serde_json::to_value(&symbols).unwrap(),
            json!([{"name": "Greeter", "kind": 5,
                    "location": {"uri": "file:///p/a.py", "range": range_json(0)}}])
        );
    }

    #[test]
    fn document_symbols_are_flattened_parents_first_in_the_asked_document() {
        let answer = json!([
            {"name": "Greeter", "kind": 5, "range": range_json(0), "selectionRange": range_json(0),
             "children": [
                {"name": "greet", "kind": 6, "range": range_json(1), "selectionRange": range_json(1),
                 "children": [{"name": "x", "kind": 13, "range": range_json(2), "selectionRange": range_json(2)}]},
             ]},
            {"name": "main", "kind": 12, "range": range_json(5), "selectionRange": range_json(5)},
        ]);
        let symbols = document_symbols(&answer, "file:///p/a.ts");
        let flat: Vec<_> = symbols
            .iter()
            .map(|s| (s.name.as_str(), s.kind, s.location.range.start.line))
            .collect();
        assert_eq!(
            flat,
            [
                ("Greeter", 5, 0),
                ("greet", 6, 1),
                ("x", 13, 2),
                ("main", 12, 5)
            ]
        );
        assert!(symbols.iter().all(|s| s.location.uri == "file:///p/a.ts"));
        assert!(document_symbols(&Value::Null, "file:///p/a.ts").is_empty());
    }

    #[test]
    fn workspace_symbols_without_a_range_start_at_the_top() {
        let answer = json!([
            {"name": "Greeter", "kind": 5, "location": {"uri": "file:///p/a.ts", "range": range_json(3)}},
            {"name": "helper", "kind": 12, "location": {"uri": "file:///p/b.ts"}},
            {"name": "no location", "kind": 12},
        ]);
        let symbols = workspace_symbols(&answer);
        assert_eq!(symbols.len(), 2);
        assert_eq!(symbols[0].location.range.start.line, 3);
        assert_eq!(symbols[1].location.uri, "file:///p/b.ts");
        assert_eq!(symbols[1].location.range.end.line, 0);
    }
}
