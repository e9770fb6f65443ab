//! The hook of the remote (fleet) tier: a small trait that the engine calls
//! on a local miss, implemented outside the core (tcg-remote) so that the
//! core stays free of network I/O.
//!
//! The remote is a source of envelopes and a place to publish them, never a
//! place to serve from (FLEET.md): whatever it hands out goes through the same
//! full verification and host admission as `import_artifact` before it is
//! published locally, and any remote failure is at most a local miss.

use std::fmt;
use std::sync::{Arc, Mutex};

use tcg_cas::{Digest, SharedBytes, Store};

use super::admin::Counter;
use super::remote_trust::{Fetched, SignatureRecords};
use super::{Engine, StoreOutcome};
use crate::Kind;

/// Where a resolved graph came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Served from the local store as it was.
    Local,
    /// Fetched from the remote tier, verified and stored locally first.
    Remote,
    /// Compiled by this call.
    Compiled,
}

impl Source {
    /// The source's name, as Python spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Local => "local",
            Source::Remote => "remote",
            Source::Compiled => "compiled",
        }
    }
}

/// Why a fetched stream failed, recorded by the remote's reader before the
/// envelope reader turns the failure into its own error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamFailure {
    /// The transport failed (timeout, reset, 5xx): no proof about the record.
    Transport(String),
    /// The bytes are proven wrong (a chunk's digest or length, the whole file).
    Bad(String),
    /// The remote does not have a chunk its manifest lists: a miss, not
    /// proof (a collection may have raced the fetch, or the record is
    /// incomplete).
    Missing(String),
}

/// A shared slot the remote's reader fills when its stream fails.
pub type FailureSlot = Arc<Mutex<Option<StreamFailure>>>;

/// An envelope's bytes as the remote tier streams them: frames in order, as
/// they arrive. The stream checks every chunk (length and SHA-256) against
/// the remote manifest and hands out a chunk's last frame only once the
/// check has passed: a consumer that has every byte of a chunk has proven
/// bytes. On a failure it records why in its [`FailureSlot`] and errs.
pub trait EnvelopeStream: Send {
    /// The next frame; `Ok(None)` at the end of the envelope.
    fn next_frame(&mut self) -> std::io::Result<Option<SharedBytes>>;
    /// After the consumer stopped inside a chunk (its parser refused what it
    /// read): read that chunk to its end so that its check decides whether
    /// the refused bytes are the remote's (recorded as a failure if not).
    fn settle(&mut self);
    /// The SHA-256 state after the first chunk, once that chunk is checked,
    /// for the local writer of the stream's (known) chunks to continue its
    /// whole-file hash from; taken once, before the first frame.
    fn first_chunk_state(&mut self) -> Option<tcg_cas::FirstChunkState> {
        None
    }
}

/// An envelope the remote serves for a key, as a stream whose chunks are
/// checked against the (already verified) remote manifest while it is read.
pub struct RemoteEnvelope {
    /// The remote manifest the ref names (SHA-256 checked).
    pub manifest: Digest,
    /// The file digest that manifest states (not yet proven: the stream and
    /// the local manifest prove it), for decisions made before any chunk
    /// is fetched (a signature statement about another envelope).
    pub file_digest: Digest,
    /// The file length that manifest states.
    pub size: u64,
    /// The envelope's bytes; no chunk is requested before its first frame.
    pub reader: Box<dyn EnvelopeStream>,
    /// The chunks `reader` checks its bytes against (digest and length),
    /// each before handing out its last frame: the remote manifest's list.
    /// The local store does not hash them again.
    pub chunks: Vec<tcg_cas::Chunk>,
    /// Filled by `reader` when it fails.
    pub failure: FailureSlot,
}

impl fmt::Debug for RemoteEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteEnvelope")
            .field("manifest", &self.manifest.to_hex())
            .finish_non_exhaustive()
    }
}

/// A remote failure. Never fatal to `resolve` or `ensure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteError {
    /// Unreachable, slow, refused, throttled, 5xx: a miss and a warning.
    Unavailable(String),
    /// A record that fails verification (ref, manifest): evidence is
    /// written and the key is a miss. `manifest` is the 64-hex name the ref
    /// gave, when it gave one.
    Bad {
        /// The manifest the ref named.
        manifest: Option<String>,
        /// What is wrong with it.
        why: String,
    },
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::Unavailable(m) => write!(f, "remote unavailable: {m}"),
            RemoteError::Bad { why, .. } => write!(f, "remote record is bad: {why}"),
        }
    }
}

