//! Binding a graph's `.so` to the shim *in the base namespace* (the CUDA
//! shim runtime; crates/tcg-shim/README.md, "Loading on CUDA").
//!
//! A second link-map namespace would load a second `libcuda` for the
//! package, a second driver instance whose contexts and device pointers are
//! not the base namespace's. So on CUDA the shim is opened in the base
//! namespace with `RTLD_LOCAL` (never in the global scope, so libtorch's own
//! `aoti_torch_*` calls never reach it), and each graph's `.so` is opened
//! through a *binding stub*: a tiny shared object, written here, whose only
//! content is `DT_NEEDED` entries, in this order: the shim (by the path it
//! was opened from), the process's C++ runtime (`libstdc++.so.6`,
//! `libgcc_s.so.1`), the CUDA runtime the package's wrapper calls
//! (`libcudart`, which the package does not name itself; [`crate::cudart`])
//! and the package's `.so` (by its path), opened with
//! `RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND`. With `RTLD_DEEPBIND` every object
//! that open loads resolves its symbols in the stub's own dependency list
//! (in that order, then their dependencies, breadth first) *before* the
//! global scope; the package's `aoti_torch_*` imports therefore bind to the
//! shim even when libtorch is loaded globally, while its `libcuda` and C/C++
//! runtime imports bind to the base namespace's single copies.
//!
//! The C++ runtime comes before the package on purpose. A compiler that
//! links `libstdc++` statically (some images' default `g++` does: the H200's
//! made every package carry its own copy) leaves the package exporting that
//! copy's symbols, while the facet ids of `std::locale` are `STB_GNU_UNIQUE`
//! and so shared with the process's `libstdc++.so.6`, whose classic locale
//! has already numbered them. A package resolving its C++ symbols to itself
//! first then indexes its own locale with the other copy's numbers: the
//! `std::regex` in AOTInductor's `parse_device_str` threw `bad_cast` or
//! crashed inside `AOTInductorModelContainerCreateWithDevice`. Naming the
//! process's C++ runtime first makes the package use it for everything it
//! exports, as it does under libtorch (which puts that runtime in the global
//! scope). Nothing in the package changes (no `DT_NEEDED` added at mint,
//! every existing package works), and `dlsym` on the stub's handle finds the
//! package's exports (`AOTInductorModelContainer*`) in that same list.

use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use libloading::os::unix::Library;

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_GNU_STACK: u32 = 0x6474_e551;
const PF_RW: u32 = 4 | 2;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_HASH: u64 = 4;
const DT_STRTAB: u64 = 5;
const DT_SYMTAB: u64 = 6;
const DT_STRSZ: u64 = 10;
const DT_SYMENT: u64 = 11;

#[cfg(target_arch = "x86_64")]
const MACHINE: u16 = 62;
#[cfg(target_arch = "aarch64")]
const MACHINE: u16 = 183;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const MACHINE: u16 = 0;

/// The C++ runtime a package's C++ imports bind to (by soname: the copies the
/// shim itself already loaded), ahead of any copy the package carries.
pub const CXX_RUNTIME: [&str; 2] = ["libstdc++.so.6", "libgcc_s.so.1"];

fn pad8(v: &mut Vec<u8>) {
    while v.len() % 8 != 0 {
        v.push(0);
    }
}

/// The bytes of an ELF64 little-endian shared object with no code and no
/// symbols whose dynamic section needs `needed`, in order. One writable
/// `PT_LOAD` (glibc relocates `d_ptr` values in place), `PT_DYNAMIC`, and a
/// non-executable `PT_GNU_STACK` (without it glibc would try to make the
/// stack executable, which newer versions refuse in `dlopen`).
pub fn stub_elf(needed: &[&str]) -> Result<Vec<u8>, String> {
    if MACHINE == 0 {
        return Err("binding stubs are written for x86_64 and aarch64 only".into());
    }
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    const NPHDR: usize = 3;
    let symtab = EHDR + PHDR * NPHDR;
    let hash = symtab + 24; // one null Elf64_Sym
    let strtab = hash + 16; // nbucket, nchain, bucket[0], chain[0]
    let mut strings = vec![0u8];
    let mut offsets = Vec::with_capacity(needed.len());
    for name in needed {
        if name.as_bytes().contains(&0) {
            return Err(format!("{name:?} has a NUL byte"));
        }
        offsets.push(strings.len() as u64);
        strings.extend_from_slice(name.as_bytes());
        strings.push(0);
    }
    let strsz = strings.len();
    pad8(&mut strings);
    let dynamic = strtab + strings.len();
    let mut dyn_entries: Vec<(u64, u64)> = offsets.iter().map(|&o| (DT_NEEDED, o)).collect();
    dyn_entries.extend([
        (DT_HASH, hash as u64),
        (DT_STRTAB, strtab as u64),
        (DT_SYMTAB, symtab as u64),
        (DT_STRSZ, strsz as u64),
        (DT_SYMENT, 24),
        (DT_NULL, 0),
    ]);
    let dynsz = dyn_entries.len() * 16;
    let total = (dynamic + dynsz) as u64;

    let mut f = Vec::with_capacity(total as usize);
    // e_ident: magic, ELFCLASS64, ELFDATA2LSB, EV_CURRENT, System V ABI.
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    f.extend_from_slice(&[0; 8]);
    f.extend_from_slice(&3u16.to_le_bytes()); // ET_DYN
    f.extend_from_slice(&MACHINE.to_le_bytes());
    f.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    f.extend_from_slice(&0u64.to_le_bytes()); // e_entry
    f.extend_from_slice(&(EHDR as u64).to_le_bytes()); // e_phoff
    f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    f.extend_from_slice(&(EHDR as u16).to_le_bytes());
    f.extend_from_slice(&(PHDR as u16).to_le_bytes());
    f.extend_from_slice(&(NPHDR as u16).to_le_bytes());
    f.extend_from_slice(&64u16.to_le_bytes()); // e_shentsize
    f.extend_from_slice(&0u16.to_le_bytes()); // e_shnum
    f.extend_from_slice(&0u16.to_le_bytes()); // e_shstrndx
    let mut phdr = |kind: u32, offset: u64, size: u64, align: u64| {
        f.extend_from_slice(&kind.to_le_bytes());
        f.extend_from_slice(&PF_RW.to_le_bytes());
        f.extend_from_slice(&offset.to_le_bytes()); // p_offset
        f.extend_from_slice(&offset.to_le_bytes()); // p_vaddr
        f.extend_from_slice(&offset.to_le_bytes()); // p_paddr
        f.extend_from_slice(&size.to_le_bytes()); // p_filesz
        f.extend_from_slice(&size.to_le_bytes()); // p_memsz
        f.extend_from_slice(&align.to_le_bytes());
    };
    phdr(PT_LOAD, 0, total, 0x1000);
    phdr(PT_DYNAMIC, dynamic as u64, dynsz as u64, 8);
    phdr(PT_GNU_STACK, 0, 0, 16);
    f.extend_from_slice(&[0; 24]); // the null symbol
    for word in [1u32, 1, 0, 0] {
        f.extend_from_slice(&word.to_le_bytes());
    }
    f.extend_from_slice(&strings);
    for (tag, value) in dyn_entries {
        f.extend_from_slice(&tag.to_le_bytes());
        f.extend_from_slice(&value.to_le_bytes());
    }
    debug_assert_eq!(f.len() as u64, total);
    Ok(f)
}

