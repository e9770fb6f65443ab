//! The engine (SPEC-v1 §10): resolve, ensure, import and export over the
//! content-addressed store, with host admission, quarantine and repair, and
//! single-flight minting.
//!
//! The engine never imports torch and never calls a compiler itself: on a
//! miss, [`Engine::ensure`] calls the caller's mint callback (the Python layer
//! runs the recipe and the sole compile policy there) and then packs,
//! verifies, stores and resolves what it returns.

mod admin;
mod admission;
mod admitted;
mod adopt;
mod destination;
mod explain;
mod explain_text;
mod export;
pub mod hashrepo;
mod mint;
mod publish;
mod quarantine;
mod remote;
mod remote_trust;
mod resolve;
mod signatures;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tcg_cas::{Digest, Store, StoreError, GRAPH_REF_PREFIX, QUARANTINE_REF_PREFIX};

use crate::artifact::Metadata;
use crate::identity::is_compiled_graph_key;
use crate::{Code, Error, Result};

pub use admin::Counter;
pub use admission::{admission_ref, Basis, ADMISSION_REF_PREFIX};
pub use admitted::{admitted_ref, ADMITTED_REF_PREFIX};
pub use adopt::{AdoptEntry, AdoptStatus};
pub use explain::{
    pair_report, witness_lines_ref, EXPLAIN_NEIGHBOURS, EXPLAIN_SCAN_MAX, WITNESS_LINES_REF_PREFIX,
};
pub use explain_text::{render_class, render_explanation, render_pair};
pub use mint::{MintOutput, MintedLiteral};
pub use remote::{
    set_warn_hook as set_remote_warn_hook, warn as remote_warn, EnvelopeStream, FailureSlot,
    Flight, RemoteEnvelope, RemoteError, RemotePublication, RemoteTier, Source, StreamFailure,
    WarnHook,
};
pub use remote_trust::{LocalRecords, Pulled, RemoteSignature, SignatureRecords, MAX_CANDIDATES};
pub use signatures::{
    default_producer, envelope_subject, sig_path, signature_ref, signature_summary, subject_of,
    TrustConfig, TrustSettings, SIGNATURE_REF_PREFIX,
};

/// What publication decided (SPEC-v1 §10.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// The key was absent; the candidate now serves it.
    Stored,
    /// The candidate is what already serves the key.
    Present,
    /// A quarantined or unreadable record was replaced, or its marker retired.
    Repaired,
    /// A healthy, different artifact serves the key; the candidate was set aside.
    Divergent,
}

impl StoreOutcome {
    /// The outcome's name, as the Python enum spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOutcome::Stored => "STORED",
            StoreOutcome::Present => "PRESENT",
            StoreOutcome::Repaired => "REPAIRED",
            StoreOutcome::Divergent => "DIVERGENT",
        }
    }
}

/// The result of publishing a verified artifact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreResult {
    /// The publication verdict.
    pub outcome: StoreOutcome,
    /// The key.
    pub key: String,
    /// The manifest digest of the candidate envelope (64 hex).
    pub manifest: String,
}

/// Whether `ensure` reused a stored artifact or minted one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// Served from the store; the mint callback was not called (or lost a race).
    Reused,
    /// Compiled, stored and resolved by this call.
    Minted,
}

impl EnsureOutcome {
    /// The outcome's name, as the Python enum spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            EnsureOutcome::Reused => "REUSED",
            EnsureOutcome::Minted => "MINTED",
        }
    }
}

/// A resolved artifact, unpacked and admitted at `destination`.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The key.
    pub key: String,
    /// The published directory.
    pub destination: PathBuf,
    /// The validated metadata.
    pub metadata: Metadata,
    /// The manifest digest of the envelope that was selected (64 hex).
    pub manifest: String,
    /// Where it came from (set by the caller that knows: local by default).
    pub source: Source,
}

impl Resolved {
    fn fetched(mut self) -> Resolved {
        self.source = Source::Remote;
        self
    }
}

/// The result of `ensure`.
#[derive(Debug, Clone)]
pub struct EnsureResult {
    /// Reused or minted.
    pub outcome: EnsureOutcome,
    /// What was resolved at the destination.
    pub resolved: Resolved,
    /// The publication result on the miss path; `None` on a hit.
    pub publication: Option<StoreResult>,
    /// The remote tier's publication verdict, when a mint was published there.
    pub remote_publication: Option<RemotePublication>,
}

