//! The admitted copy: an artifact's members kept uncompressed in the store,
//! recorded once its envelope has been fully verified, so that a later
//! resolve costs about a verified copy of the members instead of an inflate
//! and a package verification. `docs/engine.md` gives the durability and
//! trust argument.
//!
//! Layout: one manifest-kind ref per member,
//! `torch-compiled-graphs/v1/admitted/<key>/<envelope manifest hex>/<member>`.
//! The envelope stays the source of truth (export hands out its exact bytes);
//! the admitted copy is derived, and is dropped rather than quarantined when
//! anything about it is wrong.

use std::path::Path;

use tcg_cas::{CasOutcome, Digest, Lease, Target};

use super::destination::{prepare_directory_destination, publish_stage};
use super::{graph_ref, store_err, Engine, Request, Resolved};
use crate::artifact::publish::Temp;
use crate::artifact::{validate_metadata, LITERALS_MEMBER, METADATA_MEMBER, PACKAGE_MEMBER};
use crate::{Code, Error, Result};

/// Prefix of the admitted-copy refs (derived data; never wire identity).
pub const ADMITTED_REF_PREFIX: &str = "torch-compiled-graphs/v1/admitted/";

const MEMBERS: [&str; 3] = [METADATA_MEMBER, PACKAGE_MEMBER, LITERALS_MEMBER];

/// The admitted-copy ref of one member of (key, envelope manifest).
pub fn admitted_ref(key: &str, manifest: &Digest, member: &str) -> String {
    format!("{ADMITTED_REF_PREFIX}{key}/{}/{member}", manifest.to_hex())
}

fn set_ref(engine: &Engine, name: &str, desired: Target) -> Result<()> {
    loop {
        let current = engine.store.get_ref(name).map_err(store_err)?;
        match engine
            .store
            .compare_and_swap(name, current.as_ref(), Some(&desired))
            .map_err(store_err)?
        {
            CasOutcome::Matched | CasOutcome::AlreadyEqual => return Ok(()),
            CasOutcome::Conflict(_) => continue,
        }
    }
}

enum Copy {
    /// The stored bytes are wrong: drop the copy.
    Bad,
    /// Anything else (destination I/O): propagate.
    Failed(Error),
}

/// Copy a stored file into a new stage file (the kernel's copy) and prove the
/// bytes written, chunk by chunk, against their digests
/// ([`tcg_cas::Store::copy_verified_into`]). The stage is derived data: it is
/// not fsynced (SPEC-v1 §14 rule 4).
fn copy_member(
    engine: &Engine,
    lease: &Lease,
    manifest: &Digest,
    dest: &Path,
) -> std::result::Result<(), Copy> {
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| {
            Copy::Failed(Error::io(
                format_args!("cannot create {}", dest.display()),
                &e,
            ))
        })?;
    match engine.store.copy_verified_into(lease, manifest, &out, dest) {
        Ok(_) => Ok(()),
        Err(e) if e.is_bad_stored_bytes() => Err(Copy::Bad),
        Err(e) => Err(Copy::Failed(store_err(e))),
    }
}

impl Engine {
    /// Record the verified members in `stage` as the admitted copy of (key, m).
    /// The payload ref is written before the metadata ref, which is written
    /// last: a reader that finds the metadata ref finds the whole copy.
    pub(crate) fn record_admitted(
        &self,
        lease: &Lease,
        key: &str,
        m: &Digest,
        stage: &Path,
    ) -> Result<()> {
        for member in [LITERALS_MEMBER, PACKAGE_MEMBER, METADATA_MEMBER] {
            let path = stage.join(member);
            if !path.exists() {
                continue;
            }
            let info = self.store.ingest_file(lease, &path).map_err(store_err)?;
            set_ref(
                self,
                &admitted_ref(key, m, member),
                Target::manifest(info.manifest),
            )?;
        }
        Ok(())
    }

    /// Remove the admitted copy of (key, m); bytes become garbage.
    pub(crate) fn drop_admitted(&self, key: &str, m: &Digest) {
        for member in MEMBERS {
            let name = admitted_ref(key, m, member);
            if let Ok(Some(t)) = self.store.get_ref(&name) {
                let _ = self.store.compare_and_swap(&name, Some(&t), None);
            }
        }
    }

    /// The fast path of resolve: `Ok(None)` when there is no usable admitted
    /// copy (the caller then reads the envelope). Verification of the copy is
    /// the SHA-256 of every member byte as it is copied, plus full metadata
    /// validation; host admission and the request check run as always.
    pub(crate) fn resolve_admitted(
        &self,
        lease: &Lease,
        key: &str,
        m: &Digest,
        destination: &Path,
        request: Option<&Request>,
        host: &crate::host_isa::HostFacts,
    ) -> Result<Option<Resolved>> {
        let mut targets = Vec::new();
        for member in MEMBERS {
            let name = admitted_ref(key, m, member);
            // Pin the member's manifest; its chunks are pinned by the verified
            // reader. Should the ref vanish meanwhile (a GC dropping a stale
            // copy), the read fails and the envelope serves instead.
            match self.store.get_ref(&name) {
                Ok(Some(t)) => {
                    lease.pin(&[t.digest]).map_err(store_err)?;
                    targets.push((member, t));
                }
                Ok(None) if member == LITERALS_MEMBER => {}
                Ok(None) => return Ok(None),
                Err(_) => {
                    self.drop_admitted(key, m);
                    return Ok(None);
                }
            }
        }
        prepare_directory_destination(destination)?;
        let stage = Temp::stage_dir(destination)?;
        for (member, t) in &targets {
            match copy_member(self, lease, &t.digest, &stage.path().join(member)) {
                Ok(()) => {}
                Err(Copy::Bad) => {
                    self.drop_admitted(key, m);
                    return Ok(None);
                }
                Err(Copy::Failed(e)) => return Err(e),
            }
        }
        let bytes = std::fs::read(stage.path().join(METADATA_MEMBER))
            .map_err(|e| Error::io(format_args!("cannot read {}", stage.path().display()), &e))?;
        let has_literals = targets.iter().any(|(name, _)| *name == LITERALS_MEMBER);
        let metadata = match validate_metadata(&bytes, Some(has_literals)) {
            Ok(md) if md.key() == key => md,
            _ => {
                // Derived data that no longer restates the key: drop it, read the envelope.
                self.drop_admitted(key, m);
                return Ok(None);
            }
        };
        metadata.host_isa().admit_on(host)?;
        if let Some(req) = request {
            req.admit(&metadata)?;
        }
        publish_stage(stage, destination)?;
        if self
            .store
            .get_ref(&graph_ref(key))
            .map_err(store_err)?
            .map(|t| t.digest)
            != Some(*m)
        {
            return Err(Error::new(
                Code::StoreRefMoved,
                format!("the record of {key} changed during resolution"),
            ));
        }
        if self.quarantine_marker(key, m)?.is_some() {
            return Err(Error::new(
                Code::QuarantineConcurrent,
                format!("compiled graph {key} received a quarantine during resolution"),
            ));
        }
        Ok(Some(Resolved {
            key: key.to_string(),
            destination: destination.to_path_buf(),
            metadata,
            manifest: m.to_hex(),
            source: super::Source::Local,
        }))
    }
}
