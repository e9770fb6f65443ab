//! The constant map of AOTInductor's first binding API, for runtimes that
//! lack the C pairs API (`UpdateConstantBufferPairs`; torch 2.11 has only
//! `AOTInductorModelContainerUpdateConstantBuffer`, which takes a pointer to a
//! `std::unordered_map<std::string, AtenTensorHandle>`).
//!
//! The map is laid out here exactly as libstdc++ lays one out (its layout is
//! part of libstdc++'s stable ABI since the C++11 string ABI of GCC 5), and it
//! is only ever *read* by the container (`find` in
//! `AOTInductorModelContainer::update_constant_buffer`, which takes it by
//! const reference): nothing in C++ frees, grows or moves it. One bucket
//! holds every node, so a lookup walks the chain comparing the cached hash and
//! the key; the hash is libstdc++'s own `std::_Hash_bytes` with the seed
//! `std::hash<std::string>` uses, taken from the loaded `libstdc++.so.6`.
//!
//! Used only when torch was built with the C++11 string ABI (checked through
//! a symbol of `libc10.so` whose mangled name spells it), or, on the shim
//! runtime, when the graph's `.so` names that ABI in its dynamic symbols.

use std::ffi::{c_void, CString};
use std::path::Path;

use libloading::os::unix::{Library, Symbol, RTLD_LOCAL, RTLD_NOW};
use tcg_core::{Code, Error, Result};

/// `std::hash<std::string>`'s seed in libstdc++ (`functional_hash.h`).
const STRING_HASH_SEED: usize = 0xc70f_6907;
/// A libc10 function taking a `std::__cxx11::basic_string`: present only when
/// torch was built with the C++11 string ABI, which this layout is.
const CXX11_PROBE: &str =
    "_ZN3c106detail14torchCheckFailEPKcS2_jRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";

type HashBytes = unsafe extern "C" fn(*const c_void, usize, usize) -> usize;

/// `std::__cxx11::basic_string<char>`: pointer, length, then the local
/// buffer / capacity union (16 bytes).
#[repr(C)]
struct CxxString {
    ptr: *const u8,
    len: usize,
    local: [u8; 16],
}

/// `_Hash_node<pair<const string, AtenTensorHandle>, true>`: the next
/// pointer, the value, then the cached hash code.
#[repr(C)]
struct Node {
    next: *mut Node,
    key: CxxString,
    value: *mut c_void,
    hash: usize,
}

/// `std::_Hashtable` (all of `std::unordered_map`): buckets, bucket count,
/// the before-begin node, element count, rehash policy (max load factor and
/// next resize), and the single-bucket storage used when there is one bucket.
#[repr(C)]
struct Hashtable {
    buckets: *mut *mut Node,
    bucket_count: usize,
    before_begin: *mut Node,
    element_count: usize,
    max_load_factor: f32,
    next_resize: usize,
    single_bucket: *mut Node,
}

/// An immutable `std::unordered_map<std::string, AtenTensorHandle>` whose
/// memory Rust owns; pass [`ConstantMap::as_ptr`] to the container.
pub(crate) struct ConstantMap {
    table: Box<Hashtable>,
    // Never grown after the chain is built, so the nodes never move.
    _nodes: Vec<Node>,
    _keys: Vec<CString>,
}

/// libstdc++'s string hash, and proof that torch uses the layout above.
pub(crate) struct CxxAbi {
    hash_bytes: HashBytes,
    _stdcxx: Library,
}