/// What an `ensure` caller requests (SPEC-v1 §4.5): a target and a toolchain block.
#[derive(Debug, Clone)]
pub struct Request {
    /// `cpu` or `sm_NN[a]`, lower-cased and trimmed by [`Request::new`].
    pub target: String,
    /// The requested toolchain block.
    pub toolchain: std::collections::BTreeMap<String, String>,
}

impl Request {
    /// Validate a request: a non-empty target and a valid toolchain block,
    /// else `admission.request_invalid`.
    pub fn new(target: &str, toolchain: &tcg_cj::Value) -> Result<Request> {
        let invalid = || {
            Error::new(
                Code::AdmissionRequestInvalid,
                "ensure requires target and a recorded toolchain block",
            )
        };
        let target = tcg_cj::trim_w(target).to_lowercase();
        if target.is_empty() {
            return Err(invalid());
        }
        let toolchain =
            crate::identity::validate_toolchain_block(toolchain, Code::AdmissionRequestInvalid)
                .map_err(|e| invalid().context(e.message()))?;
        Ok(Request { target, toolchain })
    }

    /// The request check on a stored artifact (SPEC-v1 §4.5).
    pub fn admit(&self, metadata: &Metadata) -> Result<()> {
        let sm = metadata.sm();
        if !(sm == self.target || (self.target == "cpu" && sm.starts_with("cpu-"))) {
            return Err(Error::new(
                Code::AdmissionTargetMismatch,
                format!(
                    "stored artifact is for sm {sm:?}, requested target is {:?}",
                    self.target
                ),
            ));
        }
        let stored = crate::identity::toolchain_axis(metadata.toolchain());
        let wanted = crate::identity::toolchain_axis(&self.toolchain);
        if stored != wanted {
            return Err(Error::new(
                Code::AdmissionToolchainMismatch,
                format!("stored artifact was compiled by toolchain {stored}, requested toolchain is {wanted}"),
            ));
        }
        Ok(())
    }
}

/// The engine over one store root.
#[derive(Debug, Clone)]
pub struct Engine {
    store: Store,
    lock_timeout: Option<Duration>,
    trust: TrustConfig,
    remote: Option<std::sync::Arc<dyn RemoteTier>>,
}

impl Engine {
    /// Open (creating if needed) the store at `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Engine> {
        let store = Store::open(root.as_ref()).map_err(store_err)?;
        Ok(Engine {
            store,
            lock_timeout: None,
            trust: TrustConfig::default(),
            remote: None,
        })
    }

    /// Open an existing store without creating anything (`store.not_found`
    /// for a missing root, a root without `FORMAT` or a missing store
    /// directory): for read-only commands, so that a mistyped root is an
    /// error rather than a new, empty store.
    pub fn open_existing(root: impl AsRef<Path>) -> Result<Engine> {
        let store = Store::open_existing(root.as_ref()).map_err(store_err)?;
        Ok(Engine {
            store,
            lock_timeout: None,
            trust: TrustConfig::default(),
            remote: None,
        })
    }

    /// Refuse a destination inside the store root
    /// (`store.destination_in_store`): publishing there would mix foreign
    /// entries into the store (under `objects/` they once blocked every GC).
    pub(crate) fn refuse_destination_in_store(&self, dest: &Path) -> Result<()> {
        let Ok(root) = std::fs::canonicalize(self.store.root()) else {
            return Ok(());
        };
        let Some(full) = resolved_path(dest)? else {
            return Ok(());
        };
        if full.starts_with(&root) {
            return Err(Error::new(
                Code::StoreDestinationInStore,
                format!(
                    "destination {} is inside the store root {}; choose a path outside it",
                    dest.display(),
                    root.display()
                ),
            ));
        }
        Ok(())
    }

    /// Wait at most `timeout` for another process's mint of the same key
    /// (`store.mint_lock_timeout`); `None` waits indefinitely.
    pub fn with_lock_timeout(mut self, timeout: Option<Duration>) -> Engine {
        self.lock_timeout = timeout;
        self
    }

    /// The underlying store.
    pub fn store(&self) -> &Store {
        &self.store
    }
}

