//! Package verification (SPEC-v1 §8.1–§8.7): zip reading, layout discovery,
//! the wrapper constant table, the constant cross-check, the code-only policy
//! and the ELF checks of `model.pt2`.
//!
//! Failures from the zip, the wrapper or the ELF parser carry the prefix
//! "cannot verify AOTInductor package: ".

pub mod cubin;
pub mod cxx_runtime;
pub mod elf;
pub mod loadable;
pub mod mint_record;
pub mod native_calls;
pub mod shim_imports;
pub mod wrapper;

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::rc::Rc;

use zip::CompressionMethod;

use crate::artifact::limits::{
    inflation_cap, MAX_CENTRAL_DIRECTORY_BYTES, MAX_CUBIN_BYTES, MAX_INFLATION_RATIO,
    MAX_PACKAGE_ENTRIES, MAX_WRAPPER_BYTES,
};
use crate::artifact::metadata::{ConstantRow, Metadata};
use crate::error::{Code, Error, Result};

pub use elf::{expected_e_machine, parse_elf, ElfInfo};
pub use mint_record::{package_mint_record, read_mint_record, MintRecord};
pub use native_calls::{scan_native_calls, UnsupportedCall};
pub use wrapper::{parse_wrapper, parse_wrapper_text, WrapperConstant, WrapperTable};

/// The prefix of zip, wrapper and ELF failures.
pub const PACKAGE_PREFIX: &str = "cannot verify AOTInductor package";
/// The directory that marks an AOTInductor layout inside a package.
pub const AOTI_DIR: &str = "data/aotinductor/";

/// Where one zip member sits in the AOTInductor layout (§8.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The root (`""` or one path component, `model` for torch's packager).
    pub root: String,
    /// The entry: the graph class name (may contain `/`).
    pub entry: String,
    /// The file name within the entry directory.
    pub filename: String,
}

fn layout_err(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactPackageLayout,
        format!("{PACKAGE_PREFIX}: {what}"),
    )
}

fn unreadable(name: &str, e: &dyn std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactPackageZip,
        format!("{PACKAGE_PREFIX}: cannot read package member {name:?}: {e}"),
    )
}

/// `.so` members up to this size are parsed in memory; larger ones as a
/// stream in two passes, in bounded memory.
pub const ELF_IN_MEMORY_MAX: u64 = 64 << 20;

/// An operating-system error, or an allocation the zip reader could not make
/// (`try_reserve`, `io::ErrorKind::OutOfMemory`): a failure of this process,
/// which proves nothing about the bytes (so it can never quarantine).
fn is_resource_failure(e: &std::io::Error) -> bool {
    e.raw_os_error().is_some() || e.kind() == std::io::ErrorKind::OutOfMemory
}

/// A zip failure: an operating-system read error of the staged file is an
/// I/O error (it proves nothing about the bytes); anything else is
/// `artifact.package_zip`.
fn zip_failure(e: zip::result::ZipError) -> Error {
    match e {
        zip::result::ZipError::Io(io) if is_resource_failure(&io) => {
            Error::io("cannot read the staged package", &io)
        }
        other => zip_err(other),
    }
}

/// A read failure of member `name`, classified like [`zip_failure`].
fn member_failure(name: &str, e: &std::io::Error) -> Error {
    if is_resource_failure(e) {
        Error::io(format_args!("cannot read package member {name:?}"), e)
    } else {
        unreadable(name, e)
    }
}

fn zip_err(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactPackageZip,
        format!("{PACKAGE_PREFIX}: invalid .pt2 package: {what}"),
    )
}

/// The layout of a member name: `None` for names outside any
/// `data/aotinductor/` directory; a refusal for a malformed root or entry.
pub fn layout_of(name: &str) -> Result<Option<Layout>> {
    let (root, rest) = if let Some(rest) = name.strip_prefix(AOTI_DIR) {
        ("", rest)
    } else {
        let marker = format!("/{AOTI_DIR}");
        let Some(at) = name.find(&marker) else {
            return Ok(None);
        };
        (&name[..at], &name[at + marker.len()..])
    };
    if root.contains('/') {
        return Err(layout_err(format_args!(
            "member {name:?} has an AOTInductor root {root:?} of more than one component"
        )));
    }
    let Some((entry, filename)) = rest.rsplit_once('/') else {
        return Err(layout_err(format_args!(
            "member {name:?} has no entry directory"
        )));
    };
    if filename.is_empty() {
        return Err(layout_err(format_args!(
            "member {name:?} has an empty file name"
        )));
    }
    let bad_entry = entry.is_empty()
        || entry.contains('\\')
        || entry.contains('\0')
        || entry
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..");
    if bad_entry {
        return Err(layout_err(format_args!(
            "member {name:?} has an unsafe entry {entry:?}"
        )));
    }
    Ok(Some(Layout {
        root: root.to_owned(),
        entry: entry.to_owned(),
        filename: filename.to_owned(),
    }))
}

