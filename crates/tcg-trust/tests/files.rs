//! Trust files are the operator's paths: symlinks are followed (a Kubernetes
//! ConfigMap mounts files as symlinks), but only regular files of bounded
//! size are read, and a FIFO never hangs the reader.

use std::path::Path;

use tcg_trust::{read_small_file, AllowedSigners, MAX_DOCUMENT_BYTES};

const LINE: &str =
    "ci@x ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIM8/Ssb8+9zQKzH0AcJDKbLEyz3vvMaMa2i0jPbrfG6M\n";

#[test]
fn a_policy_behind_a_symlink_is_read() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("..data")).unwrap();
    std::fs::write(d.path().join("..data/allowed_signers"), LINE).unwrap();
    std::os::unix::fs::symlink("..data/allowed_signers", d.path().join("allowed_signers")).unwrap();
    let a = AllowedSigners::load(&d.path().join("allowed_signers")).unwrap();
    assert_eq!(a.signers.len(), 1);
}

#[test]
fn fifos_directories_and_oversized_files_are_refused_with_io_error() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let big = d.path().join("big");
    std::fs::write(&big, vec![b'#'; MAX_DOCUMENT_BYTES as usize + 1]).unwrap();
    for p in [
        fifo.as_path(),
        d.path(),
        big.as_path(),
        Path::new("/nonexistent/x"),
    ] {
        let err = read_small_file(p).unwrap_err();
        assert_eq!(err.code(), "io.error", "{}", p.display());
    }
}
