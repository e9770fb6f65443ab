//! The envelope `compiled_graph.tar.gz` (SPEC-v1 §6): the deterministic
//! writer (§6.2–§6.3) and the strict one-pass streaming reader (§6.6).
//!
//! The reader works over any [`Read`]: the engine feeds it the store's
//! verified chunk stream, and mint wraps the compressed input in a [`Tee`] to
//! ingest it into the store in the same pass.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::gzip::{GzipReader, GzipWriter};
use super::limits::*;
use super::literals::{verify_literals, verify_payload_from};
use super::metadata::{validate_metadata, Metadata};
use super::package::{verify_opened, verify_package, Package, PackageReport, ReadSeek};
use super::tar::{self, BLOCK};
use crate::error::{Code, Error, Result};

/// Copy buffer of the reader and the writer.
const CHUNK: usize = 1 << 20;

/// A reader that hands every byte it reads to a callback: hash or ingest the
/// compressed envelope in the same pass that verifies it.
pub struct Tee<R, F> {
    inner: R,
    sink: F,
}

impl<R: Read, F: FnMut(&[u8]) -> std::io::Result<()>> Tee<R, F> {
    /// Wrap `inner`; `sink` sees each chunk read, in order.
    pub fn new(inner: R, sink: F) -> Self {
        Tee { inner, sink }
    }
    /// The wrapped reader.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

impl<R: Read, F: FnMut(&[u8]) -> std::io::Result<()>> Read for Tee<R, F> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        (self.sink)(&buf[..n])?;
        Ok(n)
    }
}

/// The member limit of an envelope member name.
pub fn member_limit(name: &str) -> u64 {
    match name {
        METADATA_MEMBER => MAX_METADATA_BYTES,
        PACKAGE_MEMBER => MAX_PACKAGE_BYTES,
        _ => MAX_LITERALS_BYTES,
    }
}

/// §6.5 checks of member sizes, in member order: each within its limit
/// (`artifact.member_too_large`) and the sum within `MAX_MEMBER_BYTES`
/// (`artifact.total_too_large`).
pub fn check_sizes(sizes: &[(&str, u64)]) -> Result<()> {
    let mut total: u64 = 0;
    for &(name, size) in sizes {
        let limit = member_limit(name);
        if size > limit {
            return Err(Error::new(
                Code::ArtifactMemberTooLarge,
                format!("envelope member {name} is {size} bytes, over its limit of {limit}"),
            ));
        }
        total = total.saturating_add(size);
        if total > MAX_MEMBER_BYTES {
            return Err(Error::new(
                Code::ArtifactTotalTooLarge,
                format!("envelope members total more than {MAX_MEMBER_BYTES} bytes"),
            ));
        }
    }
    Ok(())
}

/// §6.6 step 1: a compressed size over `MAX_ARCHIVE_BYTES` is refused
/// before reading (`artifact.compressed_too_large`).
pub fn check_compressed_size(size: u64) -> Result<()> {
    if size > MAX_ARCHIVE_BYTES {
        return Err(Error::new(
            Code::ArtifactCompressedTooLarge,
            format!("envelope is {size} bytes, over the limit of {MAX_ARCHIVE_BYTES}"),
        ));
    }
    Ok(())
}

/// A member to write: its exact size and a source of exactly that many bytes.
pub struct MemberSource<'a> {
    /// The size in bytes.
    pub size: u64,
    /// The bytes.
    pub reader: &'a mut dyn Read,
}

