//! Publication (SPEC-v1 §10.4) and import (§10.6): ingest an envelope into the
//! store in the same pass that verifies it, then decide first-writer-wins.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use tcg_cas::{CasOutcome, ChunkedWriter, Digest, Lease, Target};

use super::resolve::{classify_read, host_facts, Evidence, Verdict};
use super::{
    check_key, graph_ref, store_err, Engine, EnvelopeStream, Members, StoreOutcome, StoreResult,
    StoreStage,
};
use crate::artifact::envelope::Tee;
use crate::artifact::metadata::format_of;
use crate::artifact::{read_metadata_member, EnvelopeReport, Metadata};
use crate::{Code, Error, Result};

/// What an ingest reads: a plain reader (a file), or a remote's frames.
enum Input<'a, R> {
    Reader(R),
    Frames(&'a mut dyn EnvelopeStream),
}

/// Keep the store's error for the caller and hand the envelope reader an
/// I/O error of the same kind (and errno).
fn sink_failed(slot: &mut Option<Error>, e: tcg_cas::StoreError) -> std::io::Error {
    let copy = match e.raw_os_error() {
        Some(n) => std::io::Error::from_raw_os_error(n),
        None => std::io::Error::other(e.to_string()),
    };
    *slot = Some(store_err(e));
    copy
}

/// A reader over a remote's frames that hands each frame to `sink` (the
/// store's writer, which keeps a reference instead of a copy) as it is
/// taken, then serves reads from it.
struct FrameTee<'a, F> {
    frames: &'a mut dyn EnvelopeStream,
    current: Option<tcg_cas::SharedBytes>,
    pos: usize,
    /// Each frame, then `None` once the frames have ended.
    sink: F,
}

impl<F> Read for FrameTee<'_, F>
where
    F: FnMut(Option<tcg_cas::SharedBytes>) -> std::io::Result<()>,
{
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if let Some(frame) = &self.current {
                let data = (**frame).as_ref();
                if self.pos < data.len() {
                    let n = buf.len().min(data.len() - self.pos);
                    buf[..n].copy_from_slice(&data[self.pos..self.pos + n]);
                    self.pos += n;
                    return Ok(n);
                }
            }
            let Some(frame) = self.frames.next_frame()? else {
                (self.sink)(None)?;
                return Ok(0);
            };
            (self.sink)(Some(std::sync::Arc::clone(&frame)))?;
            self.current = Some(frame);
            self.pos = 0;
        }
    }
}

/// Why an incumbent record may be replaced.
fn replaceable(engine: &Engine, lease: &Lease, key: &str, current: &Digest) -> Result<bool> {
    if engine.quarantine_marker(key, current)?.is_some() {
        return Ok(true);
    }
    // An unreadable format (manifest or metadata) is replaced like a quarantined record.
    let reader = match engine.store.open_file(lease, current, true) {
        Ok(r) => r,
        Err(tcg_cas::StoreError::RecordFormatUnsupported { .. }) => return Ok(true),
        Err(e) => return Err(store_err(e)),
    };
    let unreadable = match read_metadata_member(reader) {
        Ok(bytes) => {
            matches!(format_of(&bytes), Some(f) if f != crate::identity::COMPILED_GRAPH_FORMAT)
        }
        // A healthy-looking incumbent whose bytes fail here is for resolve to
        // quarantine; publication only replaces what is already marked.
        Err(_) => false,
    };
    if unreadable {
        return Ok(true);
    }
    // Under a trust policy every candidate reaching publication was minted
    // here or admitted by the policy, so an incumbent the policy does not
    // admit (fetched or imported without one) gives way: this engine would
    // never serve it. Without a policy this is always false.
    Ok(!engine.admits_stored(lease, key, current)?)
}

impl Engine {
    /// Stream `input` (an envelope) into the store while verifying it fully,
    /// streaming its members into the store as they go (nothing is staged as
    /// a file: the checks that read a member again read the store's copy).
    /// Returns the manifest and the report; `admission` runs on the metadata
    /// before any ref is written.
    pub(crate) fn ingest_verified(
        &self,
        lease: &Lease,
        input: impl Read,
        key: &str,
        admit_host: bool,
    ) -> Result<(tcg_cas::ManifestInfo, EnvelopeReport, StoreStage)> {
        self.ingest_input(
            lease,
            Input::Reader(input),
            key,
            admit_host,
            None,
            Members::Store,
        )
    }

