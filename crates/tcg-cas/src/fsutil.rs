//! Thin, safe wrappers of the POSIX calls the store needs.

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{io_err, Result, StoreError};

/// Open for reading without following a final symlink and without blocking on
/// FIFOs (SPEC-v1 §9.2).
pub(crate) fn open_read_nofollow(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// What a non-regular file type is, for messages.
pub(crate) fn type_name(md: &Metadata) -> &'static str {
    let ft = md.file_type();
    if ft.is_file() {
        "regular file"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() {
        "block device"
    } else if ft.is_char_device() {
        "character device"
    } else {
        "unknown file type"
    }
}

/// Open `path` as a regular file (no symlink, FIFO, directory, socket, device).
/// `Ok(None)` when it does not exist.
pub(crate) fn open_regular(path: &Path) -> Result<Option<(File, Metadata)>> {
    let file = match open_read_nofollow(path) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(StoreError::NotRegularFile {
                path: path.to_owned(),
                found: "symlink",
            })
        }
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(StoreError::NotRegularFile {
                path: path.to_owned(),
                found: "socket",
            })
        }
        Err(e) => return Err(io_err("open", path)(e)),
    };
    let md = file.metadata().map_err(io_err("fstat", path))?;
    if !md.file_type().is_file() {
        return Err(StoreError::NotRegularFile {
            path: path.to_owned(),
            found: type_name(&md),
        });
    }
    crate::secure::check_md(path, &md)?;
    Ok(Some((file, md)))
}

/// fsync a directory.
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(io_err("open directory", path))?;
    f.sync_all().map_err(io_err("fsync directory", path))
}

/// `flock(2)`, retrying EINTR. Returns false on EWOULDBLOCK with `nonblock`.
pub(crate) fn flock(file: &File, exclusive: bool, nonblock: bool) -> io::Result<bool> {
    let mut op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    if nonblock {
        op |= libc::LOCK_NB;
    }
    loop {
        // SAFETY: flock on a valid, owned descriptor.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if nonblock => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// An open lock file held under `flock`; dropping it closes the descriptor and
/// releases the lock.
#[derive(Debug)]
pub(crate) struct FileLock {
    pub(crate) file: File,
}

/// Open (creating if needed) `path` and lock it.
pub(crate) fn lock_path(path: &Path, exclusive: bool) -> Result<FileLock> {
    let file = open_lock_file(path)?;
    flock(&file, exclusive, false).map_err(io_err("flock", path))?;
    Ok(FileLock { file })
}

/// Open (creating if needed) a lock file.
pub(crate) fn open_lock_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err("open lock", path))
}

/// `n` bytes from the operating system's CSPRNG.
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: writing into our own buffer within bounds.
        let rc = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            panic!("getrandom failed: {e}");
        }
        filled += rc as usize;
    }
    buf
}

/// 32 random lowercase hex characters.
pub(crate) fn random_hex32() -> String {
    hex::encode(random_bytes::<16>())
}

/// The `statfs` f_type of the filesystem holding `path`.
pub(crate) fn statfs_type(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| StoreError::Io {
        op: "statfs",
        path: path.to_owned(),
        source: io::Error::from_raw_os_error(libc::EINVAL),
    })?;
    // SAFETY: zeroed statfs is a valid out-parameter; c is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io_err("statfs", path)(io::Error::last_os_error()));
    }
    Ok(st.f_type as u64)
}

/// The name of a network or cluster filesystem magic, if `magic` is one.
pub fn network_filesystem_name(magic: u64) -> Option<&'static str> {
    Some(match magic {
        0x6969 => "nfs",
        0x517b => "smb",
        0xff53_4d42 => "cifs",
        0xfe53_4d42 => "smb2",
        0x0bd0_0bd0 => "lustre",
        0x4750_4653 => "gpfs",
        0x00c3_6400 => "cephfs",
        0x5346_414f => "afs",
        0x6b41_4653 => "afs",
        0x564c => "ncp",
        0x0102_1997 => "9p",
        _ => return None,
    })
}

/// `ioctl(FICLONERANGE)`: share `len` bytes of `src` at 0 into `dst` at `dst_off`.
pub(crate) fn ficlone_range(src: &File, dst: &File, len: u64, dst_off: u64) -> io::Result<()> {
    #[repr(C)]
    struct FileCloneRange {
        src_fd: i64,
        src_offset: u64,
        src_length: u64,
        dest_offset: u64,
    }
    const FICLONERANGE: libc::c_ulong = 0x4020_940d;
    let arg = FileCloneRange {
        src_fd: src.as_raw_fd() as i64,
        src_offset: 0,
        src_length: len,
        dest_offset: dst_off,
    };
    // SAFETY: FICLONERANGE reads a file_clone_range struct we own.
    let rc = unsafe {
        libc::ioctl(
            dst.as_raw_fd(),
            FICLONERANGE as _,
            &arg as *const FileCloneRange,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Copy `len` bytes from `src` at `src_off` to `dst` at `dst_off` in the kernel.
/// Returns the number of bytes copied (short only at EOF of `src`).
pub(crate) fn copy_range(
    src: &File,
    src_off: u64,
    dst: &File,
    len: u64,
    dst_off: u64,
) -> io::Result<u64> {
    let mut in_off: libc::loff_t = src_off as libc::loff_t;
    let mut out_off: libc::loff_t = dst_off as libc::loff_t;
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(1 << 30) as usize;
        // SAFETY: valid descriptors and offset pointers we own.
        let rc = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut in_off,
                dst.as_raw_fd(),
                &mut out_off,
                want,
                0,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if rc == 0 {
            break;
        }
        done += rc as u64;
    }
    Ok(done)
}

/// Create every missing directory from `base` down to `dir` (mode 0700
/// whatever the umask), returning the ones created, outermost first.
pub(crate) fn create_dirs_tracked(base: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let rel = dir.strip_prefix(base).unwrap_or(dir);
    let mut cur = base.to_path_buf();
    let mut made = Vec::new();
    for comp in rel.components() {
        cur.push(comp);
        if crate::secure::create_private_dir(&cur)? {
            made.push(cur.clone());
        }
    }
    Ok(made)
}

/// Ask the kernel to start writing back a range now (no wait, errors ignored:
/// the fsync that follows is what counts).
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    // SAFETY: sync_file_range on a valid descriptor with plain integers.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}