/// The package file with a read budget: while the zip reader opens the
/// package it may read at most [`MAX_CENTRAL_DIRECTORY_BYTES`] (plus the
/// end-record search), which bounds how many central-directory entries it can
/// parse, and so its memory, whichever end record it settles on. The budget
/// is lifted once the archive is open.
pub struct Budgeted {
    file: Box<dyn ReadSeek>,
    left: Rc<Cell<u64>>,
}

/// What a package can be read from: a file, or the store's copy of one.
pub trait ReadSeek: Read + Seek {}

impl<T: Read + Seek> ReadSeek for T {}

/// The read budget while opening: the central directory plus the end-record
/// search region (64 KiB comment, the records, slack).
const OPEN_BUDGET: u64 = MAX_CENTRAL_DIRECTORY_BYTES + (1 << 20);

impl Read for Budgeted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left.get();
        if left == 0 {
            return Err(std::io::Error::other(
                "the central directory is over its budget",
            ));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.file.read(&mut buf[..want])?;
        self.left.set(left - n as u64);
        Ok(n)
    }
}

impl Seek for Budgeted {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.file.seek(pos)
    }
}

fn too_many_entries(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactPackageTooManyEntries,
        format!("{PACKAGE_PREFIX}: {what}"),
    )
}

/// An opened package: the zip and its member names, with the zip rules of
/// §8.1 applied.
pub struct Package {
    archive: zip::ZipArchive<Budgeted>,
    names: Vec<String>,
    file_len: u64,
}

impl Package {
    /// Open `path` and apply §8.1: central directory, no duplicate names, no
    /// encryption, only stored and deflate members (`artifact.package_zip`).
    /// Failing to open the file at all is an I/O error.
    pub fn open(path: &Path) -> Result<Package> {
        let file = File::open(path)
            .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?
            .len();
        Package::from_source(Box::new(file), file_len)
    }

