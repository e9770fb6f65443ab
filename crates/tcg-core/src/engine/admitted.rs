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

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use tcg_cas::{CasOutcome, Digest, Lease, RefKind, Target};
use tcg_cj::{Map, Value};

use super::destination::{prepare_directory_destination, publish_stage};
use super::{graph_ref, store_err, Engine, Request, Resolved};
use crate::artifact::publish::Temp;
use crate::artifact::{validate_metadata, LITERALS_MEMBER, METADATA_MEMBER, PACKAGE_MEMBER};
use crate::{Code, Error, Result};

/// Prefix of the admitted-copy refs (derived data; never wire identity).
pub const ADMITTED_REF_PREFIX: &str = "torch-compiled-graphs/v1/admitted/";

const MEMBERS: [&str; 3] = [METADATA_MEMBER, PACKAGE_MEMBER, LITERALS_MEMBER];

/// The last component of the binding record's ref (not a member name).
const RECORD: &str = "record";

/// Binding records are small; anything longer is not one.
const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// The binding record of (key, envelope manifest): CJ of
/// `{"format":1,"key":…,"manifest":"sha256:…","members":{<member>:"sha256:<member manifest>"}}`.
/// Written last, at admission, and compared byte for byte on every use, so a
/// member ref re-pointed at any other object, or a record of another
/// (key, envelope), is never served.
fn record_bytes(key: &str, m: &Digest, members: &[(&str, Target)]) -> Vec<u8> {
    let mut mm = Map::new();
    for (name, t) in members {
        mm.insert((*name).to_string(), Value::Str(t.digest.to_prefixed()));
    }
    let mut o = Map::new();
    o.insert("format".into(), Value::Int(1));
    o.insert("key".into(), Value::Str(key.into()));
    o.insert("manifest".into(), Value::Str(m.to_prefixed()));
    o.insert("members".into(), Value::Object(mm));
    tcg_cj::to_canonical(&Value::Object(o)).expect("a binding record is plain strings")
}

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
impl Engine {
    /// A stored file of at most the metadata limit, read whole and verified.
    /// `Ok(None)` when its stored bytes are wrong or it is too long.
    fn read_small_file(&self, lease: &Lease, manifest: &Digest) -> Result<Option<Vec<u8>>> {
        use std::io::Read;
        let reader = match self.store.open_file(lease, manifest, true) {
            Ok(r) => r,
            Err(e @ tcg_cas::StoreError::Io { .. }) => return Err(store_err(e)),
            Err(_) => return Ok(None),
        };
        if reader.manifest().size > crate::artifact::MAX_METADATA_BYTES {
            return Ok(None);
        }
        let mut bytes = Vec::new();
        match reader
            .take(crate::artifact::MAX_METADATA_BYTES)
            .read_to_end(&mut bytes)
        {
            Ok(_) => Ok(Some(bytes)),
            Err(e) => match tcg_cas::store_error_of(&e) {
                Some(se) if se.is_bad_stored_bytes() => Ok(None),
                _ => Err(Error::io("cannot read the admitted metadata", &e)),
            },
        }
    }
}