impl CxxAbi {
    /// Check torch's string ABI (`torch_dir/libc10.so`) and take
    /// `std::_Hash_bytes` from the `libstdc++.so.6` libtorch loaded.
    pub(crate) fn open(torch_dir: &Path) -> Result<CxxAbi> {
        let refuse = |why: String| {
            Error::new(
                Code::RunNativeUnsupported,
                format!("this torch has no C binding API for constants and {why}; use load()"),
            )
        };
        // SAFETY: libc10 is already loaded (libtorch depends on it); opening
        // it again only takes a reference, and only a symbol's presence is read.
        let c10 =
            unsafe { Library::open(Some(torch_dir.join("libc10.so")), RTLD_NOW | RTLD_LOCAL) }
                .map_err(|e| refuse(format!("libc10.so cannot be inspected: {e}")))?;
        // SAFETY: only the address is looked up, never called.
        let probe: std::result::Result<Symbol<*const c_void>, _> =
            unsafe { c10.get(CXX11_PROBE.as_bytes()) };
        if probe.is_err() {
            return Err(refuse("it was not built with the C++11 string ABI".into()));
        }
        // libtorch links libstdc++.so.6, so this is the loaded copy.
        CxxAbi::with_system_hash(refuse)
    }

    /// For a graph on the shim runtime (no libtorch to ask): the string ABI
    /// is read from the graph's own `.so` at `so`, which must name the C++11
    /// strings in its dynamic symbols (every AOTInductor wrapper built with
    /// `_GLIBCXX_USE_CXX11_ABI=1`, the only ABI of torch's wheels since 2.7,
    /// does: its `std::string` code calls or carries `std::__cxx11`
    /// functions), and `std::_Hash_bytes` is the system `libstdc++.so.6`'s
    /// (the same function in every libstdc++, a copy linked into the `.so`
    /// included).
    pub(crate) fn for_shared_object(so: &Path) -> Result<CxxAbi> {
        let refuse = |why: String| {
            Error::new(
                Code::RunNativeUnsupported,
                format!(
                    "the graph's .so binds constants only through a std::unordered_map, and {why}"
                ),
            )
        };
        let file = std::fs::File::open(so)
            .map_err(|e| Error::io(format_args!("cannot open {}", so.display()), &e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format_args!("cannot inspect {}", so.display()), &e))?
            .len();
        let cxx11 = tcg_core::artifact::package::shim_imports::names_cxx11_strings(
            &mut tcg_core::artifact::package::loadable::FileRanges { file: &file, size },
        )
        .map_err(|e| Error::new(Code::RunPackageInvalid, e.message().to_owned()))?;
        if !cxx11 {
            return Err(refuse(
                "its dynamic symbols do not show the C++11 string ABI the map is laid out in"
                    .into(),
            ));
        }
        CxxAbi::with_system_hash(refuse)
    }