/// What publishing to the remote decided (FLEET.md §2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePublication {
    /// `Stored` (we created the ref), `Present` (it already names our
    /// manifest) or `Divergent` (another manifest won).
    pub outcome: StoreOutcome,
    /// The manifest the remote ref names now (64 hex).
    pub manifest: String,
}

/// The single-flight decision before a compile (FLEET.md §4).
pub enum Flight {
    /// This worker holds the fleet lease; dropping the guard releases it.
    Lead(Box<dyn Send>),
    /// Another worker holds a live lease: wait for its ref.
    Follow,
    /// No single-flight (the remote is unavailable or not qualified).
    Solo,
}

impl fmt::Debug for Flight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Flight::Lead(_) => "Lead",
            Flight::Follow => "Follow",
            Flight::Solo => "Solo",
        })
    }
}

/// The remote tier as the engine sees it.
pub trait RemoteTier: Send + Sync + fmt::Debug {
    /// The envelope the remote's ref names for `key`, after checking the ref
    /// (its key) and the manifest (SHA-256, shape, size limits). `Ok(None)`
    /// is a clean miss (no ref, or a missing chunk).
    fn open(&self, key: &str) -> Result<Option<RemoteEnvelope>, RemoteError>;

    /// Publish the locally stored envelope `manifest` under `key`, first
    /// writer wins.
    fn publish(
        &self,
        store: &Store,
        key: &str,
        manifest: &Digest,
    ) -> Result<RemotePublication, RemoteError>;

    /// Try to take the fleet-wide compile lease of `key`.
    fn begin_flight(&self, key: &str) -> Flight;

    /// Wait, bounded, for another worker's ref of `key`; `true` once it exists.
    fn await_flight(&self, key: &str) -> bool;

    /// Write create-only evidence that the record (key, manifest) is bad.
    /// Returns whether evidence was written.
    fn report(&self, key: &str, manifest: &str, why: &str) -> bool;

    /// The signature records of `key` (docs/fleet.md, "Trust"): the manifest
    /// `refs/<key>` names, and the records under
    /// `signatures/<key>/<fp>/` for each fingerprint in `fingerprints`
    /// (`None`: every signer), bounded per signer and in size; a record whose
    /// name or bytes are malformed is skipped with its reason. The records'
    /// signatures are not checked here. A remote without signatures has none.
    fn signature_records(
        &self,
        key: &str,
        fingerprints: Option<&[String]>,
    ) -> Result<SignatureRecords, RemoteError> {
        let _ = (key, fingerprints);
        Ok(SignatureRecords::default())
    }

    /// The envelope of manifest `manifest` (named by a signature record, not
    /// by the ref), checked like [`RemoteTier::open`]. `Ok(None)`: absent.
    fn open_manifest(
        &self,
        key: &str,
        manifest: &Digest,
    ) -> Result<Option<RemoteEnvelope>, RemoteError> {
        let _ = (key, manifest);
        Ok(None)
    }

    /// Write one signature record of `key` about `manifest` by the signer
    /// `fingerprint_hex`, create-only. `Ok(true)`: written; `Ok(false)`: an
    /// identical record was there.
    fn publish_signature(
        &self,
        key: &str,
        manifest: &Digest,
        fingerprint_hex: &str,
        record: &[u8],
    ) -> Result<bool, RemoteError> {
        let _ = (key, manifest, fingerprint_hex, record);
        Ok(false)
    }

    /// Wait, bounded, for another worker's compile of `key` to produce a
    /// record signed by one of `fingerprints` (a trusting follower: the ref
    /// may name an untrusted artifact). `true` once one exists.
    fn await_signed(&self, key: &str, fingerprints: &[String]) -> bool {
        let _ = fingerprints;
        self.await_flight(key)
    }

    /// The manifest the remote's ref of `key` names, after checking the
    /// ref's key; `Ok(None)` when there is no ref. Nothing is fetched beyond
    /// the ref (for `explain`). The default cannot tell.
    fn has_ref(&self, key: &str) -> Result<Option<Digest>, RemoteError> {
        let _ = key;
        Err(RemoteError::Unavailable(
            "this remote tier cannot look up refs".into(),
        ))
    }
}

/// A receiver of remote-tier warnings (one line, without a prefix).
pub type WarnHook = Box<dyn Fn(&str) + Send + Sync>;

static WARN_HOOK: std::sync::OnceLock<WarnHook> = std::sync::OnceLock::new();