    /// [`Package::open`] of `file_len` bytes read from `source`.
    pub fn from_source(source: Box<dyn ReadSeek>, file_len: u64) -> Result<Package> {
        let left = Rc::new(Cell::new(OPEN_BUDGET));
        let budgeted = Budgeted {
            file: source,
            left: Rc::clone(&left),
        };
        let opened = zip::ZipArchive::new(budgeted);
        if left.get() == 0 {
            return Err(too_many_entries(format_args!(
                "the central directory is larger than {MAX_CENTRAL_DIRECTORY_BYTES} bytes"
            )));
        }
        left.set(u64::MAX);
        let mut archive = opened.map_err(zip_failure)?;
        if archive.len() as u64 > MAX_PACKAGE_ENTRIES {
            return Err(too_many_entries(format_args!(
                "the zip lists {} entries, more than {MAX_PACKAGE_ENTRIES}",
                archive.len()
            )));
        }
        if archive.has_duplicate_names() {
            return Err(zip_err("duplicate member names"));
        }
        let mut names = Vec::with_capacity(archive.len());
        let mut seen = HashSet::new();
        for i in 0..archive.len() {
            let f = archive.by_index_raw(i).map_err(zip_failure)?;
            let name = f.name().map_err(zip_err)?.into_owned();
            if f.encrypted() {
                return Err(zip_err(format_args!("member {name:?} is encrypted")));
            }
            if !matches!(
                f.compression(),
                CompressionMethod::Stored | CompressionMethod::Deflated
            ) {
                return Err(zip_err(format_args!(
                    "member {name:?} uses compression method {:?}; only stored and deflate are allowed",
                    f.compression()
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(zip_err(format_args!("duplicate member name {name:?}")));
            }
            names.push(name);
        }
        Ok(Package {
            archive,
            names,
            file_len,
        })
    }

    /// The size of the package file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The stored (compressed) size of member `name`.
    pub fn compressed_size(&mut self, name: &str) -> Result<u64> {
        let index = self.index_of(name)?;
        let f = self.archive.by_index_raw(index).map_err(zip_failure)?;
        Ok(f.compressed_size())
    }

    /// The declared size of member `name` after the bounds of its kind: at
    /// most `cap` (`artifact.package_member_too_large`) and at most the
    /// ratio cap over its stored size (`artifact.inflation_ratio`).
    pub fn bounded_size(&mut self, name: &str, cap: u64) -> Result<u64> {
        let declared = self.declared_size(name)?;
        if declared > cap {
            return Err(Error::new(
                Code::ArtifactPackageMemberTooLarge,
                format!(
                    "{PACKAGE_PREFIX}: member {name:?} declares {declared} bytes, more than the {cap} allowed for it"
                ),
            ));
        }
        let stored = self.compressed_size(name)?;
        if declared > inflation_cap(stored) {
            return Err(Error::new(
                Code::ArtifactInflationRatio,
                format!(
                    "{PACKAGE_PREFIX}: member {name:?} inflates from {stored} to {declared} bytes, more than the allowance plus {MAX_INFLATION_RATIO}:1"
                ),
            ));
        }
        Ok(declared)
    }

    /// [`Package::read`] after [`Package::bounded_size`].
    pub fn read_bounded(&mut self, name: &str, cap: u64) -> Result<Vec<u8>> {
        self.bounded_size(name, cap)?;
        self.read(name)
    }

    /// The member names in central-directory order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    fn index_of(&self, name: &str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| zip_err(format_args!("no member {name:?}")))
    }

    /// The uncompressed size member `name` declares.
    pub fn declared_size(&mut self, name: &str) -> Result<u64> {
        let index = self.index_of(name)?;
        let f = self.archive.by_index_raw(index).map_err(zip_failure)?;
        Ok(f.size())
    }

    /// Hand member `name` to `f` as a stream of at most its declared size
    /// plus one byte; reading it to the end checks its CRC.
    pub fn stream(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&mut dyn Read) -> Result<()>,
    ) -> Result<()> {
        let index = self.index_of(name)?;
        let file = self.archive.by_index(index).map_err(|e| match e {
            zip::result::ZipError::Io(io) => member_failure(name, &io),
            other => unreadable(name, &other),
        })?;
        let limit = file.size().saturating_add(1);
        let mut limited = file.take(limit);
        f(&mut limited)
    }

    /// Read member `name` completely, CRC-checked, and exactly of its
    /// declared size (`artifact.package_zip`).
    pub fn read(&mut self, name: &str) -> Result<Vec<u8>> {
        let declared = self.declared_size(name)?;
        let mut buf = Vec::with_capacity(declared.min(64 << 20) as usize);
        self.stream(name, &mut |r| {
            r.read_to_end(&mut buf)
                .map(|_| ())
                .map_err(|e| member_failure(name, &e))
        })?;
        if buf.len() as u64 != declared {
            return Err(unreadable(
                name,
                &format_args!("it holds more than the declared {declared} bytes"),
            ));
        }
        Ok(buf)
    }

    /// Discover the layout (§8.2) and return the wrapper and `.so` member
    /// names of the single entry, which must be `expected_entry` when given.
    pub fn entry_members(&self, expected_entry: Option<&str>) -> Result<EntryMembers> {
        let mut roots = BTreeSet::new();
        let mut owners = BTreeSet::new();
        let mut files: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for name in &self.names {
            if let Some(l) = layout_of(name)? {
                roots.insert(l.root.clone());
                if l.filename.ends_with(".wrapper.cpp") {
                    owners.insert(l.entry.clone());
                }
                files
                    .entry(l.entry)
                    .or_default()
                    .push((l.filename, name.clone()));
            }
        }
        if roots.len() > 1 {
            return Err(layout_err(format_args!(
                "package members use multiple AOTInductor roots {roots:?}"
            )));
        }
        let owners: Vec<String> = owners.into_iter().collect();
        let entry = match expected_entry {
            Some(e) if owners.len() == 1 && owners[0] == e => e.to_owned(),
            None if owners.len() == 1 => owners[0].clone(),
            _ => {
                return Err(Error::new(
                    Code::ArtifactPackageEntryMismatch,
                    format!(
                        "package entries with a wrapper are {owners:?}, expected exactly [{:?}]",
                        expected_entry.unwrap_or("<one entry>")
                    ),
                ))
            }
        };
        let members = &files[&entry];
        let pick = |suffix: &str| -> Result<String> {
            let hits: Vec<&String> = members
                .iter()
                .filter(|(f, _)| f.ends_with(suffix))
                .map(|(_, n)| n)
                .collect();
            if hits.len() != 1 {
                return Err(layout_err(format_args!(
                    "expected exactly one *{suffix} in entry {entry:?}, found {}",
                    hits.len()
                )));
            }
            Ok(hits[0].clone())
        };
        Ok(EntryMembers {
            entry: entry.clone(),
            wrapper: pick(".wrapper.cpp")?,
            shared_object: pick(".so")?,
            cubins: members
                .iter()
                .filter(|(f, _)| f.ends_with(".cubin"))
                .map(|(_, n)| n.clone())
                .collect(),
        })
    }
}

/// The members of the package's single entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryMembers {
    /// The entry (the graph class name).
    pub entry: String,
    /// The `*.wrapper.cpp` member name.
    pub wrapper: String,
    /// The `*.so` member name.
    pub shared_object: String,
    /// The `*.cubin` member names (CUDA device code), in name order.
    pub cubins: Vec<String>,
}