/// Write an envelope (§6.2–§6.3) of the given metadata bytes, package and
/// optional literal payload to `out`; sizes are checked before anything is
/// written. Returns the sink.
pub fn write_envelope<'a, W: Write>(
    out: W,
    metadata: &[u8],
    package: MemberSource<'a>,
    literals: Option<MemberSource<'a>>,
) -> Result<W> {
    let mut sizes = vec![
        (METADATA_MEMBER, metadata.len() as u64),
        (PACKAGE_MEMBER, package.size),
    ];
    if let Some(l) = &literals {
        sizes.push((LITERALS_MEMBER, l.size));
    }
    check_sizes(&sizes)?;
    let mut gz = GzipWriter::new(out)?;
    let mut len: u64 = 0;
    let zeros = [0u8; BLOCK];
    fn put<W: Write>(gz: &mut GzipWriter<W>, b: &[u8], len: &mut u64) -> Result<()> {
        *len += b.len() as u64;
        gz.write(b)
    }
    put(
        &mut gz,
        &tar::header(METADATA_MEMBER, metadata.len() as u64),
        &mut len,
    )?;
    put(&mut gz, metadata, &mut len)?;
    put(
        &mut gz,
        &zeros[..tar::padding(metadata.len() as u64)],
        &mut len,
    )?;
    let mut buf = vec![0u8; CHUNK];
    let mut members = vec![(PACKAGE_MEMBER, package)];
    if let Some(l) = literals {
        members.push((LITERALS_MEMBER, l));
    }
    for (name, src) in members {
        put(&mut gz, &tar::header(name, src.size), &mut len)?;
        let mut left = src.size;
        while left > 0 {
            let want = left.min(CHUNK as u64) as usize;
            let n = match src.reader.read(&mut buf[..want]) {
                Ok(0) => {
                    let e = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Error::io(
                        format_args!("{name} ended {left} bytes early"),
                        &e,
                    ));
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(format_args!("cannot read {name}"), &e)),
            };
            put(&mut gz, &buf[..n], &mut len)?;
            left -= n as u64;
        }
        put(&mut gz, &zeros[..tar::padding(src.size)], &mut len)?;
    }
    put(&mut gz, &zeros, &mut len)?;
    put(&mut gz, &zeros, &mut len)?;
    let mut pad = tar::record_padding(len);
    while pad > 0 {
        let n = pad.min(BLOCK as u64) as usize;
        put(&mut gz, &zeros[..n], &mut len)?;
        pad -= n as u64;
    }
    gz.finish()
}

/// The envelope bytes of in-memory members (see [`write_envelope`]).
pub fn envelope_bytes(metadata: &[u8], package: &[u8], literals: Option<&[u8]>) -> Result<Vec<u8>> {
    let mut p = package;
    let mut l = literals.unwrap_or(&[]);
    let lit = literals.map(|b| MemberSource {
        size: b.len() as u64,
        reader: &mut l,
    });
    write_envelope(
        Vec::new(),
        metadata,
        MemberSource {
            size: package.len() as u64,
            reader: &mut p,
        },
        lit,
    )
}

/// The tar layer of the reader: blocks and member data out of the gzip
/// stream, with the tar position tracked.
struct TarStream<R> {
    gz: GzipReader<R>,
    pos: u64,
    buf: Vec<u8>,
}

fn truncated(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactTarTruncated,
        format!("envelope tar stream is truncated: {what}"),
    )
}

fn tar_end(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactTarEnd,
        format!("envelope tar stream has a bad end: {what}"),
    )
}

impl<R: Read> TarStream<R> {
    fn new(input: R) -> Result<Self> {
        Ok(TarStream {
            gz: GzipReader::new(input)?,
            pos: 0,
            buf: Vec::new(),
        })
    }

    fn read_exact(&mut self, out: &mut [u8], what: &str) -> Result<()> {
        let mut got = 0;
        while got < out.len() {
            let n = self.gz.read(&mut out[got..])?;
            if n == 0 {
                return Err(truncated(format_args!("stream ends inside {what}")));
            }
            got += n;
        }
        self.pos += out.len() as u64;
        Ok(())
    }

    fn block(&mut self, what: &str) -> Result<[u8; BLOCK]> {
        let mut b = [0u8; BLOCK];
        self.read_exact(&mut b, what)?;
        Ok(b)
    }

    /// The header of the member expected next: `None` for a zero block
    /// (which is then the first end block) unless the member is required.
    fn header(&mut self, expected: &str, required: bool) -> Result<Option<u64>> {
        let h = self.block("a member header")?;
        if h.iter().all(|&b| b == 0) {
            if required {
                return Err(Error::new(
                    Code::ArtifactMemberMissing,
                    format!("envelope lacks the required member {expected}"),
                ));
            }
            return Ok(None);
        }
        tar::check_member(&h, expected)?;
        let size = tar::check_fields(&h, expected)?;
        Ok(Some(size))
    }

    /// `size` data bytes into `sink`, then the NUL padding.
    fn data(
        &mut self,
        name: &str,
        size: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if self.buf.is_empty() {
            self.buf = vec![0u8; CHUNK];
        }
        let mut left = size;
        while left > 0 {
            let want = left.min(CHUNK as u64) as usize;
            let n = self.gz.read(&mut self.buf[..want])?;
            if n == 0 {
                return Err(truncated(format_args!("{name} ends {left} bytes early")));
            }
            sink(&self.buf[..n])?;
            left -= n as u64;
            self.pos += n as u64;
        }
        let mut pad = [0u8; BLOCK];
        let p = tar::padding(size);
        self.read_exact(&mut pad[..p], "member padding")?;
        if pad[..p].iter().any(|&b| b != 0) {
            return Err(tar_end(format_args!("padding after {name} is not NUL")));
        }
        Ok(())
    }

