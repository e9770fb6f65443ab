//! The ELF64 readers over arbitrary bytes: the in-memory and the streaming
//! section-table parsers agree, and the loader checks and the C++-runtime
//! test and the shim-import reader either accept or refuse with `artifact.elf_invalid`, never panic,
//! whichever way the bytes are held.
#![no_main]

use std::io::Read;

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::package::cxx_runtime::runtime_definitions;
use tcg_core::artifact::package::elf::{parse_elf, parse_elf_stream};
use tcg_core::artifact::package::loadable::{check_loadable, StreamRanges};
use tcg_core::artifact::package::shim_imports::dynamic_imports;
use tcg_core::Code;

fuzz_target!(|data: &[u8]| {
    let whole = parse_elf(data);
    let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> tcg_core::Result<()>| f(&mut &data[..]);
    let streamed = parse_elf_stream(data.len() as u64, &mut reopen);
    let parsed = match (whole, streamed) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b);
            true
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.code(), b.code());
            false
        }
        (a, b) => panic!("parsers disagree: {a:?} vs {b:?}"),
    };
    if !parsed {
        return;
    }
    if let Err(e) = check_loadable(&mut &data[..]) {
        assert_eq!(e.code(), Code::ArtifactElfInvalid, "{e}");
    }
    let in_memory = runtime_definitions(&mut &data[..]);
    let mut stream = StreamRanges {
        size: data.len() as u64,
        reopen: &mut reopen,
    };
    match (in_memory, runtime_definitions(&mut stream)) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => {
            assert_eq!(a.code(), Code::ArtifactElfInvalid, "{a}");
            assert_eq!(a.code(), b.code());
        }
        (a, b) => panic!("the runtime test disagrees: {a:?} vs {b:?}"),
    }
    let in_memory = dynamic_imports(&mut &data[..]);
    let mut stream = StreamRanges {
        size: data.len() as u64,
        reopen: &mut reopen,
    };
    match (in_memory, dynamic_imports(&mut stream)) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => {
            assert_eq!(a.code(), Code::ArtifactElfInvalid, "{a}");
            assert_eq!(a.code(), b.code());
        }
        (a, b) => panic!("the shim-import reader disagrees: {a:?} vs {b:?}"),
    }
});