/// Send remote-tier warnings to `hook` instead of stderr (the Python layer
/// forwards them to its logger). Set once per process: `false` when a hook
/// was set already (that one stays).
pub fn set_warn_hook(hook: WarnHook) -> bool {
    WARN_HOOK.set(hook).is_ok()
}

/// One warning: a remote problem never fails the caller. On stderr as
/// `torch-compiled-graphs: warning: remote tier: …` unless a hook is set.
pub fn warn(what: impl fmt::Display) {
    // Remote content (names, server answers) is untrusted text: one
    // escaped, capped line whatever it holds.
    let line = crate::text::message(&format!("remote tier: {what}"));
    match WARN_HOOK.get() {
        Some(hook) => hook(&line),
        None => eprintln!("torch-compiled-graphs: warning: {line}"),
    }
}

impl Engine {
    /// Use `remote` on a local miss.
    pub fn with_remote(mut self, remote: Arc<dyn RemoteTier>) -> Engine {
        self.remote = Some(remote);
        self
    }

    /// The configured remote tier.
    pub fn remote(&self) -> Option<&Arc<dyn RemoteTier>> {
        self.remote.as_ref()
    }

    pub(crate) fn remote_bad(&self, remote: &dyn RemoteTier, key: &str, manifest: &str, why: &str) {
        warn(format_args!("{key}: {why}"));
        self.count(Counter::RemoteError);
        if remote.report(key, manifest, why) {
            self.count(Counter::RemoteReport);
        }
    }

    /// On a local miss: fetch `key` from the remote, verify it fully, admit
    /// it on this host and publish it locally. `true` when the local store
    /// now has a record for `key` that came from the remote. Never an error.
    /// With a trust policy the candidates are the signed ones (remote_trust).
    pub(crate) fn fetch_remote(&self, key: &str) -> bool {
        self.fetch_remote_with(key, super::Members::Store)
    }

    /// [`Engine::fetch_remote`], storing the admitted copy now
    /// ([`super::Members::Store`]) or leaving it to the first resolve
    /// ([`super::Members::Stage`]).
    pub(crate) fn fetch_remote_with(&self, key: &str, members: super::Members) -> bool {
        let Some(remote) = self.remote.clone() else {
            return false;
        };
        if self.trust().has_policy() {
            return self
                .fetch_remote_trusted(key, &*remote, members)
                .is_published();
        }
        let envelope = match remote.open(key) {
            Ok(Some(e)) => e,
            Ok(None) => {
                self.count(Counter::RemoteMiss);
                return false;
            }
            Err(RemoteError::Unavailable(m)) => {
                warn(format_args!("{key}: {m}"));
                self.count(Counter::RemoteError);
                return false;
            }
            Err(RemoteError::Bad { manifest, why }) => {
                let m = manifest.unwrap_or_else(|| "0".repeat(64));
                self.remote_bad(&*remote, key, &m, &why);
                return false;
            }
        };
        self.ingest_remote(&*remote, key, envelope, None, members)
            .is_published()
    }

