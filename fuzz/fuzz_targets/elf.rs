//! The ELF64 section-table reader over arbitrary bytes: the in-memory and
//! the streaming parser agree.
#![no_main]

use std::io::Read;

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::package::elf::{parse_elf, parse_elf_stream};

fuzz_target!(|data: &[u8]| {
    let whole = parse_elf(data);
    let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> tcg_core::Result<()>| f(&mut &data[..]);
    let streamed = parse_elf_stream(data.len() as u64, &mut reopen);
    match (whole, streamed) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.code(), b.code()),
        (a, b) => panic!("parsers disagree: {a:?} vs {b:?}"),
    }
});
