//! Shared fixtures of the engine and artifact tests: the reference artifact
//! minted by the original implementation (a real AOTInductor CPU package),
//! variants of it, and the adversarial corpus.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use tcg_cas::Target;
use tcg_cj::Value;
use tcg_core::artifact::envelope::envelope_bytes;
use tcg_core::artifact::{
    build_metadata, parse_constant_table, read_metadata, ConstantRow, Metadata,
};
use tcg_core::engine::{graph_ref, Engine, MintOutput};
use tcg_core::host_isa::HostIsa;
use tcg_core::identity::GraphClassDeclaration;
use tcg_core::Code;

pub const KEY: &str = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a";

pub fn reference() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/reference-0.2.0/mlp-cpu.tar.gz")
}

/// A mint callback that counts its calls in `calls` and returns the reference
/// artifact's parts (written under `dir`).
pub fn counting_mint<'a>(
    calls: &'a std::cell::Cell<u32>,
    dir: &'a Path,
) -> impl FnMut() -> tcg_core::Result<MintOutput> + 'a {
    move || {
        calls.set(calls.get() + 1);
        Ok(reference_mint(dir))
    }
}

/// A file of the adversarial corpus (`testdata/adversarial`).
pub fn corpus(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/adversarial")
        .join(name)
}

/// The decompressed bytes of a gzip stream.
pub fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// The reference envelope's members, read with the system `tar`.
pub fn members(dir: &Path) -> PathBuf {
    let out = dir.join("members");
    std::fs::create_dir_all(&out).unwrap();
    let ok = std::process::Command::new("tar")
        .arg("xzf")
        .arg(reference())
        .arg("-C")
        .arg(&out)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    out
}

/// The reference artifact taken apart: its metadata, its package on disk,
/// the package's constant table and the recorded declaration.
pub struct Reference {
    pub metadata: Metadata,
    pub package: PathBuf,
    pub rows: Vec<ConstantRow>,
    pub declaration: GraphClassDeclaration,
}

pub fn reference_parts(dir: &Path) -> Reference {
    let metadata = read_metadata(&reference()).unwrap();
    let package = members(dir).join("model.pt2");
    let rows = parse_constant_table(&package).unwrap();
    let declaration = GraphClassDeclaration::from_graph_class_value(
        metadata.value()["graph_class"].as_object().unwrap(),
    )
    .unwrap();
    Reference {
        metadata,
        package,
        rows,
        declaration,
    }
}

/// What a mint of the reference graph returns: its package and recorded facts.
pub fn reference_mint(dir: &Path) -> MintOutput {
    let r = reference_parts(dir);
    MintOutput {
        sm: r.metadata.sm().to_string(),
        toolchain: r.metadata.value()["toolchain"].clone(),
        host_isa: r.metadata.host_isa().clone(),
        package: r.package,
        declaration: r.declaration,
        literals: vec![],
        witness_lines: None,
        weights: None,
        parity: None,
    }
}

/// A second, different but valid envelope for the same key: the reference
/// package with one extra, ignored zip member.
pub fn divergent_envelope(dir: &Path) -> PathBuf {
    let m = members(dir);
    let pkg = dir.join("divergent.pt2");
    std::fs::copy(m.join("model.pt2"), &pkg).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pkg)
        .unwrap();
    let mut z = zip::ZipWriter::new_append(f).unwrap();
    z.start_file(
        "model/extra-note.txt",
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored),
    )
    .unwrap();
    z.write_all(b"a second mint of the same graph\n").unwrap();
    z.finish().unwrap();
    let md = read_metadata(&reference()).unwrap();
    let out = dir.join("divergent.tar.gz");
    tcg_core::artifact::pack(&pkg, &Value::Object(md.value().clone()), None, &out).unwrap();
    out
}