/// What package verification found.
#[derive(Debug, Clone, PartialEq)]
pub struct PackageReport {
    /// The entry's members.
    pub members: EntryMembers,
    /// The wrapper's constant table.
    pub table: WrapperTable,
    /// `e_machine` of the `.so`.
    pub e_machine: u16,
    /// Total `.lrodata` bytes of the `.so`.
    pub lrodata_bytes: u64,
    /// The weights contract of the package annex (`None` when the package has
    /// no annex, or its annex has no weights block).
    pub weights: Option<crate::artifact::weights::WeightsContract>,
    /// The mint record, when the package carries one (checked against the
    /// wrapper).
    pub mint_record: Option<MintRecord>,
}

fn read_wrapper(pkg: &mut Package, member: &str) -> Result<WrapperTable> {
    let bytes = pkg.read_bounded(member, MAX_WRAPPER_BYTES)?;
    parse_wrapper(&bytes).map_err(|e| e.context(format_args!("{PACKAGE_PREFIX}: {member}")))
}

/// Largest extern-kernel table (`*.json` beside the wrapper) read to name
/// the operators of proxy calls (16 MiB).
pub const MAX_EXTERN_TABLE_BYTES: u64 = 16 << 20;

/// The calls of the entry's wrapper (the text `wrapper`, already read) that
/// the native path cannot make, named from the entry's extern-kernel table
/// when the package has one (read bounded; a table over the bound or
/// unreadable names nothing, the calls are still found).
pub fn entry_native_calls(
    pkg: &mut Package,
    members: &EntryMembers,
    wrapper: &str,
) -> Vec<UnsupportedCall> {
    let table = native_calls::extern_table_member(&members.wrapper, pkg.names())
        .cloned()
        .and_then(|name| pkg.read_bounded(&name, MAX_EXTERN_TABLE_BYTES).ok());
    scan_native_calls(wrapper, table.as_deref())
}

/// The native-unsupported calls of a package with exactly one entry (for
/// mint, before the metadata exists).
pub fn package_native_calls(path: &Path) -> Result<Vec<UnsupportedCall>> {
    let mut pkg = Package::open(path)?;
    let members = pkg.entry_members(None)?;
    let text = entry_wrapper_text(&mut pkg, &members.wrapper)?;
    Ok(entry_native_calls(&mut pkg, &members, &text))
}

/// The wrapper source of the only entry of the package at `path` (bounded).
pub fn package_wrapper_text(path: &Path) -> Result<String> {
    let mut pkg = Package::open(path)?;
    let members = pkg.entry_members(None)?;
    entry_wrapper_text(&mut pkg, &members.wrapper)
}

fn entry_wrapper_text(pkg: &mut Package, wrapper: &str) -> Result<String> {
    let bytes = pkg.read_bounded(wrapper, MAX_WRAPPER_BYTES)?;
    String::from_utf8(bytes).map_err(|_| {
        Error::new(
            Code::ArtifactWrapperParse,
            format!("{PACKAGE_PREFIX}: {wrapper} is not UTF-8"),
        )
    })
}

