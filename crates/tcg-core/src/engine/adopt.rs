//! Adopting the graphs of a torch-compiled-graphs 0.2.0 store (a HashRepo
//! root, `docs/store.md`): each graph ref of the old root is read without
//! trusting the old tree (see [`super::hashrepo`]) and its envelope goes
//! through the same full verification, host admission and first-writer-wins
//! publication as [`Engine::import_artifact`]. The old root is never written.

use std::path::Path;

use tcg_cas::{GRAPH_REF_PREFIX, QUARANTINE_REF_PREFIX};
use tcg_cj::{Map, Value};

use super::hashrepo::{parse_manifest, read_ref, Dir, EnvelopeStream, Objects};
use super::{check_key, store_err, Engine, StoreOutcome};
use crate::{Code, Error, Result};

/// What adoption did with one graph of the old store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdoptStatus {
    /// Verified, admitted and now stored (or it repaired a quarantined record).
    Imported,
    /// The same artifact already serves the key in the new store.
    Present,
    /// Another healthy artifact already serves the key in the new store; the
    /// old one was verified and set aside, the stored record is unchanged.
    Divergent,
    /// The old store had quarantined this key; it was not adopted.
    Quarantined,
    /// Refused with a code (nothing was published for it).
    Refused,
}

impl AdoptStatus {
    /// The status as the CLI and Python spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            AdoptStatus::Imported => "imported",
            AdoptStatus::Present => "present",
            AdoptStatus::Divergent => "divergent",
            AdoptStatus::Quarantined => "quarantined",
            AdoptStatus::Refused => "refused",
        }
    }
}

/// The report of one ref of the old store.
#[derive(Debug)]
pub struct AdoptEntry {
    /// The key, when the ref record could be read.
    pub key: Option<String>,
    /// The ref's file name under `refs/`.
    pub ref_file: String,
    /// What happened.
    pub status: AdoptStatus,
    /// The publication outcome in the new store, when it was published.
    pub outcome: Option<StoreOutcome>,
    /// The envelope's manifest digest in the new store (64 hex), when stored.
    pub manifest: Option<String>,
    /// Why it was refused (`Refused`), or why it is not adopted (`Quarantined`).
    pub error: Option<Error>,
}

impl AdoptEntry {
    /// The entry as a JSON object (stable field names).
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        let opt = |s: Option<&str>| s.map_or(Value::Null, Value::from);
        m.insert("key".into(), opt(self.key.as_deref()));
        m.insert("ref_file".into(), self.ref_file.as_str().into());
        m.insert("status".into(), self.status.as_str().into());
        m.insert(
            "outcome".into(),
            opt(self
                .outcome
                .map(|o| o.as_str().to_ascii_lowercase())
                .as_deref()),
        );
        m.insert("manifest".into(), opt(self.manifest.as_deref()));
        m.insert(
            "code".into(),
            opt(self.error.as_ref().map(|e| e.code().as_str())),
        );
        m.insert(
            "message".into(),
            opt(self.error.as_ref().map(|e| e.message())),
        );
        Value::Object(m)
    }
}

