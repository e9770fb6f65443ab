//! The artifact: envelope, metadata, package verification and literal payload
//! (SPEC-v1 §6–§8), plus the path-level operations the engine, the CLI and
//! the bindings call: [`inspect`], [`read_metadata`], [`verify`], [`unpack`]
//! and [`pack`].

pub mod envelope;
pub mod gzip;
pub mod limits;
pub mod literals;
pub mod metadata;
pub mod package;
pub mod publish;
pub mod tar;
pub mod weights;

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use tcg_cj::{Map, Value};

pub use envelope::{
    read_envelope, read_envelope_into, read_metadata_member, write_envelope, EnvelopeReport,
    MemberSink, MemberSource, Tee,
};
pub use limits::*;
pub use metadata::{
    build_metadata, validate_metadata, ConstantRow, ConstantSource, Metadata, COMPILE_POLICY,
};
pub use package::{parse_constant_table, verify_package, PackageReport};

use crate::error::{Code, Error, Result};
use crate::host_isa::{HostFacts, HostIsa};
use publish::Temp;

/// An admission hook: runs on validated metadata before `model.pt2` is read.
pub type Admission<'a> = &'a mut dyn FnMut(&Metadata) -> Result<()>;

fn open_envelope(path: &Path) -> Result<File> {
    let f = File::open(path)
        .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
    let size = f
        .metadata()
        .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?
        .len();
    envelope::check_compressed_size(size)?;
    Ok(f)
}

/// Read and validate the metadata of an envelope, reading only up to the
/// end of `metadata.json` (the payload-presence rule is not decided).
pub fn read_metadata(path: &Path) -> Result<Metadata> {
    let bytes = read_metadata_member(open_envelope(path)?)?;
    validate_metadata(&bytes, None)
}

/// A bounded look at an envelope: `{"compressed_bytes", "metadata",
/// "metadata_bytes"}` from the first member only, with the metadata
/// validated.
pub fn inspect(path: &Path) -> Result<Value> {
    let f = open_envelope(path)?;
    let compressed = f.metadata().map(|m| m.len()).unwrap_or(0);
    let bytes = read_metadata_member(f)?;
    let md = validate_metadata(&bytes, None)?;
    let mut out = Map::new();
    out.insert("compressed_bytes".into(), Value::Int(compressed as i64));
    out.insert("metadata".into(), Value::Object(md.value().clone()));
    out.insert("metadata_bytes".into(), Value::Int(bytes.len() as i64));
    Ok(Value::Object(out))
}

/// What [`verify`] found.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    /// The full read.
    pub envelope: EnvelopeReport,
    /// The admitted host facts when host admission was asked for.
    pub admitted: Option<HostIsa>,
    /// SHA-256 of exactly the bytes that were read and verified (the whole
    /// file, as one handle read it): what a trust decision binds to.
    pub envelope_sha256: tcg_cas::Digest,
}

impl VerifyReport {
    /// The artifact's key.
    pub fn key(&self) -> &str {
        self.envelope.metadata.key()
    }

    /// A summary for `--json` output: the key, entry, member and stream
    /// sizes, the constant count, the `.so` facts and the admitted level
    /// (`null` when host admission was not asked for).
    pub fn to_value(&self) -> Value {
        let e = &self.envelope;
        let int = |n: u64| Value::Int(n as i64);
        let mut m = Map::new();
        m.insert(
            "admitted".into(),
            match &self.admitted {
                Some(h) => Value::Str(h.host_isa_level.clone()),
                None => Value::Null,
            },
        );
        m.insert("compressed_bytes".into(), int(e.compressed_bytes));
        m.insert(
            "compiled_graph_key".into(),
            Value::Str(self.key().to_owned()),
        );
        m.insert("constants".into(), int(e.metadata.constants().len() as u64));
        m.insert("e_machine".into(), int(e.package.e_machine as u64));
        m.insert("entry".into(), Value::Str(e.package.members.entry.clone()));
        m.insert(
            "literals_bytes".into(),
            e.literals_bytes.map_or(Value::Null, int),
        );
        m.insert("lrodata_bytes".into(), int(e.package.lrodata_bytes));
        m.insert(
            "metadata_bytes".into(),
            int(e.metadata.bytes().len() as u64),
        );
        m.insert("package_bytes".into(), int(e.package_bytes));
        m.insert("tar_bytes".into(), int(e.tar_bytes));
        Value::Object(m)
    }
}

/// Verify an envelope completely (§6.6), staging into a temp directory that
/// is removed afterwards; with `admit_host`, also admit it on this host
/// (§5.6) as soon as the metadata is known.
pub fn verify(path: &Path, admit_host: bool) -> Result<VerifyReport> {
    verify_file(open_envelope(path)?, admit_host)
}