/// The constant table of a package with exactly one entry, as manifest rows
/// in index order (for mint, before the metadata exists).
pub fn parse_constant_table(path: &Path) -> Result<Vec<ConstantRow>> {
    let mut pkg = Package::open(path)?;
    let members = pkg.entry_members(None)?;
    Ok(read_wrapper(&mut pkg, &members.wrapper)?.rows())
}

/// Verify a package against validated metadata (§8).
pub fn verify_package(path: &Path, metadata: &Metadata) -> Result<PackageReport> {
    verify_opened(Package::open(path)?, metadata)
}

/// [`verify_package`] of a package already open (from the store, say).
pub fn verify_opened(mut pkg: Package, metadata: &Metadata) -> Result<PackageReport> {
    let weights = read_annex(&mut pkg, metadata)?;
    let mut report = verify_opened_facts(
        pkg,
        metadata.name(),
        metadata.constants(),
        &metadata.host_isa().machine,
        metadata.sm(),
    )?;
    report.weights = weights;
    Ok(report)
}

/// The name of the package annex member, if the package has one: the
/// annex file under the package root (`""` or one component). Two are refused.
pub fn annex_member(pkg: &Package) -> Result<Option<String>> {
    use crate::artifact::weights::ANNEX_FILE;
    let mut found = None;
    for name in pkg.names() {
        let hit = name == ANNEX_FILE
            || name
                .strip_suffix(ANNEX_FILE)
                .and_then(|root| root.strip_suffix('/'))
                .is_some_and(|root| !root.is_empty() && !root.contains('/'));
        if hit {
            if found.is_some() {
                return Err(layout_err("the package holds two annex members"));
            }
            found = Some(name.clone());
        }
    }
    Ok(found)
}

/// Read and check the package annex against `metadata` (bounded by
/// `MAX_ANNEX_BYTES`); `None` when there is none.
pub fn read_annex(
    pkg: &mut Package,
    metadata: &Metadata,
) -> Result<Option<crate::artifact::weights::WeightsContract>> {
    let declared = crate::artifact::weights::declared_fqns(metadata)?;
    read_annex_of(pkg, &declared, metadata.constants())
}

/// [`read_annex`] against the declared constant fqns and constant rows.
fn read_annex_of(
    pkg: &mut Package,
    declared: &std::collections::BTreeSet<String>,
    rows: &[ConstantRow],
) -> Result<Option<crate::artifact::weights::WeightsContract>> {
    use crate::artifact::weights::{parse_annex, MAX_ANNEX_BYTES};
    let Some(member) = annex_member(pkg)? else {
        return Ok(None);
    };
    let bytes = pkg.read_bounded(&member, MAX_ANNEX_BYTES)?;
    parse_annex(&bytes, declared, rows)
}

/// Append the annex holding `contract` to the package at `path` (a package
/// this process just compiled, before it is packed), under the root of its
/// AOTInductor layout. A package that already has an annex is refused.
pub fn append_annex(
    path: &Path,
    contract: &crate::artifact::weights::WeightsContract,
) -> Result<()> {
    use crate::artifact::weights::{annex_bytes, ANNEX_FILE};
    use std::io::Write as _;
    let pkg = Package::open(path)?;
    if annex_member(&pkg)?.is_some() {
        return Err(layout_err("the package already holds an annex"));
    }
    let members = pkg.entry_members(None)?;
    let root = layout_of(&members.wrapper)?
        .map(|l| l.root)
        .unwrap_or_default();
    drop(pkg);
    let name = if root.is_empty() {
        ANNEX_FILE.to_owned()
    } else {
        format!("{root}/{ANNEX_FILE}")
    };
    let bytes = annex_bytes(contract)?;
    let io = |e: std::io::Error| {
        Error::io(
            format_args!("cannot append the annex to {}", path.display()),
            &e,
        )
    };
    let file = File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io)?;
    let mut zip = zip::ZipWriter::new_append(file).map_err(zip_failure)?;
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default());
    zip.start_file(name, options).map_err(zip_failure)?;
    zip.write_all(&bytes).map_err(io)?;
    let file = zip.finish().map_err(zip_failure)?;
    file.sync_all().map_err(io)?;
    Ok(())
}

