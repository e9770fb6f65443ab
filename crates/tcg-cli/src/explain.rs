//! `explain`: why two stored keys differ, or what is stored for a graph class.

use tcg_cj::{Map, Value};
use tcg_core::engine::{render_class, render_pair, Engine};
use tcg_core::{Code, Error};

use crate::commands::print_json;
use crate::output::{print_line, Outcome};

/// One line saying whether the remote has `key` (`Engine::remote_presence`).
fn remote_line(key: &str, presence: &Value) -> String {
    let get = |name: &str| {
        presence
            .as_object()
            .and_then(|m| m.get(name))
            .and_then(Value::as_str)
            .map(tcg_core::text::untrusted)
            .unwrap_or_default()
    };
    let key = tcg_core::text::untrusted(key);
    match get("state").as_str() {
        "present" => format!("{key}: on the remote (manifest {})\n", get("manifest")),
        "absent" => format!("{key}: not on the remote\n"),
        _ => format!("{key}: remote unknown ({})\n", get("reason")),
    }
}

fn print_text(text: &str) -> anyhow::Result<()> {
    print_line(text.trim_end_matches('\n'))
}

/// Run `explain` with either two keys or a graph class name (clap enforces one of them).
pub fn run(
    engine: &Engine,
    keys: &[String],
    graph_class: Option<&str>,
    json: bool,
) -> anyhow::Result<Outcome> {
    if let Some(name) = graph_class {
        let report = engine.explain_class(name)?;
        let empty = report
            .as_object()
            .and_then(|m| m.get("entries"))
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if json {
            print_json(&report)?;
        } else {
            print_text(&render_class(&report))?;
        }
        return Ok(if empty {
            Outcome::Negative
        } else {
            Outcome::Success
        });
    }
    let [a, b] = keys else {
        unreachable!("clap takes exactly two keys")
    };
    match engine.explain_keys(a, b)? {
        Ok(mut report) => {
            // With a remote (`--remote` or the environment), whether it has a
            // ref for each key; the member is absent without one.
            let remote = engine.remote().is_some().then(|| {
                let mut r = Map::new();
                r.insert("a".into(), engine.remote_presence(a));
                r.insert("b".into(), engine.remote_presence(b));
                r
            });
            if let (Some(r), Value::Object(m)) = (&remote, &mut report) {
                m.insert("remote".into(), Value::Object(r.clone()));
            }
            if json {
                print_json(&report)?;
            } else {
                let mut text = render_pair(&report);
                for (key, side) in [(a, "a"), (b, "b")] {
                    if let Some(r) = &remote {
                        text.push_str(&remote_line(key, &r[side]));
                    }
                }
                print_text(&text)?;
            }
            Ok(Outcome::Success)
        }
        Err(missing) => {
            // An expected negative (exit 1), reported like any error.
            let err = Error::new(Code::StoreAbsent, format!("{missing} is not stored"));
            eprintln!("error: {err}\ncode: {}", err.code());
            eprintln!("hint: `torch-compiled-graphs ls` lists the stored keys");
            Ok(Outcome::Negative)
        }
    }
}