/// Opens `package_so` bound to the shim loaded from `shim_path` and to the
/// CUDA runtime at `cudart` (module docs; [`crate::cudart`]): writes a stub
/// needing the shim, the C++ runtime, the CUDA runtime and the package, in
/// that order, to an anonymous file and opens it with
/// `RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND`. The returned library is the
/// stub's handle; `dlsym` on it finds the package's exports.
pub fn open_bound(shim_path: &Path, cudart: &Path, package_so: &Path) -> Result<Library, String> {
    let package = std::fs::canonicalize(package_so)
        .map_err(|e| format!("cannot resolve {}: {e}", package_so.display()))?;
    let text = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{} is not UTF-8", p.display()))
    };
    let bytes = stub_elf(&[
        &text(shim_path)?,
        CXX_RUNTIME[0],
        CXX_RUNTIME[1],
        &text(cudart)?,
        &text(&package)?,
    ])?;
    // SAFETY: a NUL-terminated name and valid flags; the fd is owned below.
    let fd = unsafe { libc::memfd_create(c"tcg-shim-bind".as_ptr(), libc::MFD_CLOEXEC) };
    let (path, _keep): (String, Box<dyn std::any::Any>) = if fd >= 0 {
        // SAFETY: a fresh descriptor nobody else owns.
        let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.write_all(&bytes)
            .map_err(|e| format!("cannot write the binding stub: {e}"))?;
        (
            format!("/proc/self/fd/{}", file.as_raw_fd()),
            Box::new(file),
        )
    } else {
        let mut file = tempfile::Builder::new()
            .prefix("tcg-shim-bind-")
            .suffix(".so")
            .tempfile()
            .map_err(|e| format!("cannot write the binding stub: {e}"))?;
        file.write_all(&bytes)
            .and_then(|()| file.flush())
            .map_err(|e| format!("cannot write the binding stub: {e}"))?;
        (text(file.path())?, Box::new(file))
    };
    let c_path = CString::new(path).map_err(|_| "the stub's path has a NUL".to_owned())?;
    // SAFETY: the stub has no code; the package's .so comes from a verified,
    // admitted artifact (its initialisers only register its kernels); the
    // shim is already loaded. RTLD_NOW: an import nobody provides is refused
    // here, not at the first call.
    let handle = unsafe {
        libc::dlopen(
            c_path.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND,
        )
    };
    if handle.is_null() {
        return Err(crate::shim_runtime::dlerror_text());
    }
    // SAFETY: a live handle from dlopen, closed once by the Library's drop.
    Ok(unsafe { Library::from_raw(handle) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stub_needing_libc_opens_and_finds_libc_symbols_through_its_own_scope() {
        let bytes = stub_elf(&["libc.so.6", "libm.so.6"]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stub.so");
        std::fs::write(&path, &bytes).unwrap();
        // SAFETY: a stub without code or initialisers.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND,
            )
        }
        .unwrap();
        // SAFETY: only the symbols' presence is asked.
        unsafe {
            assert!(lib.get::<*const u8>(b"cos").is_ok(), "libm's cos");
            assert!(lib.get::<*const u8>(b"getpid").is_ok(), "libc's getpid");
        }
    }

    #[test]
    fn a_stub_needing_a_missing_library_is_refused_by_the_loader() {
        let bytes = stub_elf(&["libtcg-no-such-library.so.9"]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stub.so");
        std::fs::write(&path, &bytes).unwrap();
        // SAFETY: as above.
        let err = unsafe {
            libloading::os::unix::Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_LOCAL)
        }
        .expect_err("a missing DT_NEEDED refuses the open");
        assert!(
            err.to_string().contains("libtcg-no-such-library.so.9"),
            "{err}"
        );
        assert!(stub_elf(&["a\0b"]).is_err());
    }
}
