//! The fleet commands: `push`, `pull`, `fleet doctor|ls|fsck|gc|repair`, and
//! the Prometheus rendering of `stats`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use tcg_cj::Value;

use crate::commands::{print_json, print_report, StoreArg};
use crate::output::{print_line, Outcome};

/// `fleet` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum FleetCommand {
    /// Qualify the remote: conditional create, stale-ETag update, a race of
    /// 16 creators (exit 1 if it does not qualify). The verdict is cached.
    Doctor {
        #[command(flatten)]
        store: StoreArg,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the remote's refs.
    Ls {
        #[command(flatten)]
        store: StoreArg,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check every remote ref, manifest and chunk; list evidence reports
    /// (exit 1 unless clean).
    Fsck {
        #[command(flatten)]
        store: StoreArg,
        /// Also re-hash every chunk (downloads everything).
        #[arg(long)]
        deep: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Sweep chunks and manifests no ref reaches, older than the grace period.
    Gc {
        #[command(flatten)]
        store: StoreArg,
        /// Grace period in seconds (a writer may be between upload and ref).
        #[arg(long, default_value_t = 7 * 24 * 3600)]
        grace: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replace a remote ref proven bad with the local store's verified record
    /// (conditional on the ref's ETag, so two repairs cannot both win).
    Repair {
        #[command(flatten)]
        store: StoreArg,
        /// The key to repair.
        key: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Progress on stderr, on a terminal only.
fn progress(what: &'static str) -> impl FnMut(usize, usize) {
    let tty = std::io::stderr().is_terminal();
    move |done, total| {
        if tty {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r{what} {done}/{total}");
            if done == total {
                let _ = writeln!(e);
            }
        }
    }
}

fn read_keys(mut keys: Vec<String>, from: Option<PathBuf>) -> anyhow::Result<Vec<String>> {
    if let Some(path) = from {
        let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
            Box::new(std::io::stdin().lock())
        } else {
            Box::new(std::io::BufReader::new(
                std::fs::File::open(&path)
                    .with_context(|| format!("cannot open {}", path.display()))?,
            ))
        };
        for line in reader.lines() {
            let line = line?;
            let line = line.trim();
            if !line.is_empty() && !line.starts_with('#') {
                keys.push(line.to_string());
            }
        }
    }
    Ok(keys)
}

fn rows_text(rows: &Value, fields: &[&str]) -> anyhow::Result<()> {
    for row in rows.as_array().into_iter().flatten() {
        let Some(r) = row.as_object() else { continue };
        let cols: Vec<String> = fields
            .iter()
            .map(|k| match r.get(*k) {
                Some(Value::Str(s)) => tcg_core::text::untrusted(s),
                Some(Value::Int(i)) => i.to_string(),
                Some(Value::Bool(b)) => b.to_string(),
                _ => "-".into(),
            })
            .collect();
        print_line(&cols.join("  "))?;
    }
    Ok(())
}

/// `push`.
pub(crate) fn push(
    store: &StoreArg,
    keys: Vec<String>,
    from: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<Outcome> {
    let remote = store.remote()?;
    // Push only reads the local store: a missing one is `store.not_found`.
    let engine = store.existing()?;
    let mut keys = read_keys(keys, from)?;
    if keys.is_empty() {
        keys = engine
            .list()?
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_object()?.get("key")?.as_str().map(str::to_string))
            .collect();
    }
    let rows = tcg_remote::ops::push(&engine, &remote, &keys, &mut progress("push"))?;
    if json {
        print_json(&rows)?;
    } else {
        rows_text(&rows, &["key", "outcome", "manifest"])?;
    }
    let failed = rows.as_array().into_iter().flatten().any(|r| {
        matches!(
            r.as_object()
                .and_then(|o| o.get("outcome"))
                .and_then(Value::as_str),
            Some("ERROR") | Some("ABSENT")
        )
    });
    Ok(if failed {
        Outcome::Negative
    } else {
        Outcome::Success
    })
}

/// `pull`.
pub(crate) fn pull(
    store: &StoreArg,
    trust: tcg_core::engine::TrustConfig,
    admitted_copy: bool,
    keys: Vec<String>,
    from: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<Outcome> {
    let remote = store.remote()?;
    let engine = store
        .local_engine()?
        .with_remote(remote.clone())
        .with_trust(trust);
    let mut keys = read_keys(keys, from)?;
    if keys.is_empty() {
        keys = tcg_remote::ops::keys(&remote)?;
    }
    let rows = tcg_remote::ops::pull(&engine, &keys, admitted_copy, &mut progress("pull"))?;
    if json {
        print_json(&rows)?;
    } else {
        rows_text(&rows, &["key", "source"])?;
    }
    for r in rows
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
    {
        if let (Some(Value::Str(k)), Some(Value::Str(code)), Some(Value::Str(why))) =
            (r.get("key"), r.get("refused"), r.get("error"))
        {
            eprintln!(
                "torch-compiled-graphs: {}: refused ({}): {}",
                tcg_core::text::untrusted(k),
                tcg_core::text::untrusted(code),
                tcg_core::text::message(why)
            );
        }
    }
    let missed = rows.as_array().into_iter().flatten().any(|r| {
        matches!(
            r.as_object().and_then(|o| o.get("source")),
            Some(Value::Null)
        )
    });
    Ok(if missed {
        Outcome::Negative
    } else {
        Outcome::Success
    })
}

/// `fleet …`.
pub(crate) fn dispatch(command: FleetCommand) -> anyhow::Result<Outcome> {
    match command {
        FleetCommand::Doctor { store, json } => {
            let remote = store.remote()?;
            let verdict = tcg_remote::doctor::run(&remote)?;
            let v = verdict.to_value(&remote.config().url);
            if json {
                print_json(&v)?;
            } else {
                print_line(&format!(
                    "second create refused: {}\nstale-etag update refused: {}\nrace: {} of {} racers won, body intact: {}\nwrong upload checksum refused: {}\nverdict: {}",
                    verdict.second_create_refused,
                    verdict.stale_update_refused,
                    verdict.race_winners,
                    tcg_remote::doctor::RACERS,
                    verdict.race_body_intact,
                    match verdict.checksum_refused {
                        Some(true) => "true",
                        Some(false) => "false (accepted; reported, not required)",
                        None => "unknown (could not be told)",
                    },
                    if verdict.qualified() {
                        "QUALIFIED"
                    } else {
                        "NOT QUALIFIED: single-flight is off and publication is advisory"
                    }
                ))?;
            }
            Ok(if verdict.qualified() {
                Outcome::Success
            } else {
                Outcome::Negative
            })
        }
        FleetCommand::Ls { store, json } => {
            let rows = tcg_remote::ops::ls(&*store.remote()?)?;
            if json {
                print_json(&rows)?;
            } else {
                rows_text(&rows, &["key", "manifest", "created", "producer"])?;
            }
            Ok(Outcome::Success)
        }
        FleetCommand::Fsck { store, deep, json } => {
            let (report, clean) = tcg_remote::ops::fsck(&*store.remote()?, deep)?;
            print_report(&report, json)?;
            Ok(if clean {
                Outcome::Success
            } else {
                Outcome::Negative
            })
        }
        FleetCommand::Gc { store, grace, json } => {
            let report = tcg_remote::ops::gc(
                &*store.remote()?,
                Duration::from_secs(grace),
                &mut progress("gc"),
            )?;
            print_report(&report, json)?;
            Ok(Outcome::Success)
        }
        FleetCommand::Repair { store, key, json } => {
            let remote = store.remote()?;
            let report = tcg_remote::ops::repair(&store.local_engine()?, &remote, &key)?;
            print_report(&report, json)?;
            Ok(Outcome::Success)
        }
    }
}

/// `stats` in the Prometheus text exposition format: counters as
/// `_total` counters, sizes as gauges.
pub(crate) fn prometheus(stats: &Value) -> String {
    let mut out = String::new();
    let Some(o) = stats.as_object() else {
        return out;
    };
    for (name, v) in o {
        let Value::Int(n) = v else { continue };
        let counter = !matches!(
            name.as_str(),
            "keys" | "objects" | "bytes" | "refs" | "leases"
        );
        let (metric, kind) = if counter {
            (format!("torch_compiled_graphs_{name}_total"), "counter")
        } else {
            (format!("torch_compiled_graphs_store_{name}"), "gauge")
        };
        out.push_str(&format!(
            "# HELP {metric} torch-compiled-graphs store statistic {name}.\n# TYPE {metric} {kind}\n{metric} {n}\n"
        ));
    }
    out
}