/// `path` made absolute with symlinks resolved, even when it does not exist
/// yet (its nearest existing ancestor is resolved and the rest appended);
/// `None` when no ancestor resolves.
pub(crate) fn resolved_path(path: &Path) -> Result<Option<PathBuf>> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io("cannot read the current directory", &e))?
            .join(path)
    };
    let mut probe = abs.as_path();
    let mut rest = Vec::new();
    let resolved = loop {
        match std::fs::canonicalize(probe) {
            Ok(p) => break Some(p),
            Err(_) => {
                let (Some(parent), Some(name)) = (probe.parent(), probe.file_name()) else {
                    break None;
                };
                rest.push(name.to_owned());
                probe = parent;
            }
        }
    };
    Ok(resolved.map(|mut full| {
        for name in rest.iter().rev() {
            full.push(name);
        }
        full
    }))
}

/// Refuse an `adopt` layout where the new store root and the old (0.2.0)
/// root overlap (`store.adopt_overlap`): a new root inside the old one would
/// write into the old store, which adoption promises never to touch; an old
/// root inside the new one would put foreign files inside the store (GC and
/// fsck own everything there). Call it before the new store is created.
pub fn check_adopt_layout(old_root: &Path, new_root: &Path) -> Result<()> {
    let (Some(old), Some(new)) = (resolved_path(old_root)?, resolved_path(new_root)?) else {
        return Ok(());
    };
    let why = if new == old {
        Some("they are the same directory")
    } else if new.starts_with(&old) {
        Some("the new store root lies inside the old root, so adopting would write into the old store")
    } else if old.starts_with(&new) {
        Some("the old root lies inside the new store root, where the store owns every file")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::new(
            Code::StoreAdoptOverlap,
            format!(
                "cannot adopt {} into {}: {why}",
                old_root.display(),
                new_root.display()
            ),
        )),
        None => Ok(()),
    }
}

/// `store.key_invalid` unless `key` is a compiled-graph key (SPEC-v1 §10.1).
pub fn check_key(key: &str) -> Result<()> {
    if is_compiled_graph_key(key) {
        Ok(())
    } else {
        Err(Error::new(
            Code::StoreKeyInvalid,
            format!("v1 storage requires a compiled-graph key, got {key:?}"),
        ))
    }
}

/// The graph ref of a key (wire identity, SPEC-v1 §9.5).
pub fn graph_ref(key: &str) -> String {
    format!("{GRAPH_REF_PREFIX}{key}")
}

/// The quarantine ref of (key, manifest) (wire identity, SPEC-v1 §9.5).
pub fn quarantine_ref(key: &str, manifest: &Digest) -> String {
    format!("{QUARANTINE_REF_PREFIX}{key}/{}", manifest.to_hex())
}

/// Map a store error to the core error with the same code.
pub fn store_err(err: StoreError) -> Error {
    let message = err.to_string();
    match &err {
        StoreError::Io { source, .. } => {
            Error::io_code(Code::IoError, source.raw_os_error(), message)
        }
        StoreError::DestinationOccupied { .. } => {
            Error::io_code(Code::IoDestinationOccupied, Some(17), message)
        }
        _ => Error::new(
            Code::from_str_code(err.code()).unwrap_or(Code::StoreRefInvalid),
            message,
        ),
    }
}

#[cfg(test)]
mod tests;

/// What a read of an envelope does with its members besides verifying them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Members {
    /// Stream them into the store (the admitted copy); the checks that read
    /// a member again read the store's copy.
    Store,
    /// Stream them into the store and stage them as files (for a destination).
    StoreAndStage,
    /// Stage them as files for the checks only: nothing is stored, and the
    /// first resolve that reads the envelope records the admitted copy
    /// (`pull` without `--admitted-copy`).
    Stage,
}