/// The shared libraries (`DT_NEEDED`) the entry's `.so` of the package at
/// `path` names, for a package that verification already accepted.
pub fn needed_libraries(path: &Path, entry: &str) -> Result<Vec<String>> {
    let mut pkg = Package::open(path)?;
    let members = pkg.entry_members(Some(entry))?;
    let so = pkg.read_bounded(&members.shared_object, crate::artifact::MAX_PACKAGE_BYTES)?;
    let elf = goblin::elf::Elf::parse(&so).map_err(|e| {
        Error::new(
            Code::ArtifactElfInvalid,
            format!("{PACKAGE_PREFIX}: {}: {e}", members.shared_object),
        )
    })?;
    Ok(elf.libraries.iter().map(|s| (*s).to_owned()).collect())
}

/// The C++-runtime symbols the entry's `.so` of the package at `path`
/// defines ([`cxx_runtime::runtime_definitions`]): empty for a `.so` that uses
/// the process's C++ runtime or needs none; non-empty for one that carries
/// its own (a compiler that links libstdc++ statically). The `.so` is read in
/// memory up to [`ELF_IN_MEMORY_MAX`], else as a stream, in bounded memory.
pub fn own_cxx_runtime(path: &Path, entry: &str) -> Result<Vec<String>> {
    read_entry_so(path, Some(entry), cxx_runtime::runtime_definitions)
}

/// Run `read` over the entry's `.so` of the package at `path` (`entry` `None`:
/// the only one): in memory up to [`ELF_IN_MEMORY_MAX`], else as a stream in
/// bounded memory; an invalid ELF names the member.
fn read_entry_so<T>(
    path: &Path,
    entry: Option<&str>,
    read: fn(&mut dyn loadable::Ranges) -> Result<T>,
) -> Result<T> {
    let mut pkg = Package::open(path)?;
    let members = pkg.entry_members(entry)?;
    let so = members.shared_object;
    let size = pkg.bounded_size(&so, crate::artifact::MAX_PACKAGE_BYTES)?;
    let found = if size <= ELF_IN_MEMORY_MAX {
        let bytes = pkg.read(&so)?;
        read(&mut &bytes[..])
    } else {
        read(&mut loadable::StreamRanges {
            size,
            reopen: &mut |f| pkg.stream(&so, f),
        })
    };
    found.map_err(|e| {
        if e.code() == Code::ArtifactElfInvalid {
            e.context(format_args!("{PACKAGE_PREFIX}: {so}"))
        } else {
            e
        }
    })
}

/// The imports of the entry's `.so` of the package at `path`
/// ([`shim_imports::dynamic_imports`]): the libtorch C shim functions it
/// calls (`aoti_torch_*`) and every other undefined symbol no system library
/// provides. `entry` `None` takes the package's only entry. The `.so` is read
/// in memory up to [`ELF_IN_MEMORY_MAX`], else as a stream, in bounded memory.
pub fn shim_imports(path: &Path, entry: Option<&str>) -> Result<shim_imports::ShimImports> {
    read_entry_so(path, entry, shim_imports::dynamic_imports)
}

/// [`own_cxx_runtime`] for a load: a package it cannot read is
/// `run.package_invalid` (I/O errors stay I/O errors), as a loader reports it.
pub fn own_cxx_runtime_to_load(path: &Path, entry: &str) -> Result<Vec<String>> {
    own_cxx_runtime(path, entry).map_err(|e| {
        if e.kind() == crate::Kind::Io {
            e
        } else {
            Error::new(
                Code::RunPackageInvalid,
                format!("cannot load entry {entry:?}: {}", e.message()),
            )
        }
    })
}

/// Whether torch's package loader (`AOTIModelPackageLoader`) can load the
/// package at `path`: refused (`run.loader_unsupported`) only when its `.so`
/// is proven to carry its own C++ runtime ([`own_cxx_runtime`]), which
/// crashes that loader in its constructor (seen with torch 2.11 and GCC
/// 13.3). Every other `.so` is accepted, whatever its `DT_NEEDED` says.
/// `load()` and parity at mint run such a package through the torch-free
/// runner instead (docs/run.md).
pub fn check_torch_loader(path: &Path, entry: &str) -> Result<()> {
    let own = own_cxx_runtime_to_load(path, entry)?;
    if own.is_empty() {
        return Ok(());
    }
    Err(Error::new(
        Code::RunLoaderUnsupported,
        format!(
            "the graph's .so carries its own C++ runtime (it defines {own:?}): its compiler linked libstdc++ statically, and torch's package loader crashes on such packages; load() and load_native() run it through the torch-free runner"
        ),
    ))
}