    /// [`Engine::ingest_verified`] of a remote's stream: its frames go to the
    /// store's writer without a copy, and `known` are the chunks the stream
    /// checks them against (the writer does not hash them again, and
    /// continues its whole-file hash from `first`, the state after the
    /// first chunk, when the stream hands it over). `members` says whether
    /// the admitted copy is stored now ([`Members::Store`]) or left to the
    /// first resolve ([`Members::Stage`]).
    pub(crate) fn ingest_frames(
        &self,
        lease: &Lease,
        frames: &mut dyn EnvelopeStream,
        key: &str,
        known: Option<&[tcg_cas::Chunk]>,
        first: Option<tcg_cas::FirstChunkState>,
        members: Members,
    ) -> Result<(tcg_cas::ManifestInfo, EnvelopeReport, StoreStage)> {
        self.ingest_input(
            lease,
            Input::<File>::Frames(frames),
            key,
            true,
            known.map(|k| (k, first)),
            members,
        )
    }

    fn ingest_input<R: Read>(
        &self,
        lease: &Lease,
        input: Input<'_, R>,
        key: &str,
        admit_host: bool,
        known: Option<(&[tcg_cas::Chunk], Option<tcg_cas::FirstChunkState>)>,
        members: Members,
    ) -> Result<(tcg_cas::ManifestInfo, EnvelopeReport, StoreStage)> {
        let mut writer: ChunkedWriter<'_> = match known {
            Some((chunks, first)) => {
                let mut w = self.store.chunked_writer_known(lease, chunks);
                if let Some(state) = first {
                    w.continue_from(state);
                }
                w
            }
            None => self.store.chunked_writer(lease),
        };
        let mut sink_error: Option<Error> = None;
        let mut stage = StoreStage::new(self, lease)?;
        let host = if admit_host {
            Some(host_facts()?)
        } else {
            None
        };
        let mut admission = |md: &Metadata| -> Result<()> {
            if md.key() != key {
                return Err(Error::new(
                    Code::StoreKeyMismatch,
                    format!("artifact states key {}, expected {key}", md.key()),
                ));
            }
            if let Some(host) = host {
                md.host_isa().admit_on(host)?;
            }
            Ok(())
        };
        let report = match input {
            Input::Reader(r) => {
                let tee = Tee::new(r, |bytes: &[u8]| {
                    writer.write_all(bytes).map_err(|e| {
                        let e = tcg_cas::StoreError::from_io(e, "ingest", "envelope");
                        sink_failed(&mut sink_error, e)
                    })
                });
                stage.read_envelope(self, lease, tee, &mut admission, members)
            }
            Input::Frames(frames) => {
                let tee = FrameTee {
                    frames,
                    current: None,
                    pos: 0,
                    sink: |frame| {
                        // At the end, the last chunk is sealed at once: its
                        // fsync runs while the checks finish.
                        match frame {
                            Some(f) => writer.write_shared(f),
                            None => writer.end_input(),
                        }
                        .map_err(|e| sink_failed(&mut sink_error, e))
                    },
                };
                stage.read_envelope(self, lease, tee, &mut admission, members)
            }
        };
        if let Some(e) = sink_error {
            return Err(e);
        }
        let report = report?;
        let info = writer.finish().map_err(store_err)?;
        Ok((info, report, stage))
    }

    /// Publish manifest `m` for `key` first-writer-wins (SPEC-v1 §10.4 step 3).
    pub(crate) fn decide(&self, lease: &Lease, key: &str, m: Digest) -> Result<StoreResult> {
        let name = graph_ref(key);
        let desired = Target::manifest(m);
        let q = self.quarantine_marker(key, &m)?;
        // A record that cannot be read (truncated, malformed) serves nothing:
        // remove it (only while it is still unreadable) so that a verified
        // candidate can repair the key.
        let mut replaced_unreadable = false;
        let mut current = match self.store.get_ref(&name) {
            Ok(c) => c,
            Err(tcg_cas::StoreError::RefInvalid { .. }) => {
                replaced_unreadable = self.store.remove_unreadable_ref(&name).map_err(store_err)?;
                self.store.get_ref(&name).map_err(store_err)?
            }
            Err(e) => return Err(store_err(e)),
        };
        let outcome = loop {
            match current {
                None => match self
                    .store
                    .compare_and_swap(&name, None, Some(&desired))
                    .map_err(store_err)?
                {
                    CasOutcome::Matched => {
                        if let Some(q) = &q {
                            self.retire(key, &m, q)?;
                            break StoreOutcome::Repaired;
                        }
                        if replaced_unreadable {
                            break StoreOutcome::Repaired;
                        }
                        break StoreOutcome::Stored;
                    }
                    CasOutcome::AlreadyEqual => current = Some(desired),
                    CasOutcome::Conflict(c) => current = c,
                },
                Some(c) if c.digest == m => {
                    if let Some(q) = &q {
                        self.retire(key, &m, q)?;
                        break StoreOutcome::Repaired;
                    }
                    if self.quarantine_marker(key, &m)?.is_some() {
                        return Err(Error::new(
                            Code::QuarantineConcurrent,
                            format!("fresh quarantine of {key} during publication"),
                        ));
                    }
                    break StoreOutcome::Present;
                }
                Some(c) => {
                    if replaceable(self, lease, key, &c.digest)? {
                        match self
                            .store
                            .compare_and_swap(&name, Some(&c), Some(&desired))
                            .map_err(store_err)?
                        {
                            CasOutcome::Matched => {
                                if let Some(q) = &q {
                                    self.retire(key, &m, q)?;
                                }
                                break StoreOutcome::Repaired;
                            }
                            CasOutcome::AlreadyEqual => {
                                if let Some(q) = &q {
                                    self.retire(key, &m, q)?;
                                }
                                break StoreOutcome::Present;
                            }
                            CasOutcome::Conflict(None) => {
                                return Err(Error::new(
                                    Code::StoreRefMoved,
                                    format!("the record of {key} disappeared during repair"),
                                ))
                            }
                            CasOutcome::Conflict(next) => current = next,
                        }
                    } else {
                        self.set_aside_divergent(lease, key, &m, &c.digest)?;
                        break StoreOutcome::Divergent;
                    }
                }
            }
        };
        Ok(StoreResult {
            outcome,
            key: key.to_string(),
            manifest: m.to_hex(),
        })
    }

    /// Import an envelope file under `key` (SPEC-v1 §10.6): full verification,
    /// host admission and, when a trust policy is set, a trusted signature in
    /// `path.sig` before any ref is written; then publication. The valid
    /// signatures of `path.sig` are kept beside the artifact.
    pub fn import_artifact(&self, key: &str, path: &Path) -> Result<StoreResult> {
        check_key(key)?;
        let file = File::open(path)
            .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?
            .len();
        crate::artifact::envelope::check_compressed_size(size)?;
        let lease = self.store.lease().map_err(store_err)?;
        let (info, report, stage) = self.ingest_verified(&lease, file, key, true)?;
        let m = info.manifest;
        let subject = super::subject_of(&report.metadata, &info.file_digest);
        let signatures = self.import_signatures(path, &subject)?;
        let result = self.decide(&lease, key, m)?;
        for (entry, v) in &signatures {
            self.store_signature(&lease, entry, v)?;
        }
        self.after_publication(&lease, key, &m, &result, &stage);
        lease.end().map_err(store_err)?;
        Ok(result)
    }
}

impl Engine {
    /// After publication: keep the verified members as the admitted copy of
    /// the record that now serves the key (not of a divergent candidate).
    pub(crate) fn after_publication(
        &self,
        lease: &Lease,
        key: &str,
        m: &Digest,
        result: &StoreResult,
        stage: &StoreStage,
    ) {
        if result.outcome != StoreOutcome::Divergent {
            let _ = self.record_admitted(lease, key, m, stage);
        }
    }
}

/// Whether a verified stored record's bytes fail now: used by export.
pub(crate) fn bad_read(
    err: Error,
    evidence: &Evidence,
) -> std::result::Result<(Code, String), Error> {
    match classify_read(err, evidence) {
        Verdict::Bad(code, why) => Ok((code, why)),
        Verdict::Unreadable => Ok((
            Code::QuarantineExportVerification,
            "unreadable format".into(),
        )),
        Verdict::Other(e) => Err(e),
    }
}
