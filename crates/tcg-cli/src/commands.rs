use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tcg_cj::{Map, Value};
use tcg_core::artifact::{self, Metadata};
use tcg_core::engine::{envelope_subject, sig_path, signature_summary, Engine, TrustSettings};
use tcg_core::identity;
use tcg_core::text::{untrusted, untrusted_value};
use tcg_core::Code;

use crate::output::{print_line, Outcome};

/// Compile PyTorch graphs once; resolve verified artifacts everywhere.
#[derive(Debug, Parser)]
#[command(name = "torch-compiled-graphs", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Derive a cg-key-v1 key from its three axes.
    Key {
        /// The graph axis: a class hash (16 hex).
        #[arg(long)]
        graph: String,
        /// The sm axis, such as sm_90 or cpu-x86-64-v3.
        #[arg(long)]
        sm: String,
        /// The toolchain axis (16 hex) ...
        #[arg(
            long,
            conflicts_with = "toolchain",
            required_unless_present = "toolchain"
        )]
        toolchain_axis: Option<String>,
        /// ... or a JSON file holding the toolchain block, folded here.
        #[arg(long)]
        toolchain: Option<PathBuf>,
        /// Print a JSON object instead of the bare key.
        #[arg(long)]
        json: bool,
    },
    /// Check whether a value is a compiled-graph key (exit 0 if so, 1 if not).
    CheckKey {
        /// The value to check.
        value: String,
    },
    /// Print an artifact's metadata as JSON after a bounded scan of its first member.
    Inspect {
        /// A compiled_graph.tar.gz envelope.
        artifact: PathBuf,
        /// Print this project's canonical report object instead of the metadata.
        #[arg(long)]
        json: bool,
    },
    /// Verify an artifact completely and print its metadata as JSON (exit 0 valid, 1 refused);
    /// with --trust, also require a trusted signature in ARTIFACT.sig of exactly the bytes verified
    /// (the file is read once).
    Verify {
        /// A compiled_graph.tar.gz envelope.
        artifact: PathBuf,
        /// Also admit it on this host (host ISA).
        #[arg(long)]
        host: bool,
        #[command(flatten)]
        trust: TrustArg,
        /// Print this project's canonical report object instead of the metadata.
        #[arg(long)]
        json: bool,
    },
    /// Resolve a key into a directory and print its metadata as JSON (exit 1 on a miss or a quarantined record);
    /// under a trust policy, serve only a record this store minted or the policy admits, and fetch only a
    /// trusted signed artifact.
    Resolve {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        trust: TrustArg,
        /// The compiled-graph key.
        key: String,
        /// The directory to publish the unpacked artifact at.
        dest: PathBuf,
        /// Print this project's canonical report object instead of the metadata.
        #[arg(long)]
        json: bool,
    },
    /// Import every graph of a torch-compiled-graphs 0.2.0 store (read only) into this store.
    Adopt {
        /// The root of the 0.2.0 store (a HashRepo root); it is never written.
        #[arg(long = "from-hashrepo", value_name = "OLD_ROOT")]
        from_hashrepo: PathBuf,
        #[command(flatten)]
        store: StoreArg,
        /// Under a trust policy every (unsigned) 0.2.0 graph is refused.
        #[command(flatten)]
        trust: TrustArg,
        /// Print one JSON object instead of a line per graph.
        #[arg(long)]
        json: bool,
    },
    /// Verify an envelope, admit it on this host and store it under a key
    /// (with its signatures from PATH.sig; under a trust policy, only if one
    /// is trusted).
    Import {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        trust: TrustArg,
        /// The compiled-graph key the artifact states.
        key: String,
        /// The envelope file.
        path: PathBuf,
        /// Print a JSON report.
        #[arg(long)]
        json: bool,
    },
    /// Write the exact stored envelope of a key to a file, and its signatures
    /// (if any) to PATH.sig.
    Export {
        #[command(flatten)]
        store: StoreArg,
        /// The compiled-graph key.
        key: String,
        /// The file to create.
        path: PathBuf,
    },
    /// Sign the artifact stored for a key with an OpenSSH ed25519 private key
    /// (after verifying it in full).
    Sign {
        #[command(flatten)]
        store: StoreArg,
        /// The OpenSSH private key file (unencrypted ssh-ed25519, mode 0600).
        #[arg(long, value_name = "PRIVATE_KEY_FILE")]
        key: PathBuf,
        /// The producer named in the statement [default: the key's comment,
        /// else $TORCH_COMPILED_GRAPHS_PRODUCER, else the host name].
        #[arg(long)]
        producer: Option<String>,
        /// The compiled-graph key.
        graph_key: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List stored keys with graph class, sm, size and last use.
    Ls {
        #[command(flatten)]
        store: StoreArg,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Collect unreachable objects; --max-bytes evicts least recently resolved keys.
    Gc {
        #[command(flatten)]
        store: StoreArg,
        /// Size budget in bytes.
        #[arg(long)]
        max_bytes: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash every stored object (exit 1 if anything is corrupt).
    Fsck {
        #[command(flatten)]
        store: StoreArg,
        /// Move corrupt objects aside (never deleted).
        #[arg(long)]
        quarantine: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Say why keys differ: `KEY_A KEY_B` diffs two stored keys fact by fact;
    /// `--graph-class NAME` lists what is stored for a class and how the entries
    /// differ (exit 1 when a key or the class is not stored).
    Explain {
        #[command(flatten)]
        store: StoreArg,
        /// Two stored keys: KEY_A (in the requested role) and KEY_B.
        #[arg(
            num_args = 2,
            value_names = ["KEY_A", "KEY_B"],
            required_unless_present = "graph_class",
            conflicts_with = "graph_class"
        )]
        keys: Vec<String>,
        /// List the stored entries of this graph class instead.
        #[arg(long, value_name = "NAME")]
        graph_class: Option<String>,
        /// Print JSON (stable).
        #[arg(long)]
        json: bool,
    },
    /// Hits, misses, mints, quarantines, remote counters and bytes of a store.
    Stats {
        #[command(flatten)]
        store: StoreArg,
        /// Print JSON.
        #[arg(long, conflicts_with = "prometheus")]
        json: bool,
        /// Print the Prometheus text exposition format (for a node
        /// exporter's textfile collector).
        #[arg(long)]
        prometheus: bool,
    },
    /// Publish local records to the remote, first writer wins.
    Push {
        #[command(flatten)]
        store: StoreArg,
        /// Keys to publish [default: every local key].
        keys: Vec<String>,
        /// Read more keys from this file (one a line; `-` is stdin).
        #[arg(long, value_name = "FILE")]
        from: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Prefetch keys from the remote into the local store (verified), for
    /// warm-up and offline bundles. Exit 1 if a key was found nowhere.
    Pull {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        trust: TrustArg,
        /// Also store each fetched graph's admitted copy (its members,
        /// uncompressed), so that its first resolve does not read the
        /// envelope; without it the first resolve records the copy.
        #[arg(long)]
        admitted_copy: bool,
        /// Keys to fetch [default: every key the remote has].
        keys: Vec<String>,
        /// Read more keys from this file (one a line; `-` is stdin).
        #[arg(long, value_name = "FILE")]
        from: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Operate the fleet remote.
    Fleet {
        #[command(subcommand)]
        command: crate::fleet::FleetCommand,
    },
    /// Plan and run a build matrix (runs in Python: the `torch-compiled-graphs` console
    /// script or `python -m torch_compiled_graphs build`; see docs/build.md).
    Build(PythonArgs),
    /// Run one cell of a build matrix (runs in Python: the console script or
    /// `python -m torch_compiled_graphs build-cell`).
    BuildCell(PythonArgs),
    /// Record this installation's toolchain block, `toolchain record > fleet-toolchain.json`
    /// (runs in Python: the console script or `python -m torch_compiled_graphs toolchain`).
    Toolchain(PythonArgs),
}

/// The arguments of a command that runs in Python: taken as they are, never parsed here.
#[derive(Debug, clap::Args)]
pub struct PythonArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<std::ffi::OsString>,
}

impl Cli {
    /// The name of the command when it is one that runs in Python (torch is needed), else `None`.
    pub fn python_command(&self) -> Option<&'static str> {
        match self.command {
            Command::Build(_) => Some("build"),
            Command::BuildCell(_) => Some("build-cell"),
            Command::Toolchain(_) => Some("toolchain"),
            _ => None,
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct StoreArg {
    /// The store root [default: $XDG_CACHE_HOME/torch-compiled-graphs].
    #[arg(long = "cas-root", value_name = "DIR")]
    cas_root: Option<PathBuf>,
    /// A fleet remote consulted on a local miss, s3://bucket/prefix
    /// [default: $TORCH_COMPILED_GRAPHS_REMOTE].
    #[arg(long = "remote", value_name = "URL")]
    remote: Option<String>,
}

#[derive(Debug, clap::Args)]
struct TrustArg {
    /// An OpenSSH allowed_signers file: admit only artifacts a listed signer
    /// signed [default: $TORCH_COMPILED_GRAPHS_TRUST; the flag wins, an empty
    /// variable is unset].
    #[arg(long, value_name = "ALLOWED_SIGNERS")]
    trust: Option<PathBuf>,
    /// A file of revoked public keys [default: $TORCH_COMPILED_GRAPHS_REVOKED_KEYS].
    #[arg(long, value_name = "FILE")]
    revoked_keys: Option<PathBuf>,
}

impl TrustArg {
    fn settings(&self) -> TrustSettings {
        TrustSettings {
            trust: self.trust.clone(),
            revoked_keys: self.revoked_keys.clone(),
            ..TrustSettings::default()
        }
        .with_env()
    }
}

/// The signatures of ARTIFACT.sig, each checked against the envelope.
fn signature_rows(artifact: &std::path::Path) -> anyhow::Result<Option<Vec<Value>>> {
    let sig = sig_path(artifact);
    let bytes = match tcg_trust::read_small_file(&sig) {
        Ok(b) => b,
        Err(tcg_trust::TrustError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(None)
        }
        Err(e) => return Err(tcg_core::Error::from_trust(e).into()),
    };
    let entries = tcg_trust::parse_document(&bytes)
        .map_err(tcg_core::Error::from_trust)
        .with_context(|| format!("cannot read {}", sig.display()))?;
    let subject = envelope_subject(artifact)?;
    let verdicts = tcg_trust::verify_entries(&entries, &subject);
    let mut rows = Vec::new();
    for (entry, verdict) in entries.iter().zip(verdicts) {
        let row = match verdict {
            Ok(v) => {
                let mut m = match signature_summary(&v) {
                    Value::Object(m) => m,
                    _ => Map::new(),
                };
                m.insert("valid".into(), Value::Bool(true));
                m
            }
            Err(e) => {
                let mut m = Map::new();
                if let Ok(st) = tcg_trust::Statement::parse(entry.statement.as_bytes()) {
                    m.insert("producer".into(), st.producer.into());
                    m.insert("signer".into(), st.signer.into());
                    m.insert("time".into(), Value::Int(st.time));
                }
                m.insert("valid".into(), Value::Bool(false));
                m.insert("error".into(), e.code().into());
                m
            }
        };
        rows.push(Value::Object(row));
    }
    Ok(Some(rows))
}

impl StoreArg {
    /// The remote URL: `--remote`, else the environment.
    pub(crate) fn remote_url(&self) -> Option<String> {
        self.remote
            .clone()
            .or_else(tcg_remote::RemoteConfig::env_url)
    }

    /// The remote, required.
    pub(crate) fn remote(&self) -> anyhow::Result<std::sync::Arc<tcg_remote::Remote>> {
        let url = self.remote_url().context(
            "this command needs a remote: pass --remote s3://bucket/prefix or set TORCH_COMPILED_GRAPHS_REMOTE",
        )?;
        Ok(std::sync::Arc::new(tcg_remote::Remote::from_url(&url)?))
    }

    /// Attach the remote to `engine` when one is configured.
    fn with_configured_remote(&self, engine: Engine) -> anyhow::Result<Engine> {
        Ok(match self.remote_url() {
            Some(url) => {
                engine.with_remote(std::sync::Arc::new(tcg_remote::Remote::from_url(&url)?))
            }
            None => engine,
        })
    }

    /// An engine over the store, created if absent (import, gc), with the
    /// remote attached when one is configured.
    pub(crate) fn engine(&self) -> anyhow::Result<Engine> {
        self.with_configured_remote(self.local_engine()?)
    }

    /// The engine for `resolve`. Without a remote the store must exist
    /// (`store.not_found`; resolving never creates one). With a remote a local
    /// miss is a fetch, which writes, so the local store is created if absent.
    fn resolving(&self) -> anyhow::Result<Engine> {
        if self.remote_url().is_some() {
            self.engine()
        } else {
            self.existing()
        }
    }

    /// The engine over the local store alone, created if absent.
    pub(crate) fn local_engine(&self) -> anyhow::Result<Engine> {
        let root = self.root()?;
        Engine::open(&root).with_context(|| format!("cannot open the store at {}", root.display()))
    }

    /// An engine over an existing local store; nothing is created
    /// (`store.not_found`).
    pub(crate) fn existing(&self) -> anyhow::Result<Engine> {
        let root = self.root()?;
        Engine::open_existing(&root)
            .with_context(|| format!("cannot open the store at {}", root.display()))
    }

    fn root(&self) -> anyhow::Result<PathBuf> {
        let root = match &self.cas_root {
            Some(root) => root.clone(),
            None => {
                let base = std::env::var_os("XDG_CACHE_HOME")
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
                    .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                    .context("set --cas-root, XDG_CACHE_HOME or HOME")?;
                base.join("torch-compiled-graphs")
            }
        };
        Ok(root)
    }
}

/// The metadata as 0.2.0 printed it: `json.dumps(metadata, sort_keys=True, indent=2)`.
fn print_metadata(md: &Value) -> anyhow::Result<()> {
    print_line(&tcg_cj::to_python_indented(md, 2)?)
}

/// A one-line human summary, on stderr so that stdout stays the metadata.
fn summary(md: &Metadata, what: &str) -> String {
    format!(
        "{what} {} ({}, sm {}, {} constants)",
        untrusted(md.key()),
        untrusted(md.name()),
        untrusted(md.sm()),
        md.constants().len()
    )
}

pub(crate) fn print_json(value: &Value) -> anyhow::Result<()> {
    print_line(&tcg_cj::to_canonical_string(value)?)
}

pub(crate) fn print_report(value: &Value, json: bool) -> anyhow::Result<()> {
    if json {
        return print_json(value);
    }
    match untrusted_value(value) {
        Value::Object(m) => {
            for (k, v) in &m {
                let text = match v {
                    Value::Str(s) => s.clone(),
                    other => tcg_cj::to_canonical_string(other)?,
                };
                print_line(&format!("{k:<18} {text}"))?;
            }
            Ok(())
        }
        other => print_json(&other),
    }
}

fn metadata_summary(md: &Metadata) -> Map {
    let mut m = Map::new();
    m.insert("key".into(), md.key().into());
    m.insert("graph_class".into(), md.name().into());
    m.insert("class_hash".into(), md.declaration().class_hash().into());
    m.insert("sm".into(), md.sm().into());
    m.insert(
        "host_isa_level".into(),
        md.host_isa()
            .to_map()
            .get("host_isa_level")
            .cloned()
            .unwrap_or(Value::Null),
    );
    m.insert("constants".into(), Value::Int(md.constants().len() as i64));
    m
}

pub fn dispatch(cli: Cli) -> anyhow::Result<Outcome> {
    match cli.command {
        Command::Build(_) | Command::BuildCell(_) | Command::Toolchain(_) => {
            anyhow::bail!("this command runs in Python; run it through the console script")
        }
        Command::Key {
            graph,
            sm,
            toolchain_axis,
            toolchain,
            json,
        } => {
            let axis = match (toolchain_axis, toolchain) {
                (Some(axis), _) => axis,
                (None, Some(path)) => {
                    let bytes = std::fs::read(&path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let block = tcg_cj::parse_strict(&bytes)
                        .with_context(|| format!("{} is not strict JSON", path.display()))?;
                    let block = identity::validate_toolchain_block(
                        &block,
                        Code::DeclarationToolchainInvalid,
                    )
                    .with_context(|| format!("invalid toolchain block in {}", path.display()))?;
                    identity::toolchain_axis(&block)
                }
                (None, None) => unreachable!("clap requires one of them"),
            };
            let key = identity::derive_key(&graph, &sm, &axis)?;
            if json {
                let mut axes = Map::new();
                axes.insert("graph".into(), graph.into());
                axes.insert("sm".into(), sm.into());
                axes.insert("toolchain".into(), axis.into());
                let mut out = Map::new();
                out.insert("axes".into(), Value::Object(axes));
                out.insert("key".into(), key.into());
                print_line(&tcg_cj::to_canonical_string(&Value::Object(out))?)?;
            } else {
                print_line(&key)?;
            }
            Ok(Outcome::Success)
        }
        Command::Inspect { artifact, json } => {
            let mut report = artifact::inspect(&artifact)
                .with_context(|| format!("cannot inspect {}", artifact.display()))?;
            let signatures = signature_rows(&artifact)?;
            if let (Value::Object(m), Some(rows)) = (&mut report, &signatures) {
                m.insert("signatures".into(), Value::Array(rows.clone()));
            }
            if json {
                print_json(&report)?;
            } else {
                let md = report
                    .as_object()
                    .and_then(|r| r.get("metadata"))
                    .cloned()
                    .unwrap_or(Value::Null);
                print_metadata(&md)?;
                // stdout stays the metadata JSON (0.2.0's output); signers are notes on stderr.
                for row in signatures.iter().flatten() {
                    let r = row.as_object().expect("rows are objects");
                    // An unverified statement's producer is anyone's text.
                    let text = |k: &str| match r.get(k) {
                        Some(Value::Str(s)) => untrusted(s),
                        Some(Value::Int(i)) => i.to_string(),
                        _ => "-".into(),
                    };
                    let verdict = match r.get("error") {
                        Some(Value::Str(code)) => untrusted(code),
                        _ => "valid".into(),
                    };
                    eprintln!(
                        "signature {} producer={} time={} {verdict}",
                        text("fingerprint"),
                        text("producer"),
                        text("time")
                    );
                }
            }
            Ok(Outcome::Success)
        }
        Command::Verify {
            artifact,
            host,
            trust,
            json,
        } => {
            let report = artifact::verify(&artifact, host)
                .with_context(|| format!("{} was refused", artifact.display()))?;
            let config = trust.settings().load()?;
            let mut m = metadata_summary(&report.envelope.metadata);
            if let Some(policy) = config.policy() {
                // The subject of the bytes just verified (one read of one
                // handle), never a second read of the path.
                let subject = tcg_core::engine::subject_of(
                    &report.envelope.metadata,
                    &report.envelope_sha256,
                );
                let sig = sig_path(&artifact);
                let entries = match tcg_trust::read_small_file(&sig) {
                    Ok(bytes) => tcg_trust::parse_document(&bytes)
                        .map_err(tcg_core::Error::from_trust)
                        .with_context(|| format!("cannot read {}", sig.display()))?,
                    Err(tcg_trust::TrustError::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::NotFound =>
                    {
                        Vec::new()
                    }
                    Err(e) => return Err(tcg_core::Error::from_trust(e).into()),
                };
                let admitted = policy
                    .admit(&entries, &subject, tcg_trust::unix_now())
                    .map_err(tcg_core::Error::from_trust)
                    .with_context(|| format!("{} was refused", artifact.display()))?;
                m.insert("trusted".into(), Value::Bool(true));
                m.insert("trusted_by".into(), signature_summary(&admitted.signature));
            }
            m.insert(
                "envelope_sha256".into(),
                report.envelope_sha256.to_hex().into(),
            );
            m.insert("verified".into(), Value::Bool(true));
            m.insert(
                "host_admitted".into(),
                Value::Bool(report.admitted.is_some()),
            );
            m.insert(
                "package_bytes".into(),
                Value::Int(report.envelope.package_bytes as i64),
            );
            if json {
                print_json(&Value::Object(m))?;
            } else {
                let md = &report.envelope.metadata;
                let admitted = if report.admitted.is_some() {
                    ", admitted on this host"
                } else {
                    ""
                };
                eprintln!("{}{admitted}", summary(md, "verified"));
                if let Some(Value::Object(t)) = m.get("trusted_by") {
                    let text = |k: &str| untrusted(t.get(k).and_then(Value::as_str).unwrap_or("-"));
                    eprintln!(
                        "trusted: signed by {} (producer {})",
                        text("fingerprint"),
                        text("producer")
                    );
                }
                print_metadata(&Value::Object(md.value().clone()))?;
            }
            Ok(Outcome::Success)
        }
        Command::Resolve {
            store,
            trust,
            key,
            dest,
            json,
        } => {
            let engine = store.resolving()?.with_trust(trust.settings().load()?);
            match engine.resolve(&key, &dest) {
                Ok(Some(r)) => {
                    let mut m = metadata_summary(&r.metadata);
                    m.insert(
                        "destination".into(),
                        r.destination.display().to_string().into(),
                    );
                    m.insert("manifest".into(), r.manifest.into());
                    m.insert("source".into(), r.source.as_str().into());
                    if json {
                        print_json(&Value::Object(m))?;
                    } else {
                        eprintln!(
                            "{} at {}",
                            summary(&r.metadata, "resolved"),
                            r.destination.display()
                        );
                        print_metadata(&Value::Object(r.metadata.value().clone()))?;
                    }
                    Ok(Outcome::Success)
                }
                Ok(None) => {
                    eprintln!("miss: no servable artifact is stored for {key}");
                    Ok(Outcome::Negative)
                }
                Err(e) if e.kind() == tcg_core::Kind::Quarantined => {
                    eprintln!(
                        "quarantined: {} ({})",
                        tcg_core::text::message(&e.to_string()),
                        e.code()
                    );
                    Ok(Outcome::Negative)
                }
                Err(e) => Err(anyhow::Error::new(e).context(format!("cannot resolve {key}"))),
            }
        }
        Command::Import {
            store,
            trust,
            key,
            path,
            json,
        } => {
            let r = store
                .engine()?
                .with_trust(trust.settings().load()?)
                .import_artifact(&key, &path)
                .with_context(|| format!("cannot import {}", path.display()))?;
            let mut m = Map::new();
            m.insert("outcome".into(), r.outcome.as_str().into());
            m.insert("key".into(), r.key.into());
            m.insert("manifest".into(), r.manifest.into());
            print_report(&Value::Object(m), json)?;
            Ok(Outcome::Success)
        }
        Command::Adopt {
            from_hashrepo,
            store,
            trust,
            json,
        } => {
            // Before the new store is created: it must not land in the old root.
            tcg_core::engine::check_adopt_layout(&from_hashrepo, &store.root()?)?;
            crate::adopt::run(
                &store.engine()?.with_trust(trust.settings().load()?),
                &from_hashrepo,
                json,
            )
        }
        Command::Export { store, key, path } => {
            let out = store
                .engine()?
                .export_artifact(&key, &path)
                .with_context(|| format!("cannot export {key}"))?;
            print_line(&out.display().to_string())?;
            Ok(Outcome::Success)
        }
        Command::Sign {
            store,
            key,
            producer,
            graph_key,
            json,
        } => {
            let settings = TrustSettings {
                signing_key: Some(key.clone()),
                producer,
                ..TrustSettings::default()
            }
            .with_env();
            let signer = tcg_trust::Signer::from_file(&key).map_err(tcg_core::Error::from_trust)?;
            let out = store
                .engine()?
                .sign_stored(&graph_key, &signer, settings.producer.as_deref())
                .with_context(|| format!("cannot sign {graph_key}"))?;
            print_report(&out, json)?;
            Ok(Outcome::Success)
        }
        Command::Ls { store, json } => {
            let rows = store.existing()?.list()?;
            if json {
                print_json(&rows)?;
            } else {
                for row in rows.as_array().into_iter().flatten() {
                    let r = row.as_object().expect("rows are objects");
                    let text = |k: &str| match r.get(k) {
                        Some(Value::Str(s)) => untrusted(s),
                        Some(Value::Int(i)) => i.to_string(),
                        Some(Value::Bool(b)) => b.to_string(),
                        _ => "-".into(),
                    };
                    print_line(&format!(
                        "{}  {}  {}  {}  last_use_ns={}{}",
                        text("key"),
                        text("graph_class"),
                        text("sm"),
                        text("size"),
                        text("last_use_ns"),
                        if text("quarantined") == "true" {
                            "  QUARANTINED"
                        } else {
                            ""
                        }
                    ))?;
                }
            }
            Ok(Outcome::Success)
        }
        Command::Gc {
            store,
            max_bytes,
            json,
        } => {
            print_report(&store.engine()?.gc(max_bytes)?, json)?;
            Ok(Outcome::Success)
        }
        Command::Fsck {
            store,
            quarantine,
            json,
        } => {
            let (report, clean) = store.existing()?.fsck(quarantine)?;
            print_report(&report, json)?;
            Ok(if clean {
                Outcome::Success
            } else {
                Outcome::Negative
            })
        }
        Command::Explain {
            store,
            keys,
            graph_class,
            json,
        } => crate::explain::run(&store.engine()?, &keys, graph_class.as_deref(), json),
        Command::Stats {
            store,
            json,
            prometheus,
        } => {
            let stats = store.existing()?.stats()?;
            if prometheus {
                print_line(crate::fleet::prometheus(&stats).trim_end())?;
            } else {
                print_report(&stats, json)?;
            }
            Ok(Outcome::Success)
        }
        Command::Push {
            store,
            keys,
            from,
            json,
        } => crate::fleet::push(&store, keys, from, json),
        Command::Pull {
            store,
            trust,
            admitted_copy,
            keys,
            from,
            json,
        } => crate::fleet::pull(
            &store,
            trust.settings().load()?,
            admitted_copy,
            keys,
            from,
            json,
        ),
        Command::Fleet { command } => crate::fleet::dispatch(command),
        Command::CheckKey { value } => {
            if identity::is_compiled_graph_key(&value) {
                print_line("valid")?;
                Ok(Outcome::Success)
            } else {
                print_line("invalid")?;
                Ok(Outcome::Negative)
            }
        }
    }
}
