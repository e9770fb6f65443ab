//! The hit path (SPEC-v1 §10.2): select, stream once, verify, admit, publish.

use std::cell::RefCell;
use std::io::{self, Read};
use std::path::Path;
use std::rc::Rc;
use std::sync::OnceLock;

use tcg_cas::{store_error_of, Lease, StoreError, Target};

use super::destination::{prepare_directory_destination, publish_stage};
use super::{check_key, graph_ref, store_err, Counter, Engine, Request, Resolved, StoreStage};
use crate::artifact::publish::Temp;
use crate::artifact::Metadata;
use crate::host_isa::HostFacts;
use crate::{Code, Error, Kind, Result};

/// This host's facts, read once per process (they do not change while it runs).
pub(crate) fn host_facts() -> Result<&'static HostFacts> {
    static FACTS: OnceLock<HostFacts> = OnceLock::new();
    if let Some(f) = FACTS.get() {
        return Ok(f);
    }
    let facts = HostFacts::read()?;
    Ok(FACTS.get_or_init(|| facts))
}

/// Evidence that the bytes the store handed out are wrong, captured from the
/// verified chunk stream before the envelope reader turns it into its own error.
#[derive(Default)]
pub(crate) struct Evidence(Rc<RefCell<Option<String>>>);

impl Evidence {
    pub(crate) fn reader<R: Read>(&self, inner: R) -> EvidenceReader<R> {
        EvidenceReader {
            inner,
            seen: Rc::clone(&self.0),
        }
    }
    pub(crate) fn take(&self) -> Option<String> {
        self.0.borrow_mut().take()
    }
}

pub(crate) struct EvidenceReader<R> {
    inner: R,
    seen: Rc<RefCell<Option<String>>>,
}

impl<R: Read> Read for EvidenceReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf).inspect_err(|e| {
            if let Some(se) = store_error_of(e) {
                if se.is_bad_stored_bytes() {
                    *self.seen.borrow_mut() = Some(se.to_string());
                }
            }
        })
    }
}

fn quarantined(code: Code, key: &str, why: impl std::fmt::Display) -> Error {
    Error::new(code, format!("compiled graph {key} was quarantined: {why}"))
}

/// How a failure of a stored record is classified (SPEC-v1 §10.1).
pub(crate) enum Verdict {
    /// The record's format is unreadable: a clean miss.
    Unreadable,
    /// Proof that stored bytes are wrong: quarantine with this event code.
    Bad(Code, String),
    /// Anything else: propagate.
    Other(Error),
}

pub(crate) fn classify_store(err: StoreError) -> Verdict {
    match err {
        StoreError::RecordFormatUnsupported { .. } => Verdict::Unreadable,
        e if e.is_bad_stored_bytes() => {
            Verdict::Bad(Code::QuarantineStoreVerification, e.to_string())
        }
        e => Verdict::Other(store_err(e)),
    }
}

pub(crate) fn classify_read(err: Error, evidence: &Evidence) -> Verdict {
    if let Some(why) = evidence.take() {
        return Verdict::Bad(Code::QuarantineStoreVerification, why);
    }
    match (err.kind(), err.code()) {
        (_, Code::ArtifactFormatUnsupported) => Verdict::Unreadable,
        (_, Code::QuarantineKeyMismatch) => {
            Verdict::Bad(Code::QuarantineKeyMismatch, err.message().to_string())
        }
        (Kind::Artifact, _) => Verdict::Bad(
            Code::QuarantineArtifactVerification,
            err.message().to_string(),
        ),
        _ => Verdict::Other(err),
    }
}

impl Engine {
    /// Resolve `key` into the directory `destination` (SPEC-v1 §10.2): `None`
    /// on a clean miss; `QuarantinedArtifact` for a record that exists but must
    /// not be served; an `AdmissionError` if this host cannot run it.
    pub fn resolve(&self, key: &str, destination: &Path) -> Result<Option<Resolved>> {
        self.resolve_with(key, destination, None)
    }