/// An envelope whose recorded host code is for another machine (aarch64),
/// written without package verification so that admission is what refuses it.
pub fn foreign_host_envelope(dir: &Path) -> (String, PathBuf) {
    let r = reference_parts(dir);
    let facts: Value = tcg_cj::parse_strict(
        br#"{"cpp_march":"native","cpp_simdlen":"native","host_isa_features":"asimd,fp","host_isa_level":"native","machine":"aarch64"}"#,
    )
    .unwrap();
    let host = HostIsa::from_value(&facts, Code::ArtifactHostIsaInvalid).unwrap();
    let foreign = build_metadata(
        &r.declaration,
        &r.rows,
        "cpu-aarch64-native",
        &r.metadata.value()["toolchain"],
        &host,
    )
    .unwrap();
    let mut pkg = Vec::new();
    std::fs::File::open(&r.package)
        .unwrap()
        .read_to_end(&mut pkg)
        .unwrap();
    let bytes = envelope_bytes(foreign.bytes(), &pkg, None).unwrap();
    let out = dir.join("foreign.tar.gz");
    std::fs::write(&out, bytes).unwrap();
    (foreign.key().to_string(), out)
}

/// Flip one byte of every object file of the store (after making it writable).
pub fn corrupt_objects(root: &Path, larger_than: u64) -> usize {
    let mut n = 0;
    for entry in walk(&root.join("objects")) {
        let meta = std::fs::metadata(&entry).unwrap();
        if meta.len() > larger_than {
            use std::os::unix::fs::PermissionsExt;
            let mut bytes = std::fs::read(&entry).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            // Owner-writable for the write, then back to the store's 0444
            // (a writable object would be refused as insecure instead).
            std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o644)).unwrap();
            std::fs::write(&entry, bytes).unwrap();
            std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o444)).unwrap();
            n += 1;
        }
    }
    n
}

pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Names and bytes of every file in a directory, sorted.
pub fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Entries beside `dest` whose names start with `.<dest name>.` (stages, temps).
pub fn leftovers(dest: &Path) -> Vec<PathBuf> {
    let name = dest.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(dest.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!(".{name}."))
        })
        .collect()
}

/// A second valid artifact of the reference package under another key: the
/// same facts recorded with another toolchain block.
pub fn other_key_envelope(dir: &Path, torch: &str) -> (String, PathBuf) {
    let r = reference_parts(dir);
    let mut toolchain = r.metadata.value()["toolchain"].as_object().unwrap().clone();
    toolchain.insert("torch".into(), torch.into());
    let other = build_metadata(
        &r.declaration,
        &r.rows,
        r.metadata.sm(),
        &Value::Object(toolchain),
        r.metadata.host_isa(),
    )
    .unwrap();
    let out = dir.join(format!("other-{torch}.tar.gz"));
    tcg_core::artifact::pack(
        &r.package,
        &Value::Object(other.value().clone()),
        None,
        &out,
    )
    .unwrap();
    (other.key().to_string(), out)
}

/// Put an envelope into the store under `key`'s graph ref directly, as
/// another host or a damaged store would, bypassing import's checks.
pub fn plant(engine: &Engine, key: &str, envelope: &Path) -> tcg_cas::Digest {
    let lease = engine.store().lease().unwrap();
    let info = engine.store().ingest_file(&lease, envelope).unwrap();
    engine
        .store()
        .compare_and_swap(
            &graph_ref(key),
            None,
            Some(&Target::manifest(info.manifest)),
        )
        .unwrap();
    lease.end().unwrap();
    info.manifest
}

/// An ed25519 key pair made by the real OpenSSH `ssh-keygen` (no passphrase):
/// the private key's path and the public key line.
pub fn keygen(dir: &Path, name: &str, comment: &str) -> (PathBuf, String) {
    let private = dir.join(name);
    let ok = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(&private)
        .status()
        .expect("ssh-keygen is required (apt-get install openssh-client)")
        .success();
    assert!(ok);
    let public = std::fs::read_to_string(format!("{}.pub", private.display())).unwrap();
    (private, public.trim().to_string())
}
