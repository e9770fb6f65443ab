//! The safetensors header reader of the weights path (`tcg_run::weights`,
//! what `load_native`, `load(path)` and `Served` parse every weights file
//! with) over arbitrary bytes and any file size: the first 8 bytes of the
//! input are the size the file's `fstat` would report (up to 2^64 - 1, far
//! past any input), the rest the file's first bytes (its header length and
//! header). The reader refuses, or returns tensors whose byte ranges lie
//! inside the file, after the header, without overlapping and without any
//! offset wrapping; it never panics (the target is built with overflow
//! checks, so an unchecked sum of hostile offsets is a crash here).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_run::weights::image_entries;

fuzz_target!(|data: &[u8]| {
    let Some((size, image)) = data.split_first_chunk::<8>() else {
        return;
    };
    let claimed = u64::from_le_bytes(*size);
    // The claimed size, and the size of exactly these bytes (a file that
    // holds its header and nothing more, or its whole image).
    for size in [claimed, image.len() as u64] {
        let Ok(entries) = image_entries(image, size) else {
            continue;
        };
        let header_end = 8 + u64::from_le_bytes(image[..8].try_into().expect("8 bytes"));
        let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(entries.len());
        for e in entries.values() {
            let end = e
                .offset
                .checked_add(e.len as u64)
                .expect("an accepted tensor's end wraps");
            assert!(e.offset >= header_end, "a tensor inside the header");
            assert!(end <= size, "a tensor past the end of the file");
            assert!(e.shape.iter().all(|&d| i64::try_from(d).is_ok()));
            ranges.push((e.offset, end));
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlapping tensors {w:?}");
        }
    }
});