    /// After the first end block: the second, the record padding, and the
    /// end of the decompressed stream; then the gzip trailer.
    fn finish(mut self) -> Result<(u64, u64)> {
        let second = self.block("the end blocks")?;
        if second.iter().any(|&b| b != 0) {
            return Err(tar_end("the second end block is not zero"));
        }
        let mut left = tar::record_padding(self.pos);
        let mut pad = [0u8; BLOCK];
        while left > 0 {
            let n = left.min(BLOCK as u64) as usize;
            self.read_exact(&mut pad[..n], "the record padding")?;
            if pad[..n].iter().any(|&b| b != 0) {
                return Err(tar_end("record padding is not zero"));
            }
            left -= n as u64;
        }
        let mut extra = [0u8; 1];
        if self.gz.read(&mut extra)? != 0 {
            return Err(tar_end("bytes follow the end of the archive"));
        }
        let tar_bytes = self.pos;
        let (compressed, _) = self.gz.finish()?;
        Ok((tar_bytes, compressed))
    }
}

/// Read the first member, `metadata.json`, with every header check, and
/// return its bytes without validating them (bounded by
/// `MAX_METADATA_BYTES`; for inspection and the unreadable-format rule).
pub fn read_metadata_member<R: Read>(input: R) -> Result<Vec<u8>> {
    metadata_bytes(&mut TarStream::new(input)?)
}

/// The first member's header (checked completely) and its bytes.
fn metadata_bytes<R: Read>(t: &mut TarStream<R>) -> Result<Vec<u8>> {
    let size = t.header(METADATA_MEMBER, true)?.expect("required");
    check_sizes(&[(METADATA_MEMBER, size)])?;
    let mut bytes = Vec::with_capacity(size as usize);
    t.data(METADATA_MEMBER, size, &mut |b| {
        bytes.extend_from_slice(b);
        Ok(())
    })?;
    Ok(bytes)
}

/// What a strict read of an envelope found.
#[derive(Debug, Clone)]
pub struct EnvelopeReport {
    /// The validated metadata.
    pub metadata: Metadata,
    /// Size of `model.pt2`.
    pub package_bytes: u64,
    /// Size of `constants.safetensors`, when present.
    pub literals_bytes: Option<u64>,
    /// Length of the decompressed tar stream.
    pub tar_bytes: u64,
    /// Compressed bytes read.
    pub compressed_bytes: u64,
    /// What package verification found.
    pub package: PackageReport,
}

fn create_member(stage: &Path, name: &str) -> Result<File> {
    let path = stage.join(name);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(super::publish::FILE_MODE)
        .open(&path)
        .map_err(|e| Error::io(format_args!("cannot create {}", path.display()), &e))
}

fn write_member(file: &mut File, stage: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    file.write_all(bytes).map_err(|e| {
        Error::io(
            format_args!("cannot write {}", stage.join(name).display()),
            &e,
        )
    })
}

