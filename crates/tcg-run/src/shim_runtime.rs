//! `libtcg_shim.so`, carried inside this binary, and the link-map namespace
//! it is loaded into (crates/tcg-shim/README.md, "Loading").
//!
//! The library is built from crates/tcg-shim by this crate's build script,
//! so the shim a graph runs on is always the one built from the same sources
//! as the runtime driving it, and nothing has to be found on disk: its bytes
//! are written to an anonymous file (`memfd_create`; a temporary file where
//! that is refused) and opened from there with
//! `dlmopen(LM_ID_NEWLM, RTLD_NOW | RTLD_LOCAL)`.
//!
//! Why a namespace of its own: a `.so` minted with `link_libtorch=False` has
//! no `DT_NEEDED` on any shim, so its `aoti_torch_*` imports bind to
//! whatever the global scope of its namespace offers. In a new namespace the
//! first object loaded, the shim, *is* that global scope: every package
//! opened there binds to the shim (or a system library) and to nothing else.
//! The base namespace never sees the shim either: libtorch's own calls to its
//! `aoti_torch_*` functions go through its PLT (38 such relocations in
//! torch 2.15's libtorch_cpu.so), so a shim loaded `RTLD_GLOBAL` before
//! `import torch` would capture them; in its own namespace it cannot.

use std::ffi::{c_void, CString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use libloading::os::unix::Library;
use tcg_core::{Code, Error, Result};

/// The bytes of `libtcg_shim.so` (crates/tcg-shim, built by build.rs).
pub static SHIM_LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libtcg_shim.so"));

fn failed(message: String) -> Error {
    Error::new(Code::RunTorchNotFound, message)
}

pub(crate) fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc,
    // valid until the next dl* call on this thread; copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "no error message".into()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The embedded library as a file the dynamic loader can open: an anonymous
/// memory file, else a temporary file (removed once loaded). Returns the path
/// and what keeps the file alive until the `dlmopen`.
fn materialise() -> Result<(PathBuf, Box<dyn std::any::Any>)> {
    let name = c"libtcg_shim.so";
    // SAFETY: a NUL-terminated name and valid flags; the fd is owned below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut file = std::fs::File::from(fd);
        file.write_all(SHIM_LIBRARY)
            .map_err(|e| failed(format!("cannot write libtcg_shim.so to a memory file: {e}")))?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        return Ok((path, Box::new(file)));
    }
    let mut file = tempfile::Builder::new()
        .prefix("libtcg_shim-")
        .suffix(".so")
        .tempfile()
        .map_err(|e| {
            failed(format!(
                "cannot write libtcg_shim.so to a temporary file: {e}"
            ))
        })?;
    file.write_all(SHIM_LIBRARY)
        .and_then(|()| file.flush())
        .map_err(|e| {
            failed(format!(
                "cannot write libtcg_shim.so to a temporary file: {e}"
            ))
        })?;
    Ok((file.path().to_owned(), Box::new(file)))
}

/// Open the embedded shim into a new link-map namespace; returns the path it
/// was opened from and the handle (never closed by the caller).
pub(crate) fn open_embedded() -> Result<(PathBuf, *mut c_void)> {
    let (path, keep) = materialise()?;
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| failed("the shim's path has a NUL".into()))?;
    // SAFETY: a NUL-terminated path to a complete shared object; its
    // initialisers are the Rust runtime's and the shim's own (none that act
    // on the process).
    let handle = unsafe {
        libc::dlmopen(
            libc::LM_ID_NEWLM,
            c_path.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    // The loader mapped the file; the descriptor (or temporary file) can go.
    drop(keep);
    if handle.is_null() {
        return Err(failed(format!(
            "cannot load the shim runtime (libtcg_shim.so) into a namespace of its own: {}",
            dlerror_text()
        )));
    }
    Ok((path, handle))
}

/// Open the embedded shim into the *base* namespace with
/// `RTLD_NOW | RTLD_LOCAL`, for CUDA (`crate::shim_bind`): never in the
/// global scope, sharing the base namespace's single `libcuda`. The memory
/// file stays open for the process's life, so the path it was opened from
/// keeps naming this very library (the binding stubs need it by that path).
pub(crate) fn open_embedded_base() -> Result<(PathBuf, *mut c_void)> {
    let (path, keep) = materialise()?;
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| failed("the shim's path has a NUL".into()))?;
    // SAFETY: as in `open_embedded`.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(failed(format!(
            "cannot load the shim runtime (libtcg_shim.so) for CUDA: {}",
            dlerror_text()
        )));
    }
    // Kept open: the stubs name the library by this path.
    std::mem::forget(keep);
    Ok((path, handle))
}

/// Open the graph's `.so` at `path` into the shim's `namespace`.
pub(crate) fn open_in(
    namespace: libc::Lmid_t,
    path: &Path,
) -> std::result::Result<Library, String> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "the path has a NUL".to_owned())?;
    // SAFETY: the .so comes from the package of a verified, admitted artifact
    // (resolve checked its ELF machine and this host's ISA); its initialisers
    // only register the kernels it carries. RTLD_NOW: an import the shim
    // lacks is refused here, not at the first call.
    let handle = unsafe {
        libc::dlmopen(
            namespace,
            c_path.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        return Err(dlerror_text());
    }
    // SAFETY: a live handle from dlmopen, closed once by the Library's drop.
    Ok(unsafe { Library::from_raw(handle) })
}