    /// Verify, admit and publish a fetched envelope of `key`. With
    /// `signatures`, the trust policy must admit the verified artifact by one
    /// of them before any ref is written (a refusal is `Fetched::Refused`,
    /// never evidence: unsigned is not corrupt); the valid ones are stored
    /// beside it. Counts hits, misses and errors, never refusals.
    pub(crate) fn ingest_remote(
        &self,
        remote: &dyn RemoteTier,
        key: &str,
        envelope: RemoteEnvelope,
        signatures: Option<&[tcg_trust::SignedStatement]>,
        members: super::Members,
    ) -> Fetched {
        let envelope_manifest = envelope.manifest;
        let manifest = envelope_manifest.to_hex();
        let failure = envelope.failure.clone();
        let lease = match self.store.lease() {
            Ok(l) => l,
            Err(e) => {
                warn(format_args!("{key}: local store: {e}"));
                return Fetched::Miss;
            }
        };
        // The stream hands out only bytes already checked against the remote
        // manifest's chunks; when those cut as this store cuts (every chunk
        // but the last full), the local writer takes their digests as they
        // are. Otherwise it hashes, and the manifest comparison below decides.
        let step = self.store.chunk_bytes();
        let canonical = envelope
            .chunks
            .split_last()
            .is_some_and(|(last, rest)| rest.iter().all(|c| c.len == step) && last.len <= step);
        let known = canonical.then_some(envelope.chunks.as_slice());
        let mut stream = envelope.reader;
        let first = known.and_then(|_| stream.first_chunk_state());
        let ingested = self.ingest_frames(&lease, &mut *stream, key, known, first, members);
        let unsettled = |s: &FailureSlot| s.lock().map(|s| s.is_none()).unwrap_or(false);
        if let Err(e) = &ingested {
            // A refusal that would be evidence is only evidence once the
            // bytes refused are proven the remote's: the stream checks the
            // chunk the parser stopped in.
            if !matches!(e.kind(), Kind::Admission | Kind::Io) && unsettled(&failure) {
                stream.settle();
            }
        }
        drop(stream);
        let recorded = failure.lock().map(|mut s| s.take()).unwrap_or(None);
        let (info, report, stage) = match (ingested, recorded) {
            (Ok((info, report, stage)), _) if info.manifest == envelope_manifest => {
                (info, report, stage)
            }
            (Ok((info, _report, _stage)), _) => {
                // Every chunk matched its digest, so the bytes are the ones the
                // remote manifest lists; a different local manifest means the
                // remote one states another file digest or size: proof.
                let why = format!(
                    "the verified chunks make manifest {} (file SHA-256 {}, {} bytes), \
                     the ref names manifest {manifest}",
                    info.manifest.to_hex(),
                    info.file_digest.to_hex(),
                    info.size
                );
                self.remote_bad(remote, key, &manifest, &why);
                return Fetched::Miss;
            }
            (Err(e), Some(StreamFailure::Transport(why))) => {
                warn(format_args!("{key}: {why} ({})", e.message()));
                self.count(Counter::RemoteError);
                return Fetched::Miss;
            }
            (Err(_), Some(StreamFailure::Bad(why))) => {
                self.remote_bad(remote, key, &manifest, &why);
                return Fetched::Miss;
            }
            (Err(_), Some(StreamFailure::Missing(why))) => {
                warn(format_args!("{key}: {why}: a miss"));
                // Under a trust policy the candidates' loop counts the miss
                // once, after its last candidate (as for a missing manifest).
                if signatures.is_none() {
                    self.count(Counter::RemoteMiss);
                }
                return Fetched::Miss;
            }
            (Err(e), None) if e.kind() == Kind::Admission => {
                // A sound artifact this host cannot run: a miss, not evidence.
                warn(format_args!("{key}: not admitted here: {}", e.message()));
                self.count(Counter::RemoteMiss);
                return Fetched::Miss;
            }
            (Err(e), None) if e.kind() == Kind::Io => {
                warn(format_args!("{key}: local store: {}", e.message()));
                self.count(Counter::RemoteError);
                return Fetched::Miss;
            }
            (Err(e), None) => {
                self.remote_bad(remote, key, &manifest, e.message());
                return Fetched::Miss;
            }
        };
        let m = info.manifest;
        let keep = match signatures {
            None => Vec::new(),
            Some(entries) => {
                let subject = super::subject_of(&report.metadata, &info.file_digest);
                match self.admit_fetched(entries, &subject) {
                    Ok(keep) => keep,
                    Err(e) => {
                        // Nothing was published: the ingested objects have no
                        // ref and are garbage for GC.
                        drop(stage);
                        let _ = lease.end();
                        return Fetched::Refused(e);
                    }
                }
            }
        };
        let published = self.decide(&lease, key, m).and_then(|r| {
            for (entry, v) in &keep {
                self.store_signature(&lease, entry, v)?;
            }
            if members == super::Members::Store {
                self.after_publication(&lease, key, &m, &r, &stage);
            }
            Ok(())
        });
        drop(stage);
        let _ = lease.end();
        match published {
            Ok(()) => {
                self.count(Counter::RemoteHit);
                Fetched::Published
            }
            Err(e) => {
                warn(format_args!("{key}: local publication: {}", e.message()));
                Fetched::Miss
            }
        }
    }

    /// Publish the local record `manifest` of `key` to the remote; a failure
    /// is a warning. Returns the remote's verdict when there was one.
    pub(crate) fn publish_remote(&self, key: &str, manifest: &str) -> Option<RemotePublication> {
        let remote = self.remote.as_ref()?;
        let m = Digest::from_hex(manifest)?;
        match remote.publish(&self.store, key, &m) {
            Ok(p) => {
                if p.outcome == StoreOutcome::Stored {
                    self.count(Counter::RemotePublished);
                }
                Some(p)
            }
            Err(e) => {
                warn(format_args!("{key}: publication failed: {e}"));
                self.count(Counter::RemoteError);
                None
            }
        }
    }
}