/// Receives every member's bytes as they are staged, in stream order:
/// `begin`, then `bytes` any number of times, then `end`, member by member.
/// The engine streams the members into its store this way while they are
/// verified, instead of reading the staged files back afterwards. What a sink
/// receives is unverified until [`read_envelope_into`] returns `Ok`.
pub trait MemberSink {
    /// A member of `size` bytes (its tar header's, checked) starts.
    fn begin(&mut self, member: &'static str, size: u64) -> Result<()>;
    /// The next bytes of the current member.
    fn bytes(&mut self, data: &[u8]) -> Result<()>;
    /// The current member is complete.
    fn end(&mut self) -> Result<()>;
    /// Whether this sink keeps the members it receives, so that the checks
    /// that read a member again (the package's zip, the payload) read the
    /// sink's copy ([`MemberSink::reopen`]) and nothing is staged as a file.
    fn keeps(&self) -> bool {
        false
    }
    /// The kept bytes of `member`, after its `end`: `None` when this sink
    /// keeps nothing.
    fn reopen(&mut self, member: &'static str) -> Result<Option<(Box<dyn ReadSeek>, u64)>> {
        let _ = member;
        Ok(None)
    }
}

/// A sink that keeps nothing.
struct NoSink;

impl MemberSink for NoSink {
    fn begin(&mut self, _: &'static str, _: u64) -> Result<()> {
        Ok(())
    }
    fn bytes(&mut self, _: &[u8]) -> Result<()> {
        Ok(())
    }
    fn end(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The full reader (§6.6 steps 2–8) over `input`, staging the members as
/// files in the existing directory `stage` (none when `sink` keeps them).
/// `admission` runs as soon as the metadata is validated, before any byte of
/// `model.pt2` is read. Members are not fsynced. On failure the caller
/// removes the stage.
pub fn read_envelope<R: Read>(
    input: R,
    stage: &Path,
    admission: &mut dyn FnMut(&Metadata) -> Result<()>,
) -> Result<EnvelopeReport> {
    read_envelope_into(input, stage, admission, &mut NoSink)
}

/// [`read_envelope`], handing every staged member's bytes to `sink` as well.
pub fn read_envelope_into<R: Read>(
    input: R,
    stage: &Path,
    admission: &mut dyn FnMut(&Metadata) -> Result<()>,
    sink: &mut dyn MemberSink,
) -> Result<EnvelopeReport> {
    let mut t = TarStream::new(input)?;
    let bytes = metadata_bytes(&mut t)?;
    let size = bytes.len() as u64;
    let metadata = validate_metadata(&bytes, None)?;
    let staged = !sink.keeps();
    if staged {
        let mut f = create_member(stage, METADATA_MEMBER)?;
        write_member(&mut f, stage, METADATA_MEMBER, &bytes)?;
    }
    admission(&metadata)?;
    sink.begin(METADATA_MEMBER, size)?;
    sink.bytes(&bytes)?;
    sink.end()?;
    // model.pt2
    let package_bytes = t.header(PACKAGE_MEMBER, true)?.expect("required");
    check_sizes(&[(METADATA_MEMBER, size), (PACKAGE_MEMBER, package_bytes)])?;
    let mut f = staged
        .then(|| create_member(stage, PACKAGE_MEMBER))
        .transpose()?;
    sink.begin(PACKAGE_MEMBER, package_bytes)?;
    t.data(PACKAGE_MEMBER, package_bytes, &mut |b| {
        if let Some(f) = f.as_mut() {
            write_member(f, stage, PACKAGE_MEMBER, b)?;
        }
        sink.bytes(b)
    })?;
    sink.end()?;
    drop(f);
    // constants.safetensors, or the first end block
    let literals_bytes = match t.header(LITERALS_MEMBER, false)? {
        None => None,
        Some(n) => {
            check_sizes(&[
                (METADATA_MEMBER, size),
                (PACKAGE_MEMBER, package_bytes),
                (LITERALS_MEMBER, n),
            ])?;
            let mut f = staged
                .then(|| create_member(stage, LITERALS_MEMBER))
                .transpose()?;
            sink.begin(LITERALS_MEMBER, n)?;
            t.data(LITERALS_MEMBER, n, &mut |b| {
                if let Some(f) = f.as_mut() {
                    write_member(f, stage, LITERALS_MEMBER, b)?;
                }
                sink.bytes(b)
            })?;
            sink.end()?;
            drop(f);
            let end = t.block("the end blocks")?;
            if end.iter().any(|&b| b != 0) {
                let looks_like_header = &end[257..263] == b"ustar\0";
                if looks_like_header {
                    return Err(Error::new(
                        Code::ArtifactTarMember,
                        format!(
                            "envelope member {:?} follows {LITERALS_MEMBER}; no further member is allowed",
                            tar::stated_name(&end)
                        ),
                    ));
                }
                return Err(tar_end("the first end block is not zero"));
            }
            Some(n)
        }
    };
    let (tar_bytes, compressed_bytes) = t.finish()?;
    metadata.check_has_literals(literals_bytes.is_some())?;
    // Step 8: the package and the literal payload.
    let package = match sink.reopen(PACKAGE_MEMBER)? {
        Some((source, len)) => verify_opened(Package::from_source(source, len)?, &metadata)?,
        None => verify_package(&stage.join(PACKAGE_MEMBER), &metadata)?,
    };
    let lit_path = stage.join(LITERALS_MEMBER);
    match (literals_bytes, sink.reopen(LITERALS_MEMBER)?) {
        // Whether the metadata expects a payload was checked just above.
        (Some(_), Some((mut source, len))) => verify_payload_from(
            &mut *source,
            len,
            Path::new(LITERALS_MEMBER),
            &metadata.literal_rows(),
            metadata.literal_values(),
        )?,
        (n, _) => verify_literals(n.map(|_| lit_path.as_path()), &metadata)?,
    }
    Ok(EnvelopeReport {
        metadata,
        package_bytes,
        literals_bytes,
        tar_bytes,
        compressed_bytes,
        package,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_running_total_is_checked() {
        let e = check_sizes(&[
            (PACKAGE_MEMBER, MAX_PACKAGE_BYTES),
            (PACKAGE_MEMBER, MAX_PACKAGE_BYTES),
        ])
        .unwrap_err();
        assert_eq!(e.code(), Code::ArtifactTotalTooLarge);
    }
}