/// The weights contract of the package at `path`: its annex's, or the one
/// `metadata` implies for a package without one.
pub fn weights_contract(
    path: &Path,
    metadata: &Metadata,
) -> Result<crate::artifact::weights::WeightsContract> {
    let declared = crate::artifact::weights::declared_fqns(metadata)?;
    weights_contract_of(path, &declared, metadata.constants())
}

/// [`weights_contract`] from the declared constant fqns and constant rows of
/// metadata the caller already verified.
pub fn weights_contract_of(
    path: &Path,
    declared: &std::collections::BTreeSet<String>,
    rows: &[ConstantRow],
) -> Result<crate::artifact::weights::WeightsContract> {
    let mut pkg = Package::open(path)?;
    match read_annex_of(&mut pkg, declared, rows)? {
        Some(c) => Ok(c),
        None => crate::artifact::weights::WeightsContract::implied(declared, rows),
    }
}

/// Verify a package against the facts it must restate: the entry `name`,
/// the metadata constant rows, the recorded machine (§8.2–§8.7) and the `sm`
/// every cubin must be built for.
pub fn verify_package_facts(
    path: &Path,
    name: &str,
    constants: &[ConstantRow],
    machine: &str,
    sm: &str,
) -> Result<PackageReport> {
    verify_opened_facts(Package::open(path)?, name, constants, machine, sm)
}