/// Create `path` (mode 0644 & ~umask, never an existing entry) holding `bytes`.
pub(crate) fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(crate::artifact::publish::FILE_MODE)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| Error::io(format_args!("cannot write {}", path.display()), &e))
}

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
        .mode(crate::artifact::publish::FILE_MODE)
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
    /// Record the verified members of `stage` as the admitted copy of (key, m):
    /// the files they were stored as while they were verified
    /// ([`super::StoreStage::read_envelope`]). The payload ref is written
    /// before the metadata ref, and the binding record last: a reader that
    /// finds the record finds the whole copy.
    pub(crate) fn record_admitted(
        &self,
        lease: &Lease,
        key: &str,
        m: &Digest,
        stage: &super::StoreStage,
    ) -> Result<()> {
        let mut members = Vec::new();
        for member in [LITERALS_MEMBER, PACKAGE_MEMBER, METADATA_MEMBER] {
            let Some(info) = stage.stored(member) else {
                continue;
            };
            let t = Target::manifest(info.manifest);
            set_ref(self, &admitted_ref(key, m, member), t)?;
            members.push((member, t));
        }
        members.sort_by(|a, b| a.0.cmp(b.0));
        let record = self
            .store
            .put_bytes(lease, &record_bytes(key, m, &members))
            .map_err(store_err)?;
        set_ref(self, &admitted_ref(key, m, RECORD), Target::object(record))
    }

    /// The members of the admitted copy of (key, m), their closures pinned,
    /// if the binding record restates exactly these member refs. `None` when
    /// there is no complete, bound copy (the caller drops it and reads the
    /// envelope).
    fn bound_members(
        &self,
        lease: &Lease,
        key: &str,
        m: &Digest,
    ) -> Result<Option<Vec<(&'static str, Target)>>> {
        let pin = |name: &str| match self.store.pin_ref(lease, name) {
            Ok(t) => Ok(t),
            Err(e @ tcg_cas::StoreError::Io { .. }) => Err(store_err(e)),
            Err(_) => Ok(None),
        };
        let Some(rec) = pin(&admitted_ref(key, m, RECORD))? else {
            return Ok(None);
        };
        if rec.kind != RefKind::Object {
            return Ok(None);
        }
        let mut members = Vec::new();
        for member in MEMBERS {
            match pin(&admitted_ref(key, m, member))? {
                Some(t) if t.kind == RefKind::Manifest => members.push((member, t)),
                Some(_) => return Ok(None),
                None if member == LITERALS_MEMBER => {}
                None => return Ok(None),
            }
        }
        members.sort_by(|a, b| a.0.cmp(b.0));
        let bytes = match self.store.read_object(lease, &rec.digest, MAX_RECORD_BYTES) {
            Ok(b) => b,
            Err(e @ tcg_cas::StoreError::Io { .. }) => return Err(store_err(e)),
            Err(_) => return Ok(None),
        };
        Ok((bytes == record_bytes(key, m, &members)).then_some(members))
    }

    /// Remove the admitted copy of (key, m); bytes become garbage.
    pub(crate) fn drop_admitted(&self, key: &str, m: &Digest) {
        for member in [RECORD, METADATA_MEMBER, PACKAGE_MEMBER, LITERALS_MEMBER] {
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
        let Some(targets) = self.bound_members(lease, key, m)? else {
            self.drop_admitted(key, m);
            return Ok(None);
        };
        // The metadata is read from the store (verified as it is read), never
        // back from the stage: the stage is outside the store.
        let md_target = targets
            .iter()
            .find(|(name, _)| *name == METADATA_MEMBER)
            .map(|(_, t)| t.digest)
            .expect("bound_members requires the metadata");
        let bytes = match self.read_small_file(lease, &md_target) {
            Ok(Some(b)) => b,
            Ok(None) => {
                self.drop_admitted(key, m);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let has_literals = targets.iter().any(|(name, _)| *name == LITERALS_MEMBER);
        let metadata = match validate_metadata(&bytes, Some(has_literals)) {
            Ok(md) if md.key() == key => md,
            _ => {
                // Derived data that no longer restates the key: drop it, read the envelope.
                self.drop_admitted(key, m);
                return Ok(None);
            }
        };
        let mode = prepare_directory_destination(destination)?;
        let stage = Temp::stage_dir(destination)?;
        for (member, t) in &targets {
            let path = stage.path().join(member);
            if *member == METADATA_MEMBER {
                write_new(&path, &bytes)?;
                continue;
            }
            match copy_member(self, lease, &t.digest, &path) {
                Ok(()) => {}
                Err(Copy::Bad) => {
                    self.drop_admitted(key, m);
                    return Ok(None);
                }
                Err(Copy::Failed(e)) => return Err(e),
            }
        }
        metadata.host_isa().admit_on(host)?;
        if let Some(req) = request {
            req.admit(&metadata)?;
        }
        publish_stage(stage, destination, mode)?;
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