    /// Pin the record of `key` with its whole closure (manifest and chunks,
    /// re-checked against the ref), so that a concurrent GC, even one evicting
    /// the key under a size budget, cannot delete what this resolve reads:
    /// a missing object afterwards is evidence, not a race. `None` when
    /// absent; quarantined records raise.
    fn select(&self, lease: &Lease, key: &str) -> Result<Option<Target>> {
        let name = graph_ref(key);
        loop {
            let Some(target) = self.store.get_ref(&name).map_err(store_err)? else {
                return Ok(None);
            };
            if self.quarantine_marker(key, &target.digest)?.is_some() {
                return Err(quarantined(
                    Code::QuarantinePresent,
                    key,
                    "its record is quarantined",
                ));
            }
            match self.store.pin_ref(lease, &name) {
                Ok(Some(t)) if t == target => return Ok(Some(target)),
                Ok(_) => continue,
                Err(e @ StoreError::Io { .. }) => return Err(store_err(e)),
                // A manifest that does not load: reading the record reports it
                // (and classifies it) with the record still selected.
                Err(_) => {
                    if self.store.get_ref(&name).map_err(store_err)? == Some(target) {
                        return Ok(Some(target));
                    }
                }
            }
        }
    }

    /// Quarantine (key, target) for `why`, but only while the key's ref still
    /// selects that record: a record that moved meanwhile (replaced, evicted)
    /// proves nothing about the new one, and the caller may retry.
    pub(crate) fn quarantine_selected(
        &self,
        lease: &Lease,
        key: &str,
        target: &Target,
        code: Code,
        why: String,
    ) -> Error {
        match self.store.get_ref(&graph_ref(key)) {
            Ok(Some(t)) if t == *target => {}
            Ok(_) => {
                return Error::new(
                    Code::StoreRefMoved,
                    format!("the record of {key} changed during resolution; retry"),
                )
            }
            Err(e) => return store_err(e),
        }
        match self.quarantine(lease, key, &target.digest, code) {
            Ok(()) => quarantined(code, key, why),
            Err(e) => e,
        }
    }

    /// [`Engine::resolve`] with the request check of `ensure` as extra admission.
    pub(crate) fn resolve_with(
        &self,
        key: &str,
        destination: &Path,
        request: Option<&Request>,
    ) -> Result<Option<Resolved>> {
        self.resolve_tiered(key, destination, request, true)
    }

    /// [`Engine::resolve_with`]; the remote tier is consulted on a clean
    /// local miss only when `remote` is set.
    pub(crate) fn resolve_tiered(
        &self,
        key: &str,
        destination: &Path,
        request: Option<&Request>,
        remote: bool,
    ) -> Result<Option<Resolved>> {
        check_key(key)?;
        self.refuse_destination_in_store(destination)?;
        let mut result = self.resolve_inner(key, destination, request);
        // The remote tier is consulted only on a clean local miss: a hit never
        // touches the network.
        if matches!(result, Ok(None)) && remote && self.remote.is_some() && self.fetch_remote(key) {
            result = self
                .resolve_inner(key, destination, request)
                .map(|found| found.map(|r| r.fetched()));
        }
        match &result {
            Ok(Some(_)) => self.count(Counter::Hit),
            Ok(None) => self.count(Counter::Miss),
            Err(e) if e.kind() == Kind::Quarantined => self.count(Counter::Miss),
            Err(_) => {}
        }
        result
    }

