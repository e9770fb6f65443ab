//! `adopt --from-hashrepo OLD_ROOT`: import every graph of a 0.2.0 store.

use std::io::IsTerminal;
use std::path::Path;

use tcg_cj::{Map, Value};
use tcg_core::engine::{AdoptEntry, AdoptStatus, Engine};

use crate::commands::print_json;
use crate::output::{print_line, Outcome};

const STATUSES: [AdoptStatus; 5] = [
    AdoptStatus::Imported,
    AdoptStatus::Present,
    AdoptStatus::Divergent,
    AdoptStatus::Quarantined,
    AdoptStatus::Refused,
];

fn line(e: &AdoptEntry) -> String {
    // Names and messages come from the old store: untrusted text.
    let who = tcg_core::text::untrusted(
        &e.key
            .clone()
            .unwrap_or_else(|| format!("refs/{}", e.ref_file)),
    );
    let why = match (&e.status, &e.error) {
        (AdoptStatus::Divergent, _) => {
            "  a different verified artifact already serves it here; this one was set aside".into()
        }
        (_, Some(err)) => format!(
            "  {}: {}",
            err.code(),
            tcg_core::text::message(err.message())
        ),
        _ => String::new(),
    };
    format!("{:<11} {who}{why}", e.status.as_str())
}

/// Run the adoption; exit 1 when any graph was refused.
pub(crate) fn run(engine: &Engine, old: &Path, json: bool) -> anyhow::Result<Outcome> {
    let tty = std::io::stderr().is_terminal();
    let mut progress = |done: usize, total: usize, e: &AdoptEntry| {
        if tty {
            eprint!("\r\x1b[Kadopt: {done}/{total} {}", e.status.as_str());
            if done == total {
                eprintln!();
            }
        }
    };
    let entries = engine.adopt_hashrepo(old, &mut progress)?;
    let count = |s: AdoptStatus| entries.iter().filter(|e| e.status == s).count();
    let refused = count(AdoptStatus::Refused);
    if json {
        let mut counts = Map::new();
        for s in STATUSES {
            counts.insert(s.as_str().into(), Value::Int(count(s) as i64));
        }
        let mut out = Map::new();
        out.insert(
            "cas_root".into(),
            engine.store().root().display().to_string().into(),
        );
        out.insert("counts".into(), Value::Object(counts));
        out.insert("from_hashrepo".into(), old.display().to_string().into());
        out.insert(
            "graphs".into(),
            Value::Array(entries.iter().map(AdoptEntry::to_value).collect()),
        );
        print_json(&Value::Object(out))?;
    } else {
        for e in &entries {
            print_line(&line(e))?;
        }
        let parts: Vec<String> = STATUSES
            .iter()
            .map(|s| format!("{} {}", count(*s), s.as_str()))
            .collect();
        eprintln!(
            "adopt: {} refs from {}: {}",
            entries.len(),
            old.display(),
            parts.join(", ")
        );
    }
    Ok(if refused > 0 {
        Outcome::Negative
    } else {
        Outcome::Success
    })
}