impl Engine {
    /// Import every graph of the 0.2.0 store at `old_root` into this store.
    ///
    /// Each graph ref is reported (in ref-file order): imported, already
    /// present, divergent, quarantined in the old store (not adopted), or
    /// refused with its code. `progress` is called after each one with
    /// (done, total, entry). Fails as a whole only when `old_root` is not a
    /// HashRepo root or cannot be listed.
    pub fn adopt_hashrepo(
        &self,
        old_root: &Path,
        progress: &mut dyn FnMut(usize, usize, &AdoptEntry),
    ) -> Result<Vec<AdoptEntry>> {
        let root = Dir::open_root(old_root)?;
        let not_hashrepo = |why: &str| {
            Error::new(
                Code::StoreFormatUnsupported,
                format!(
                    "{} is not a torch-compiled-graphs 0.2.0 (HashRepo) store: {why}",
                    old_root.display()
                ),
            )
        };
        if root.has("FORMAT")? {
            return Err(not_hashrepo("it has a FORMAT file"));
        }
        super::check_adopt_layout(old_root, self.store.root())?;
        let refs = root
            .subdir("refs")
            .map_err(|e| not_hashrepo(&format!("no refs/ directory ({})", e.message())))?;
        let objects = Objects(
            root.subdir("objects")
                .and_then(|d| d.subdir("sha256"))
                .map_err(|e| {
                    not_hashrepo(&format!("no objects/sha256/ directory ({})", e.message()))
                })?,
        );

        // First pass: read every record, so quarantines are known before any graph.
        let mut graphs = Vec::new();
        let mut quarantined = std::collections::BTreeSet::new();
        let mut entries = Vec::new();
        for name in refs.entries()? {
            let ref_file = name.to_string_lossy().into_owned();
            let refused = |e: Error, key: Option<String>| AdoptEntry {
                key,
                ref_file: ref_file.clone(),
                status: AdoptStatus::Refused,
                outcome: None,
                manifest: None,
                error: Some(e),
            };
            let record = match name.to_str().map(|n| read_ref(&refs, n)) {
                Some(Ok(r)) => r,
                Some(Err(e)) => {
                    entries.push(refused(e, None));
                    continue;
                }
                None => {
                    entries.push(refused(
                        Error::new(Code::StoreRefInvalid, "a ref file name is not UTF-8"),
                        None,
                    ));
                    continue;
                }
            };
            if let Some(key) = record.name.strip_prefix(GRAPH_REF_PREFIX) {
                graphs.push((ref_file, key.to_string(), record.target));
            } else if let Some(rest) = record.name.strip_prefix(QUARANTINE_REF_PREFIX) {
                quarantined.insert(rest.split('/').next().unwrap_or_default().to_string());
            }
            // Other refs (none were written by 0.2.0's engine) are not graphs.
        }

        let total = graphs.len() + entries.len();
        for (i, e) in entries.iter().enumerate() {
            progress(i + 1, total, e);
        }
        for (ref_file, key, manifest) in graphs {
            let entry = if quarantined.contains(&key) {
                AdoptEntry {
                    error: Some(Error::new(
                        Code::QuarantinePresent,
                        format!("{key} is quarantined in the old store; mint or import it anew"),
                    )),
                    key: Some(key),
                    ref_file,
                    status: AdoptStatus::Quarantined,
                    outcome: None,
                    manifest: None,
                }
            } else {
                match self.adopt_one(&objects, &key, &manifest) {
                    Ok((outcome, m)) => AdoptEntry {
                        key: Some(key),
                        ref_file,
                        status: match outcome {
                            StoreOutcome::Stored | StoreOutcome::Repaired => AdoptStatus::Imported,
                            StoreOutcome::Present => AdoptStatus::Present,
                            StoreOutcome::Divergent => AdoptStatus::Divergent,
                        },
                        outcome: Some(outcome),
                        manifest: Some(m),
                        error: None,
                    },
                    Err(e) => AdoptEntry {
                        key: Some(key),
                        ref_file,
                        status: AdoptStatus::Refused,
                        outcome: None,
                        manifest: None,
                        error: Some(e),
                    },
                }
            };
            entries.push(entry);
            progress(entries.len(), total, entries.last().expect("just pushed"));
        }
        Ok(entries)
    }

    /// Verify and publish one graph of the old store.
    fn adopt_one(
        &self,
        objects: &Objects,
        key: &str,
        manifest: &tcg_cas::Digest,
    ) -> Result<(StoreOutcome, String)> {
        check_key(key)?;
        let bytes = objects.read_small(manifest, super::hashrepo::MAX_REPO_MANIFEST_BYTES)?;
        let file = parse_manifest(&bytes, manifest)?;
        let lease = self.store.lease().map_err(store_err)?;
        let mut stream = EnvelopeStream::new(objects, &file);
        let ingested = self.ingest_verified(&lease, &mut stream, key, true);
        // Proof that the old store's bytes are not what its manifest names
        // explains whatever the envelope reader made of them, so a refusal
        // reads the rest (bounded by the manifest's size) to find it.
        let (rest, trailing) = stream.drain();
        if let Some(e) = rest {
            return Err(e);
        }
        let (info, report, stage) = ingested?;
        let m = info.manifest;
        if trailing > 0 {
            return Err(Error::new(
                Code::ArtifactGzipTrailing,
                format!("{trailing} bytes follow the envelope's gzip stream"),
            ));
        }
        if self.trust().has_policy() {
            // An old store is "from elsewhere" like an import, and 0.2.0
            // stores carry no signatures: under a policy each graph is
            // refused (`trust.unsigned`). An operator vouching for its own
            // old store adopts without a policy and signs (docs/trust.md).
            let subject = super::subject_of(&report.metadata, &info.file_digest);
            self.admit_fetched(&[], &subject)?;
        }
        let result = self.decide(&lease, key, m)?;
        self.after_publication(&lease, key, &m, &result, &stage);
        lease.end().map_err(store_err)?;
        Ok((result.outcome, result.manifest))
    }
}