    fn resolve_inner(
        &self,
        key: &str,
        destination: &Path,
        request: Option<&Request>,
    ) -> Result<Option<Resolved>> {
        let lease = self.store.lease().map_err(store_err)?;
        let Some(target) = self.select(&lease, key)? else {
            return Ok(None);
        };
        let manifest = target.digest;
        // Under a trust policy, only a record the store minted or this
        // policy admits is served; anything else (fetched or imported by an
        // untrusting engine) is a miss for this engine.
        if !self.admits_stored(&lease, key, &manifest)? {
            eprintln!(
                "torch-compiled-graphs: warning: {key}: the local record (manifest {}) is not \
                 admitted by the trust policy (no trusted signature, not minted here): a miss",
                manifest.to_hex()
            );
            lease.end().map_err(store_err)?;
            return Ok(None);
        }
        let host = host_facts();
        if let Ok(facts) = &host {
            if let Some(found) =
                self.resolve_admitted(&lease, key, &manifest, destination, request, facts)?
            {
                let _ = self.store.record_use(&graph_ref(key));
                lease.end().map_err(store_err)?;
                return Ok(Some(found));
            }
        }
        let reader = match self.store.open_file(&lease, &manifest, true) {
            Ok(r) => r,
            Err(e) => {
                return match classify_store(e) {
                    Verdict::Unreadable => Ok(None),
                    Verdict::Other(e) => Err(e),
                    Verdict::Bad(code, why) => {
                        Err(self.quarantine_selected(&lease, key, &target, code, why))
                    }
                }
            }
        };
        let mode = prepare_directory_destination(destination)?;
        let mut admission = |md: &Metadata| -> Result<()> {
            if md.key() != key {
                return Err(Error::new(
                    Code::QuarantineKeyMismatch,
                    format!("stored metadata states key {}, expected {key}", md.key()),
                ));
            }
            let host = host
                .as_ref()
                .map_err(|e| Error::new(e.code(), e.message()))?;
            md.host_isa().admit_on(host)?;
            if let Some(req) = request {
                req.admit(md)?;
            }
            Ok(())
        };
        // Verify inside the store's private tmp/: what is verified there is
        // what becomes the admitted copy, and no other user can change it in
        // between (nor make a good record look bad).
        let mut work = StoreStage::new(self, &lease)?;
        let evidence = Evidence::default();
        let report = match work.read_envelope(
            self,
            &lease,
            evidence.reader(reader),
            &mut admission,
            super::Members::StoreAndStage,
        ) {
            Ok(r) => r,
            Err(err) => {
                drop(work);
                return match classify_read(err, &evidence) {
                    Verdict::Unreadable => Ok(None),
                    Verdict::Other(e) => Err(e),
                    Verdict::Bad(code, why) => {
                        Err(self.quarantine_selected(&lease, key, &target, code, why))
                    }
                };
            }
        };
        // Verified: keep the members as the admitted copy for the next resolve.
        // Best effort; the envelope remains the source of truth.
        let _ = self.record_admitted(&lease, key, &manifest, &work);
        let stage = Temp::stage_dir(destination)?;
        copy_tree(work.path(), stage.path())?;
        drop(work);
        publish_stage(stage, destination, mode)?;
        // Post-publication re-check of the selection (step 11).
        if self.store.get_ref(&graph_ref(key)).map_err(store_err)? != Some(target) {
            return Err(Error::new(
                Code::StoreRefMoved,
                format!("the record of {key} changed during resolution"),
            ));
        }
        if self.quarantine_marker(key, &manifest)?.is_some() {
            return Err(quarantined(
                Code::QuarantineConcurrent,
                key,
                "received a quarantine during resolution",
            ));
        }
        // Best effort: the last use only orders eviction under a size budget.
        let _ = self.store.record_use(&graph_ref(key));
        lease.end().map_err(store_err)?;
        Ok(Some(Resolved {
            key: key.to_string(),
            destination: destination.to_path_buf(),
            metadata: report.metadata,
            manifest: manifest.to_hex(),
            source: super::Source::Local,
        }))
    }
}

/// Copy the verified members from the store's private stage into the
/// destination's stage (kernel copy; the source is private to the store).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    for member in [
        crate::artifact::METADATA_MEMBER,
        crate::artifact::PACKAGE_MEMBER,
        crate::artifact::LITERALS_MEMBER,
    ] {
        let src = from.join(member);
        let mut input = match std::fs::File::open(&src) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format_args!("cannot open {}", src.display()), &e)),
        };
        let dst = to.join(member);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(crate::artifact::publish::FILE_MODE)
            .open(&dst)
            .map_err(|e| Error::io(format_args!("cannot create {}", dst.display()), &e))?;
        io::copy(&mut input, &mut out)
            .map_err(|e| Error::io(format_args!("cannot write {}", dst.display()), &e))?;
    }
    Ok(())
}