/// A private working directory inside the store's `tmp/`, named after the
/// lease that owns it so that GC reaps it only once that lease is dead.
/// Removed on drop.
pub(crate) struct StoreStage {
    path: PathBuf,
    /// The members as streamed into the store while they were staged and
    /// verified ([`StoreStage::read_envelope`]), each with the file it is
    /// stored as; empty until an envelope has passed.
    stored: Vec<(&'static str, tcg_cas::ManifestInfo)>,
}

impl StoreStage {
    pub(crate) fn new(engine: &Engine, lease: &tcg_cas::Lease) -> Result<StoreStage> {
        let path = engine.store.root().join("tmp").join(format!(
            "{}.stage-{}",
            lease.id(),
            quarantine::random_hex32()?
        ));
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let io =
            |e: std::io::Error| Error::io(format_args!("cannot create {}", path.display()), &e);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(io)?;
        // Private whatever the umask: what is verified here is stored.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        Ok(StoreStage {
            path,
            stored: Vec::new(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Read and fully verify the envelope `input`
    /// ([`crate::artifact::read_envelope_into`]), streaming each member into
    /// the store unless `members` is [`Members::Stage`]; once verified, the
    /// stage knows the files they are stored as ([`StoreStage::stored`]).
    /// The members are also staged as files in this stage where `members`
    /// says so (for a destination, or for the checks when nothing is
    /// stored); otherwise nothing is written twice: the checks that read a
    /// member again read the store's copy.
    pub(crate) fn read_envelope(
        &mut self,
        engine: &Engine,
        lease: &tcg_cas::Lease,
        input: impl std::io::Read,
        admission: &mut dyn FnMut(&Metadata) -> Result<()>,
        members: Members,
    ) -> Result<crate::artifact::EnvelopeReport> {
        if members == Members::Stage {
            return crate::artifact::read_envelope(input, &self.path, admission);
        }
        let mut sink = StoreMembers {
            store: engine.store.clone(),
            lease,
            keeps: members == Members::Store,
            current: None,
            done: Vec::new(),
        };
        let report = crate::artifact::read_envelope_into(input, &self.path, admission, &mut sink)?;
        self.stored = sink.done;
        Ok(report)
    }

    /// The stored file of `member`, when it was streamed into the store.
    pub(crate) fn stored(&self, member: &str) -> Option<&tcg_cas::ManifestInfo> {
        self.stored
            .iter()
            .find(|(name, _)| *name == member)
            .map(|(_, info)| info)
    }
}

impl Drop for StoreStage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A [`crate::artifact::MemberSink`] that streams each member into the store
/// (chunks hashed, written and installed on the writer's helper threads) as
/// it is staged, so that recording the admitted copy afterwards does not read
/// the staged files back. The chunks stay pinned by the lease; they become
/// garbage if verification fails.
struct StoreMembers<'l> {
    store: tcg_cas::Store,
    lease: &'l tcg_cas::Lease,
    /// The checks read the stored members (nothing is staged as a file).
    keeps: bool,
    current: Option<(&'static str, tcg_cas::ChunkedWriter<'l>)>,
    done: Vec<(&'static str, tcg_cas::ManifestInfo)>,
}

impl crate::artifact::MemberSink for StoreMembers<'_> {
    fn begin(&mut self, member: &'static str, size: u64) -> Result<()> {
        self.current = Some((member, self.store.chunked_writer_sized(self.lease, size)));
        Ok(())
    }

    fn bytes(&mut self, data: &[u8]) -> Result<()> {
        use std::io::Write;
        let (member, w) = self.current.as_mut().expect("begin comes first");
        let member: &'static str = member;
        w.write_all(data)
            .map_err(|e| store_err(tcg_cas::StoreError::from_io(e, "store member", member)))
    }

    fn end(&mut self) -> Result<()> {
        let (member, w) = self.current.take().expect("begin comes first");
        let info = w.finish().map_err(store_err)?;
        self.done.push((member, info));
        Ok(())
    }

    fn keeps(&self) -> bool {
        self.keeps
    }

    fn reopen(
        &mut self,
        member: &'static str,
    ) -> Result<Option<(Box<dyn crate::artifact::package::ReadSeek>, u64)>> {
        if !self.keeps {
            return Ok(None);
        }
        let Some((_, info)) = self.done.iter().find(|(name, _)| *name == member) else {
            return Ok(None);
        };
        let file = self
            .store
            .open_stored(self.lease, &info.manifest)
            .map_err(store_err)?;
        let len = file.len();
        Ok(Some((Box::new(file), len)))
    }
}