    /// `std::_Hash_bytes` of the system `libstdc++.so.6` (the process's
    /// loaded copy where there is one); a failure is `refuse`d.
    fn with_system_hash(refuse: impl Fn(String) -> Error) -> Result<CxxAbi> {
        // SAFETY: the system C++ runtime; its initialisers set up its own state.
        let stdcxx = unsafe { Library::open(Some("libstdc++.so.6"), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| refuse(format!("libstdc++.so.6 cannot be opened: {e}")))?;
        // SAFETY: `std::_Hash_bytes(const void*, size_t, size_t) -> size_t`.
        let hash_bytes: Symbol<HashBytes> = unsafe { stdcxx.get(b"_ZSt11_Hash_bytesPKvmm") }
            .map_err(|e| refuse(format!("libstdc++ lacks std::_Hash_bytes: {e}")))?;
        Ok(CxxAbi {
            hash_bytes: *hash_bytes,
            _stdcxx: stdcxx,
        })
    }

    /// For the graph whose `.so` is at `so` on `torch`'s runtime: libtorch's
    /// own ABI ([`CxxAbi::open`]), or on the shim the graph's
    /// ([`CxxAbi::for_shared_object`]).
    pub(crate) fn for_graph(torch: &crate::Torch, so: &Path) -> Result<CxxAbi> {
        if torch.runtime() == crate::Runtime::ShimV1 {
            CxxAbi::for_shared_object(so)
        } else {
            CxxAbi::open(torch.dir())
        }
    }

    /// The map of `entries` (name, tensor handle).
    pub(crate) fn map(&self, entries: &[(&CString, *mut c_void)]) -> ConstantMap {
        let keys: Vec<CString> = entries.iter().map(|(k, _)| (*k).clone()).collect();
        let mut nodes: Vec<Node> = keys
            .iter()
            .zip(entries)
            .map(|(key, (_, value))| {
                let bytes = key.as_bytes();
                // SAFETY: hashes `bytes.len()` readable bytes.
                let hash = unsafe {
                    (self.hash_bytes)(bytes.as_ptr().cast(), bytes.len(), STRING_HASH_SEED)
                };
                Node {
                    next: std::ptr::null_mut(),
                    key: CxxString {
                        ptr: bytes.as_ptr(),
                        len: bytes.len(),
                        local: [0; 16],
                    },
                    value: *value,
                    hash,
                }
            })
            .collect();
        // Chain the nodes in order (the vector is complete: it never moves again).
        let base = nodes.as_mut_ptr();
        for i in 1..nodes.len() {
            // SAFETY: `i - 1` and `i` are in bounds of the vector's buffer.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let first: *mut Node = if nodes.is_empty() {
            std::ptr::null_mut()
        } else {
            base
        };
        let mut table = Box::new(Hashtable {
            buckets: std::ptr::null_mut(),
            bucket_count: 1,
            before_begin: first,
            element_count: nodes.len(),
            max_load_factor: 1.0,
            next_resize: 0,
            single_bucket: std::ptr::null_mut(),
        });
        // The one bucket starts at the before-begin node (libstdc++ points a
        // bucket at the node *before* its first), and the bucket array is the
        // table's own single-bucket slot, as libstdc++ does for one bucket.
        let before_begin: *mut *mut Node = &mut table.before_begin;
        table.single_bucket = if nodes.is_empty() {
            std::ptr::null_mut()
        } else {
            before_begin.cast()
        };
        table.buckets = &mut table.single_bucket;
        ConstantMap {
            table,
            _nodes: nodes,
            _keys: keys,
        }
    }
}

impl ConstantMap {
    /// The `std::unordered_map*` the container reads (valid while `self` lives).
    pub(crate) fn as_ptr(&self) -> *mut c_void {
        (&*self.table as *const Hashtable).cast_mut().cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_object_without_the_cxx11_abi_or_not_elf_is_refused_with_a_code() {
        let dir = tempfile::tempdir().unwrap();
        // A real shared object that names no C++ at all (C, built by `cc`,
        // which the shim's own build needs too).
        let src = dir.path().join("plain.c");
        std::fs::write(&src, "int plain(void) { return 7; }\n").unwrap();
        let plain = dir.path().join("plain.so");
        let out = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&plain)
            .arg(&src)
            .output()
            .expect("a C compiler (cc)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = CxxAbi::for_shared_object(&plain).err().unwrap();
        assert_eq!(err.code(), Code::RunNativeUnsupported, "{}", err.message());
        assert!(
            err.message().contains("C++11 string ABI"),
            "{}",
            err.message()
        );
        // Bytes that are not ELF.
        let junk = dir.path().join("junk.so");
        std::fs::write(&junk, b"\x7fELF not really an object").unwrap();
        let err = CxxAbi::for_shared_object(&junk).err().unwrap();
        assert_eq!(err.code(), Code::RunPackageInvalid, "{}", err.message());
    }

    #[test]
    fn the_layout_is_libstdcxx_s() {
        assert_eq!(std::mem::size_of::<CxxString>(), 32);
        assert_eq!(std::mem::size_of::<Node>(), 56);
        assert_eq!(std::mem::offset_of!(Node, hash), 48);
        assert_eq!(std::mem::size_of::<Hashtable>(), 56);
        assert_eq!(std::mem::offset_of!(Hashtable, single_bucket), 48);
    }
}
