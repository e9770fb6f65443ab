//! Faults on a real filesystem: ENOSPC and a read-only remount during an
//! ingest surface as typed I/O errors (errno kept), never as corruption, and
//! leave the store consistent. Needs root (mount); fails loudly without it.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use tcg_cas::{GcOptions, Store, StoreError, Target};

/// A tmpfs mounted for one test; unmounted on every path (lazily if busy).
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(at: &Path, size: &str) -> Mount {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .expect("run mount");
        if !out.status.success() {
            panic!(
                "\n\n*** FAULT TESTS NEED TO MOUNT A TMPFS (root / CAP_SYS_ADMIN) AND COULD NOT ***\n\
                 mount said: {}\nthese tests are NOT skipped: run them where mount works.\n",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Mount(at.to_owned())
    }

    fn remount(&self, opt: &str) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,{opt}")])
            .arg(&self.0)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "remount {opt} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

fn assert_io_errno(e: &StoreError, errno: i32) {
    assert_eq!(e.code(), "io.error", "{e}");
    assert_eq!(e.raw_os_error(), Some(errno), "{e}");
    assert!(!e.is_bad_stored_bytes());
}

#[test]
fn a_full_filesystem_during_ingest_is_an_enospc_io_error_and_the_store_stays_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = Mount::tmpfs(&dir.path().join("mnt"), "1m");
    {
        let store = small_store(&mnt.0.join("s"));
        let lease = store.lease().unwrap();
        let before = store.ingest_reader(&lease, &bytes(1, 30_000)[..]).unwrap();
        store
            .compare_and_swap("f/ok", None, Some(&Target::manifest(before.manifest)))
            .unwrap();
        // Stream writer and file ingest both report ENOSPC as plain I/O.
        let mut w = store.chunked_writer(&lease);
        let mut err = None;
        for i in 0..200u64 {
            if let Err(e) = w.write_all(&bytes(100 + i, 16 * 1024)) {
                err = Some(StoreError::from_io(e, "write", "x"));
                break;
            }
        }
        // The helper thread's failure surfaces on a later write or at finish.
        let e = match err {
            Some(e) => {
                drop(w);
                e
            }
            None => w.finish().expect_err("a 1 MiB tmpfs fills up"),
        };
        assert_io_errno(&e, libc::ENOSPC);
        let e = store
            .ingest_reader(&lease, &bytes(7, 2 << 20)[..])
            .unwrap_err();
        assert_io_errno(&e, libc::ENOSPC);
        lease.end().unwrap();
        assert_fsck_clean(&store);
        let refs = store.list_refs("").unwrap();
        assert_eq!(refs.entries.len(), 1);
        assert!(refs.unreadable.is_empty());
        store.gc(&GcOptions::default()).unwrap();
        assert!(dir_entries(&store.root().join("tmp")).is_empty());
        assert_fsck_clean(&store);
        // Space is back: ingest works again.
        let lease = store.lease().unwrap();
        store.ingest_reader(&lease, &bytes(8, 20_000)[..]).unwrap();
    }
    drop(mnt);
}

#[test]
fn a_read_only_remount_during_ingest_is_an_erofs_io_error_and_the_store_stays_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = Mount::tmpfs(&dir.path().join("mnt"), "16m");
    {
        let store: Store = small_store(&mnt.0.join("s"));
        let lease = store.lease().unwrap();
        let mut w = store.chunked_writer(&lease);
        // Two whole chunks are installed; between chunks no store file is
        // open for writing, so the remount is allowed.
        w.write_all(&bytes(2, 2 * SMALL_CHUNK as usize)).unwrap();
        w.flush().unwrap();
        mnt.remount("ro");
        let r = w
            .write_all(&bytes(3, 20_000))
            .map_err(|e| StoreError::from_io(e, "write", "x"))
            .and_then(|()| w.finish().map(|_| ()));
        let e = r.expect_err("a read-only store cannot take writes");
        assert_io_errno(&e, libc::EROFS);
        let e = store.put_bytes(&lease, b"more").unwrap_err();
        assert_io_errno(&e, libc::EROFS);
        drop(lease); // cannot remove its file on a read-only fs
        mnt.remount("rw");
        let r = store.fsck(tcg_cas::FsckOptions::default()).unwrap();
        assert!(r.is_clean(), "{r:?}");
        assert_eq!(
            r.reaped_leases, 1,
            "the ended lease's file is dead and reaped"
        );
        assert!(store.list_refs("").unwrap().entries.is_empty());
        assert!(dir_entries(&store.root().join("tmp")).is_empty());
        assert!(dir_entries(&store.root().join("leases")).is_empty());
    }
    drop(mnt);
}
