//! The human-readable form of explanations, shared by the CLI and the Python
//! log line so that both say the same thing. Input is the JSON the engine
//! produces ([`Engine::explain`](super::Engine::explain) and friends).

use std::fmt::Write;

use tcg_cj::Value;

fn text(v: &Value) -> String {
    match v {
        Value::Null => "(absent)".into(),
        Value::Str(s) => s.clone(),
        other => tcg_cj::to_canonical_string(other).unwrap_or_default(),
    }
}

fn get<'a>(v: &'a Value, name: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    v.as_object().and_then(|m| m.get(name)).unwrap_or(&NULL)
}

fn items(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or(&[])
}

fn side_names(v: &Value) -> String {
    items(v).iter().map(text).collect::<Vec<_>>().join(", ")
}

/// One difference, indented, with its detail.
fn difference(out: &mut String, d: &Value, labels: (&str, &str)) {
    let (ra, sa) = labels;
    let fact = text(get(d, "fact"));
    let _ = writeln!(
        out,
        "    {fact}: {ra} {}, {sa} {}",
        text(get(d, "requested")),
        text(get(d, "stored"))
    );
    let detail = get(d, "detail");
    match detail {
        Value::Object(m) if m.contains_key("added") => {
            for (name, label) in [("added", "only in "), ("removed", "only in ")] {
                let names = side_names(get(detail, name));
                if !names.is_empty() {
                    let who = if name == "added" { ra } else { sa };
                    let _ = writeln!(out, "      {label}{who}: {names}");
                }
            }
        }
        Value::Object(m) if m.contains_key("policies") => {
            let policies = get(detail, "policies");
            let name = |side: &str| match get(policies, side) {
                Value::Str(s) => s.clone(),
                _ => "a policy this version does not know".into(),
            };
            let _ = writeln!(
                out,
                "      compile policy: {ra} {} vs {sa} {}",
                name("requested"),
                name("stored")
            );
        }
        Value::Object(m) if m.contains_key("unavailable") => {
            let _ = writeln!(out, "      ({})", text(get(detail, "unavailable")));
        }
        Value::Object(m) if m.contains_key("first_line") => {
            let _ = writeln!(
                out,
                "      first differing canonical line: {}{}",
                text(get(detail, "first_line")),
                if get(detail, "complete") == &Value::Bool(false) {
                    " (from a kept prefix of a large program)"
                } else {
                    ""
                }
            );
            for (side, mark, label) in [("requested", "-", ra), ("stored", "+", sa)] {
                let shown = items(get(detail, side));
                for row in shown {
                    let row = items(row);
                    if let [n, line] = row {
                        let _ = writeln!(out, "      {mark} {label} {}: {}", text(n), text(line));
                    }
                }
                let total = get(detail, &format!("{side}_lines")).as_i64().unwrap_or(0);
                if total as usize > shown.len() {
                    let _ = writeln!(
                        out,
                        "      {mark} {label}: … {} more differing lines",
                        total as usize - shown.len()
                    );
                }
            }
        }
        Value::Array(rows) => {
            for row in rows {
                let _ = writeln!(
                    out,
                    "      {}: {ra} {}, {sa} {}",
                    text(get(row, "path")),
                    text(get(row, "requested")),
                    text(get(row, "stored"))
                );
            }
        }
        _ => {}
    }
}

fn differences(out: &mut String, diffs: &Value, labels: (&str, &str)) {
    for d in items(diffs) {
        difference(out, d, labels);
    }
}

/// The text of [`Engine::explain`](super::Engine::explain)'s report.
pub fn render_explanation(v: &Value) -> String {
    // Every string of the report is untrusted text (names from artifacts).
    let v = &crate::text::untrusted_value(v);
    let mut out = String::new();
    let key = text(get(v, "key"));
    let state = match (get(v, "present"), get(v, "quarantined")) {
        (Value::Bool(true), Value::Bool(true)) => "stored here, but quarantined",
        (Value::Bool(true), _) => "stored here",
        _ => "not stored here",
    };
    let _ = writeln!(out, "{key} ({}): {state}", text(get(v, "graph_class")));
    let remote = get(v, "remote");
    match text(get(remote, "state")).as_str() {
        "present" => {
            let _ = writeln!(
                out,
                "  on the remote: manifest {}",
                text(get(remote, "manifest"))
            );
        }
        "absent" => {
            let _ = writeln!(out, "  not on the remote");
        }
        "unknown" => {
            let _ = writeln!(out, "  remote: unknown ({})", text(get(remote, "reason")));
        }
        _ => {}
    }
    let neighbours = items(get(v, "neighbours"));
    if neighbours.is_empty() {
        let _ = writeln!(out, "  no other stored entry of this graph class");
    }
    for n in neighbours {
        let _ = writeln!(
            out,
            "  nearest stored {}: differs in {}",
            text(get(n, "key")),
            side_names(get(n, "differing_axes"))
        );
        differences(&mut out, get(n, "differences"), ("requested", "stored"));
    }
    if get(v, "scan_truncated") == &Value::Bool(true) {
        let _ = writeln!(
            out,
            "  (only the first {} stored keys were read)",
            text(get(v, "scanned"))
        );
    }
    out
}

/// The text of [`Engine::explain_keys`](super::Engine::explain_keys)' report.
pub fn render_pair(v: &Value) -> String {
    let v = &crate::text::untrusted_value(v);
    let mut out = String::new();
    let (a, b) = (text(get(get(v, "a"), "key")), text(get(get(v, "b"), "key")));
    let axes = side_names(get(v, "differing_axes"));
    if axes.is_empty() {
        let _ = writeln!(out, "A {a}\nB {b}\n  the same key");
    } else {
        let _ = writeln!(out, "A {a}\nB {b}\n  differ in {axes}");
    }
    differences(&mut out, get(v, "differences"), ("A", "B"));
    out
}

/// The text of [`Engine::explain_class`](super::Engine::explain_class)'s report.
pub fn render_class(v: &Value) -> String {
    let v = &crate::text::untrusted_value(v);
    let mut out = String::new();
    let entries = items(get(v, "entries"));
    let _ = writeln!(
        out,
        "graph class {}: {} stored entr{}",
        text(get(v, "graph_class")),
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" }
    );
    for (i, e) in entries.iter().enumerate() {
        let axes = get(e, "axes");
        let _ = writeln!(
            out,
            "  [{i}] {}  graph={} sm={} toolchain={}",
            text(get(e, "key")),
            text(get(axes, "graph")),
            text(get(axes, "sm")),
            text(get(axes, "toolchain"))
        );
        if i > 0 {
            let _ = writeln!(
                out,
                "    against [0]: differs in {}",
                side_names(get(e, "differing_axes"))
            );
            differences(&mut out, get(e, "differences"), (&format!("[{i}]"), "[0]"));
        }
    }
    if get(v, "scan_truncated") == &Value::Bool(true) {
        let _ = writeln!(
            out,
            "  (only the first {} stored keys were read)",
            text(get(v, "scanned"))
        );
    }
    out
}