/// [`verify`] of an open envelope file: the bytes are read once, through
/// this one handle, and hashed as they are verified, so that the report's
/// `envelope_sha256` is the digest of what was verified even if the path is
/// replaced meanwhile. Decide trust on it, never on a second read by path.
pub fn verify_file(file: File, admit_host: bool) -> Result<VerifyReport> {
    let size = file
        .metadata()
        .map_err(|e| Error::io("cannot stat the envelope", &e))?
        .len();
    envelope::check_compressed_size(size)?;
    let host = if admit_host {
        Some(HostFacts::read()?)
    } else {
        None
    };
    let mut admitted = None;
    let stage = Temp::stage_dir(&std::env::temp_dir().join("tcg-verify"))?;
    let mut admission = |md: &Metadata| -> Result<()> {
        if let Some(h) = &host {
            md.host_isa().admit_on(h)?;
            admitted = Some(md.host_isa().clone());
        }
        Ok(())
    };
    let mut hashing = HashingReader {
        inner: file,
        hash: sha2::Sha256::default(),
    };
    let envelope = read_envelope(&mut hashing, stage.path(), &mut admission)?;
    drop(stage);
    // Whatever the reader left unread (nothing, for a valid envelope) still
    // belongs to the file the digest names.
    std::io::copy(&mut hashing, &mut std::io::sink())
        .map_err(|e| Error::io("cannot read the envelope", &e))?;
    use sha2::Digest as _;
    let envelope_sha256 = tcg_cas::Digest(hashing.hash.finalize().into());
    Ok(VerifyReport {
        envelope,
        admitted,
        envelope_sha256,
    })
}

/// A reader that hashes every byte it hands out.
struct HashingReader<R> {
    inner: R,
    hash: sha2::Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest as _;
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpack an envelope file to the directory `dest` (§6.7).
pub fn unpack(path: &Path, dest: &Path, admission: Admission<'_>) -> Result<EnvelopeReport> {
    publish::refuse_occupied(dest)?;
    let f = open_envelope(path)?;
    unpack_from(f, dest, admission)
}

/// Unpack an envelope read from `input` to the directory `dest` (§6.7):
/// stage beside it, read and verify fully, run `admission` on the metadata,
/// then publish without replacing anything. An existing `dest` is refused
/// (`io.destination_occupied`) and left untouched; no stage remains on any
/// failure. Stage I/O failures are `io.*` errors, never artifact errors.
pub fn unpack_from<R: Read>(
    input: R,
    dest: &Path,
    admission: Admission<'_>,
) -> Result<EnvelopeReport> {
    publish::refuse_occupied(dest)?;
    let stage = Temp::stage_dir(dest)?;
    let report = read_envelope(input, stage.path(), admission)?;
    stage.publish_dir(dest)?;
    Ok(report)
}

/// What [`pack`] wrote.
#[derive(Debug, Clone)]
pub struct PackReport {
    /// The validated metadata.
    pub metadata: Metadata,
    /// What package verification found.
    pub package: PackageReport,
    /// Size of the envelope written.
    pub envelope_bytes: u64,
}

fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    let f = File::open(path)
        .map_err(|e| Error::io(format_args!("cannot open {what} {}", path.display()), &e))?;
    let md = f
        .metadata()
        .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?;
    if !md.is_file() {
        return Err(Error::io_code(
            Code::IoError,
            Some(libc::EINVAL),
            format!("{what} {} is not a regular file", path.display()),
        ));
    }
    Ok((f, md.len()))
}

struct Counter<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counter<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(b)?;
        self.n += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Pack an envelope (§6.8) from a package file, a metadata value and an
/// optional literal payload file, published at `out` without clobbering.
pub fn pack(
    package: &Path,
    metadata: &Value,
    literals: Option<&Path>,
    out: &Path,
) -> Result<PackReport> {
    let (mut pkg, pkg_size) = open_regular(package, "package")?;
    let mut lit = match literals {
        Some(p) => Some(open_regular(p, "literal payload")?),
        None => None,
    };
    let bytes = tcg_cj::to_canonical(metadata).map_err(|e| {
        Error::new(
            Code::ArtifactMetadataJson,
            format!("metadata cannot be encoded as canonical JSON: {e}"),
        )
    })?;
    let md = validate_metadata(&bytes, Some(literals.is_some()))?;
    let mut sizes = vec![
        (METADATA_MEMBER, bytes.len() as u64),
        (PACKAGE_MEMBER, pkg_size),
    ];
    if let Some((_, n)) = &lit {
        sizes.push((LITERALS_MEMBER, *n));
    }
    envelope::check_sizes(&sizes)?;
    literals::verify_literals(literals, &md)?;
    let report = verify_package(package, &md)?;
    publish::refuse_occupied(out)?;
    let (temp, file) = Temp::file(out)?;
    let sink = Counter {
        inner: BufWriter::with_capacity(1 << 20, file),
        n: 0,
    };
    let lit_src = lit.as_mut().map(|(f, n)| MemberSource {
        size: *n,
        reader: f,
    });
    let sink = write_envelope(
        sink,
        &bytes,
        MemberSource {
            size: pkg_size,
            reader: &mut pkg,
        },
        lit_src,
    )?;
    let envelope_bytes = sink.n;
    let file = sink.inner.into_inner().map_err(|e| {
        Error::io(
            format_args!("cannot write {}", temp.path().display()),
            e.error(),
        )
    })?;
    file.sync_all()
        .map_err(|e| Error::io(format_args!("cannot fsync {}", temp.path().display()), &e))?;
    drop(file);
    temp.publish_file(out)?;
    Ok(PackReport {
        metadata: md,
        package: report,
        envelope_bytes,
    })
}