fn verify_opened_facts(
    mut pkg: Package,
    name: &str,
    constants: &[ConstantRow],
    machine: &str,
    sm: &str,
) -> Result<PackageReport> {
    let members = pkg.entry_members(Some(name))?;
    // CUDA code in a CPU artifact is refused before any of it is read.
    if let (Some(first), None) = (members.cubins.first(), cubin::sm_number(sm)) {
        return Err(Error::new(
            Code::ArtifactCubinArchMismatch,
            format!("{PACKAGE_PREFIX}: {first} is CUDA device code in an artifact for {sm}"),
        ));
    }
    // Everything this function inflates, bounded by kind and, in total,
    // against the package's own size: time stays linear in the input.
    let mut inflated = pkg.bounded_size(&members.wrapper, MAX_WRAPPER_BYTES)?;
    inflated = inflated.saturating_add(
        pkg.bounded_size(&members.shared_object, crate::artifact::MAX_PACKAGE_BYTES)?,
    );
    for member in &members.cubins {
        inflated = inflated.saturating_add(pkg.bounded_size(member, MAX_CUBIN_BYTES)?);
    }
    let record_name = mint_record::record_member(pkg.names())?;
    let has_record = pkg.names().contains(&record_name);
    if has_record {
        inflated = inflated.saturating_add(
            pkg.bounded_size(&record_name, mint_record::MAX_MINT_RECORD_BYTES)
                .map_err(|e| e.rewrap(Code::ArtifactMintRecordInvalid, "mint record"))?,
        );
        if let Some(table) = native_calls::extern_table_member(&members.wrapper, pkg.names()) {
            let table = table.clone();
            inflated = inflated.saturating_add(pkg.bounded_size(&table, MAX_EXTERN_TABLE_BYTES)?);
        }
    }
    if inflated > inflation_cap(pkg.file_len()) {
        return Err(Error::new(
            Code::ArtifactInflationRatio,
            format!(
                "{PACKAGE_PREFIX}: the members to verify inflate to {inflated} bytes from a {}-byte package, more than the allowance plus {MAX_INFLATION_RATIO}:1",
                pkg.file_len()
            ),
        ));
    }
    let wrapper_bytes = pkg.read_bounded(&members.wrapper, MAX_WRAPPER_BYTES)?;
    let table = parse_wrapper(&wrapper_bytes)
        .map_err(|e| e.context(format_args!("{PACKAGE_PREFIX}: {}", members.wrapper)))?;
    let mint_record = if has_record {
        let record = read_mint_record(&mut pkg)?;
        if let Some(r) = &record {
            // parse_wrapper accepted the bytes, so they are UTF-8.
            let text = std::str::from_utf8(&wrapper_bytes).unwrap_or_default();
            let scanned = entry_native_calls(&mut pkg, &members, text);
            if scanned != r.unsupported_calls {
                return Err(Error::new(
                    Code::ArtifactMintRecordInvalid,
                    format!(
                        "mint record lists unsupported calls {:?}, the wrapper makes {:?}",
                        r.unsupported_calls
                            .iter()
                            .map(|c| c.describe())
                            .collect::<Vec<_>>(),
                        scanned.iter().map(|c| c.describe()).collect::<Vec<_>>()
                    ),
                ));
            }
        }
        record
    } else {
        None
    };
    drop(wrapper_bytes);
    if table.rows() != constants {
        return Err(Error::new(
            Code::ArtifactConstantsMismatch,
            "metadata constants do not match the package constant table",
        ));
    }
    let declared: u64 = table
        .constants
        .iter()
        .map(|c| c.data_size)
        .fold(0u64, u64::saturating_add);
    if table.load_constants_from_blob {
        let mut largest: Vec<&WrapperConstant> = table.constants.iter().collect();
        largest.sort_by(|a, b| b.data_size.cmp(&a.data_size).then(a.index.cmp(&b.index)));
        let top: Vec<String> = largest
            .iter()
            .take(5)
            .map(|c| format!("{} ({} B)", c.fqn(), c.data_size))
            .collect();
        return Err(Error::new(
            Code::ArtifactNotCodeOnly,
            format!(
                "AOTInductor package is not code-only: load_constants_from_blob is true for {} constants totalling {declared} B (largest: {})",
                table.constants.len(),
                top.join(", ")
            ),
        ));
    }
    let so_name = members.shared_object.clone();
    let so_size = pkg.declared_size(&so_name)?;
    let parsed = if so_size <= ELF_IN_MEMORY_MAX {
        let so = pkg.read(&so_name)?;
        parse_elf(&so).and_then(|info| {
            loadable::check_loadable(&mut &so[..])?;
            Ok(info)
        })
    } else {
        elf::parse_elf_stream(so_size, &mut |f| pkg.stream(&so_name, f)).and_then(|info| {
            loadable::check_loadable(&mut loadable::StreamRanges {
                size: so_size,
                reopen: &mut |f| pkg.stream(&so_name, f),
            })?;
            Ok(info)
        })
    };
    let info = parsed.map_err(|e| {
        if e.code() == Code::ArtifactElfInvalid {
            e.context(format_args!("{PACKAGE_PREFIX}: {so_name}"))
        } else {
            e
        }
    })?;
    match expected_e_machine(machine) {
        Some(m) if m == info.machine => {}
        Some(m) => {
            return Err(Error::new(
                Code::ArtifactElfMachineMismatch,
                format!(
                    "{}: e_machine is {}, but host_isa.machine {machine} requires {m}",
                    members.shared_object, info.machine
                ),
            ))
        }
        None => {
            return Err(Error::new(
                Code::ArtifactElfMachineMismatch,
                format!("host_isa.machine {machine:?} has no known ELF machine"),
            ))
        }
    }
    let lrodata = info.section_size(".lrodata");
    if declared > 0 && lrodata >= declared {
        return Err(Error::new(
            Code::ArtifactNotCodeOnly,
            format!(
                "AOTInductor package is not code-only: {}: .lrodata is {lrodata} B, at least the {declared} B declared across {} constants",
                members.shared_object,
                table.constants.len()
            ),
        ));
    }
    for member in &members.cubins {
        let bytes = pkg.read_bounded(member, MAX_CUBIN_BYTES)?;
        cubin::check_cubin(member, &bytes, sm)?;
    }
    Ok(PackageReport {
        members,
        table,
        e_machine: info.machine,
        lrodata_bytes: lrodata,
        weights: None,
        mint_record,
    })
}

#[cfg(test)]
mod resource_tests {
    use super::*;

    #[test]
    fn an_allocation_failure_is_an_io_error_not_a_bad_package() {
        let oom = std::io::Error::new(std::io::ErrorKind::OutOfMemory, "allocation failed");
        for e in [
            member_failure("m", &oom),
            zip_failure(zip::result::ZipError::Io(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                "allocation failed",
            ))),
        ] {
            assert_eq!(e.kind(), crate::Kind::Io, "{e}");
            assert_eq!(e.code(), Code::IoError);
            assert_eq!(e.errno(), Some(libc::ENOMEM));
        }
        // A malformed stream stays evidence against the bytes.
        let bad = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad crc");
        assert_eq!(member_failure("m", &bad).code(), Code::ArtifactPackageZip);
    }
}
